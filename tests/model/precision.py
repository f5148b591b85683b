"""How accurate a bf16 model is: its logits against a wider evaluation of the same weights.

A compiled bf16 model and the eager bf16 model are two bf16 evaluations of the same maths, so the
difference between them is the sum of two rounding errors and says little on its own. Each is
instead compared with a reference that evaluates the same weights in a wider format:

    fp64_copy(model)    a copy of the model with every parameter widened to fp64 (exact: bf16 and
                        fp32 values are fp64 values). Costs 4x the bf16 weights: small models.
    widened()           a dispatch mode under which the bf16 model itself computes in fp64: every
                        bf16 operand is widened just before the op that reads it, and an op that
                        would produce bf16 produces fp64. No copy of the weights, so it serves the
                        proxy, whose 131 GiB of bf16 weights leave no room for a wider copy.

Both keep the model's own fp32 steps (its `.float()` statistics and quantisation maths) in fp32,
as the float64 model does: the reference rounds at fp32 or finer, 2^16 times finer than bf16.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# bf16 keeps 8 significant bits: round to nearest moves a value by at most 2^-8 of itself
U_BF16 = 2.0 ** -8
U_FP32 = 2.0 ** -24

aten = torch.ops.aten


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the whole tensor, in fp64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def fp64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model with the same weights, widened to fp64."""
    return copy.deepcopy(model).to(torch.float64)


def stream_roundings(cfg) -> int:
    """bf16 roundings on a logit's path through the residual streams: each layer's two sites
    (attention, FFN) round their sublayer's output and the updated streams, an Engram layer's
    injection rounds the streams once more, and the head rounds the collapse and the final norm."""
    return 2 * 2 * cfg.n_layers + len(cfg.engram_layers) + 2


def bf16_format_bound(cfg) -> float:
    """The relative logits error a bf16 evaluation of the model `cfg` may reach against the fp64
    one, from the format: `stream_roundings` roundings of at most U_BF16 each, summed in the worst
    case, with unit growth (a normalised sublayer passes a relative perturbation of its input on at
    most unchanged, and the residual carries it). Roundings inside fp32 accumulators add only
    fp32-sized terms. Outside this first-order count: a discrete choice (a top-k over near-tied
    bf16 scores) that bf16 breaks the other way; on tiny it keeps eager bf16 well inside the bound
    (tests/model/test_precision.py)."""
    return stream_roundings(cfg) * U_BF16


# ---- the widened evaluation ----------------------------------------------------------------------

NARROW, WIDE = torch.bfloat16, torch.float64
# ops that only move values (widening before or after is the same): widened after, so a lookup in
# the embedding table widens the rows it reads, not the table
_MOVES = {aten.embedding.default, aten.index.Tensor, aten.index_select.default}


def _wide(x):
    if isinstance(x, torch.Tensor) and x.dtype == NARROW:
        return x.to(WIDE)
    return WIDE if x is NARROW else x  # a dtype argument: an op asked for bf16 produces fp64


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm(a [M, K], b [G, K, N], offs) in fp64, one group at a time: torch's op
    takes no fp64, and widening the whole expert bank at once would not fit beside the proxy."""
    if a.dim() != 2 or b.dim() != 3 or offs is None or bias is not None:
        raise NotImplementedError("widened(): _grouped_mm of a 2-d a, a 3-d b and offs only (the model's experts)")
    a = _wide(a)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for group, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ _wide(b[group])
        start = end
    return out


class _Widened(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._grouped_mm.default:
            return _grouped_mm(*args, **kwargs)
        if func is getattr(aten.mm, "dtype", None):
            # the head's bf16 x bf16 -> fp32 product (model.transformer.head_logits on CUDA): exact
            # products summed in fp32, as the widened form the CPU takes; the fp64 weight would not fit
            a, b, out_dtype = args
            return torch.mm(a.float(), b.float()).to(out_dtype)
        if func.is_view:  # a view of a weight keeps its dtype and costs nothing
            return func(*args, **kwargs)
        if func is aten._to_copy.default and kwargs.get("dtype", NARROW) != NARROW:
            # a widening cast (the head's `weight.float()`) is exact as it is; widening the weight to
            # fp64 first would hold it twice over
            return func(*args, **kwargs)
        if func in _MOVES:
            return tree_map(_wide, func(*args, **kwargs))
        if func._schema.is_mutable:
            # the mutated tensor (first argument) must not be swapped for a widened copy
            if isinstance(args[0], torch.Tensor) and args[0].dtype == NARROW:
                raise RuntimeError(f"widened(): {func} writes into a bf16 tensor")
            return func(args[0], *tree_map(_wide, args[1:]), **tree_map(_wide, kwargs))
        return func(*tree_map(_wide, args), **tree_map(_wide, kwargs))


@contextlib.contextmanager
def widened():
    """Eager bf16 code run inside computes in fp64 (module docstring); no autograd."""
    with torch.no_grad(), _Widened():
        yield
