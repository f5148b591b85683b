"""The project's canonical ops: what a pass rewrites a matched chain into.

Each fusion has two ops with one signature:

    megafuse::<name>          canonical, functional; its eager implementation is the torch reference.
                              Passes emit it, the report and the inspector see it.
    megafuse::<name>_kernel   launches the Triton kernel generated for the call's FusionSpec (real
                              Triton on CUDA, the interpreter on CPU).

An Inductor lowering binds the first to the second, so a compiled graph runs the generated kernel
while the post-grad graph (and anything that runs it eagerly) keeps the reference semantics.
"""

from __future__ import annotations

import torch
from torch._inductor.lowering import fallback_handler, register_lowering

from lowering import mega_gate as gate_kernels


def gate_spec(u: torch.Tensor, weight: torch.Tensor, bias, score_func: str, k: int, renorm: bool,
              renorm_eps: float, scale: float, precision: str, logits_dtype: str) -> "gate_kernels.GateSpec":
    return gate_kernels.GateSpec(
        n_experts=weight.shape[0], hidden=weight.shape[1], k=k, score_func=score_func,
        has_bias=bias is not None, renorm=renorm, renorm_eps=renorm_eps, scale=scale,
        input_dtype=str(u.dtype).removeprefix("torch."), weight_dtype=str(weight.dtype).removeprefix("torch."),
        precision=precision, logits_dtype=logits_dtype,
    )


@torch.library.custom_op("megafuse::mega_gate", mutates_args=())
def mega_gate(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, score_func: str, k: int,
              renorm: bool, renorm_eps: float, scale: float, precision: str,
              logits_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate GEMM + scoring + (bias) + top-k + gather + (renormalise) + (scale): the torch reference."""
    spec = gate_spec(u, weight, bias, score_func, k, renorm, renorm_eps, scale, precision, logits_dtype)
    return gate_kernels.reference(u, weight, bias, spec)


@torch.library.custom_op("megafuse::mega_gate_kernel", mutates_args=())
def mega_gate_kernel(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, score_func: str, k: int,
                     renorm: bool, renorm_eps: float, scale: float, precision: str,
                     logits_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    spec = gate_spec(u, weight, bias, score_func, k, renorm, renorm_eps, scale, precision, logits_dtype)
    return gate_kernels.mega_gate(u, weight, bias, spec)


def _gate_fake(u, weight, bias, score_func, k, renorm, renorm_eps, scale, precision, logits_dtype):
    rows = u.shape[0]
    return u.new_empty(rows, k, dtype=torch.float32), u.new_empty(rows, k, dtype=torch.int64)


mega_gate.register_fake(_gate_fake)
mega_gate_kernel.register_fake(_gate_fake)


def _bind(canonical, kernel) -> None:
    """Lower `canonical` to a fallback call of `kernel` (same signature) in Inductor's output code."""
    handler = fallback_handler(kernel, add_to_fallback_set=False)
    register_lowering(canonical, type_promotion_kind=None)(lambda *args, **kwargs: handler(*args, **kwargs))


_bind(torch.ops.megafuse.mega_gate.default, torch.ops.megafuse.mega_gate_kernel.default)

