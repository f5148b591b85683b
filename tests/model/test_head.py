"""The head's projection (model.transformer.head_logits, docs/model.md section 2): on the CPU the
widened fp32 formula bit for bit; on CUDA a bf16 model multiplies its stored bf16 weight with fp32
accumulation (`aten::mm.dtype`), never casting the vocab x D weight to fp32; and on the GPU, at
flash-lite's widths, its logits are as accurate as the fp32 head's against fp64."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from megafuse.model import build_model, preset
from megafuse.model.transformer import head_logits
from tests.model.precision import U_FP32, rel

aten = torch.ops.aten


def _widened(y, weight):
    """The head as it was written before head_logits: both operands widened to fp32."""
    return y.float() @ weight.float().t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpu_head_is_the_widened_fp32_product_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(2, 3, 256, generator=g).to(dtype)
    weight = (torch.rand(1000, 256, generator=g) - 0.5).to(dtype)
    logits = head_logits(y, weight)
    assert logits.dtype == torch.float32 and logits.shape == (2, 3, 1000)
    assert torch.equal(logits, _widened(y, weight))


def test_the_tiny_models_logits_are_the_widened_head_of_its_final_norm():
    cfg = preset("tiny").replace(dtype="bfloat16")
    model = build_model(cfg, seed=0)
    seen = {}
    model.norm.register_forward_hook(lambda module, args, out: seen.setdefault("y", out))
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    assert torch.equal(logits, _widened(seen["y"], model.head.weight))


def _ops(device: str, dtype: torch.dtype) -> list:
    """The ATen ops head_logits runs for fake tensors on `device` (no such device needed)."""
    with FakeTensorMode():
        y = torch.empty(1, 3, 64, dtype=dtype, device=device)
        weight = torch.empty(100, 64, dtype=dtype, device=device)
    graph = make_fx(head_logits)(y, weight).graph
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.mark.skipif("dtype" not in aten.mm.overloads(), reason="this torch has no aten::mm.dtype")
def test_a_bf16_head_on_cuda_multiplies_the_stored_weight_with_fp32_accumulation():
    ops = _ops("cuda", torch.bfloat16)
    assert aten.mm.dtype in ops and aten._to_copy.default not in ops  # no cast of the weight (nor of y)
    # the CPU, and an fp32 model anywhere, keep the widened form (for fp32 the casts are no-ops)
    assert aten.mm.dtype not in _ops("cpu", torch.bfloat16) and aten._to_copy.default in _ops("cpu", torch.bfloat16)
    assert aten.mm.dtype not in _ops("cuda", torch.float32)


# ---- on the GPU ----------------------------------------------------------------------------------

FLASH_LITE = preset("flash-lite")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 32])
def test_the_bf16_head_is_as_accurate_as_the_fp32_head_at_flash_lite_widths(rows):
    """Random bf16 inputs at dim 5120, vocab 129280. Both heads form the exact products (bf16 x bf16
    fits fp32's significand) and sum D of them in fp32; with products of random sign the summation's
    rounding errors add as a random walk, a relative error of about sqrt(D) * 2^-24 against exact
    arithmetic (fp64 here, exact for these sums to 2^-53). The bound allows 4x that, for either
    head, and for their difference (two such errors)."""
    D, V = FLASH_LITE.dim, FLASH_LITE.vocab_size
    assert (D, V) == (5120, 129280)
    g = torch.Generator(device="cuda").manual_seed(rows)
    y = torch.randn(rows, D, device="cuda", generator=g).to(torch.bfloat16)  # a normalised row: unit scale
    weight = ((torch.rand(V, D, device="cuda", generator=g) * 2 - 1) * D ** -0.5).to(torch.bfloat16)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 head in true fp32, not TF32
    try:
        logits = head_logits(y, weight)
        fp32 = _widened(y, weight)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    exact = y.double() @ weight.double().t()
    bound = 4 * D ** 0.5 * U_FP32
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    errors = {"bf16 head vs fp64": rel(logits, exact), "fp32 head vs fp64": rel(fp32, exact),
              "bf16 head vs fp32 head": rel(logits, fp32)}
    print(f"rows {rows}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()) + f" (bound {bound:.2e})")
    assert errors["bf16 head vs fp64"] <= bound, errors
    assert errors["fp32 head vs fp64"] <= bound, errors
    assert errors["bf16 head vs fp32 head"] <= 2 * bound, errors
