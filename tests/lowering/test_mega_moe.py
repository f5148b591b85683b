"""Mega-MoE kernels against an fp64 reference of the chain, with bounds from the formats' rounding.

The reference runs the chain in float64 with the chain's rounding points (bf16 tokens, gate_up,
act and down in the bf16 form; MXFP8 of act), so what is left between it and the kernel is fp32
accumulation and the roundings themselves. The bound per output element follows the chain:

    gate_up:  |dg|   <= gamma_D |W13| |x| + u_r |g|            gamma_n = n 2^-24 (fp32 sums of n terms),
    act:      |dact| <= |w| (1.1 L |dg| + L |dv|) + u_r |act|   u_r = 2^-8 where the chain rounds to bf16
              (+ 2^-3 |act| + 2^-16 amax of its block under MXFP8: one e4m3 step, its scale may double)
    down:     |dd|   <= |W2| |dact| + gamma_F |W2| |act| + u_r |down|
    out:      |dout| <= sum over k of |dd| + gamma_k |out| + u_out |out|

With the weight after the down projection (weight_at="after", HF's placement) act carries no w and
each slot's output is down * w rounded to weighted_dtype: |dslot| <= |w| |dd| + u_w |down w|. A bf16
SwiGLU (swiglu_dtype="bfloat16", HF's `_apply_gate`) rounds silu(min(g, L)) and the product: two
more u_r |act| (min(g, L) and clamp(v) of bf16 values at a bf16 L are exact).

(1.1: SiLU's slope is below 1.1; L: both halves are clamped to L.) Every factor is stated, none is
fitted to a run; the tests assert the kernel stays inside it and, where no rounding is involved,
that it is far inside.
"""

import pytest
import torch

from megafuse.lowering import mega_moe as moe
from megafuse.model.moe import Experts
from megafuse.model.quant import fake_quant_mxfp8

U_BF16, U_FP32 = 2.0**-8, 2.0**-24


def _inputs(N, E, k, D, F, weight_dtype, input_dtype, seed=0, skip_experts=()):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(N, D, generator=g).to(input_dtype)
    weights = torch.rand(N, k, generator=g) + 0.1
    allowed = torch.tensor([e for e in range(E) if e not in skip_experts])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(N)])
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 2 / D**0.5).to(weight_dtype)  # some gates reach the clamp
    w2 = (torch.randn(E, D, F, generator=g) / F**0.5).to(weight_dtype)
    return u, weights, ids, w13, w2


def _spec(u, ids, w13, mxfp8, limit=10.0, **placement):
    name = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
    return moe.MoeSpec(n_experts=w13.shape[0], k=ids.shape[1], hidden=w13.shape[2], expert_dim=w13.shape[1] // 2,
                       weight_dtype=name(w13), input_dtype=name(u), swiglu_limit=limit, mxfp8=mxfp8, out_dtype=name(u),
                       **placement)


def _fp64_reference_and_bound(u, weights, ids, w13, w2, spec):
    """(reference [N, D] fp64, bound [N, D]) of the chain with the chain's rounding points."""
    grouped = spec.weight_dtype == "bfloat16"
    u_r = U_BF16 if grouped else 0.0
    rnd = (lambda t: t.to(torch.bfloat16).double()) if grouped else (lambda t: t)  # noqa: E731
    L, F, D, k = spec.swiglu_limit, spec.expert_dim, spec.hidden, spec.k
    slots, expert = ids.reshape(-1), ids.reshape(-1)
    x = rnd(u.double())[torch.arange(len(slots)) // k]
    W13, W2 = w13.double()[expert], w2.double()[expert]
    exact = torch.einsum("sod,sd->so", W13, x)
    gate_up = rnd(exact)
    d_gate_up = D * U_FP32 * torch.einsum("sod,sd->so", W13.abs(), x.abs()) + u_r * exact.abs()
    g, v = gate_up.split(F, -1)
    dg, dv = d_gate_up.split(F, -1)
    w = weights.double().reshape(-1, 1)
    after = spec.weight_at == "after"
    w_act = torch.ones_like(w) if after else w
    if spec.swiglu_dtype == "bfloat16":  # silu(min(g, L)) and the product each rounded to bf16
        act = rnd(rnd(torch.nn.functional.silu(g.clamp(max=L))) * v.clamp(-L, L)) * w_act
        d_act = w_act * (1.1 * L * dg + L * dv) + 3 * u_r * act.abs()
    else:
        act = torch.nn.functional.silu(g.clamp(max=L)) * v.clamp(-L, L) * w_act
        d_act = w_act * (1.1 * L * dg + L * dv) + u_r * act.abs()
    if spec.mxfp8:
        block_amax = act.abs().unflatten(-1, (F // 32, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(-2)
        d_act = d_act + 2.0**-3 * act.abs() + 2.0**-16 * block_amax
        act = fake_quant_mxfp8(act.float()).double()
    act = rnd(act)
    down_exact = torch.einsum("sdf,sf->sd", W2, act)
    down = rnd(down_exact)
    d_down = (torch.einsum("sdf,sf->sd", W2.abs(), d_act) + F * U_FP32 * torch.einsum("sdf,sf->sd", W2.abs(), act.abs())
              + u_r * down_exact.abs())
    if after:  # the slot weight in the down GEMM's epilogue, the product rounded to weighted_dtype
        u_w = U_BF16 if spec.weighted_dtype == "bfloat16" else U_FP32
        exact = down * w
        down = exact.to(torch.bfloat16).double() if spec.weighted_dtype == "bfloat16" else exact
        d_down = w * d_down + u_w * exact.abs()
    out = down.view(-1, k, D).sum(1)
    u_out = U_BF16 if spec.out_dtype == "bfloat16" else 0.0
    bound = d_down.view(-1, k, D).sum(1) + (k * U_FP32 + u_out) * out.abs() + 1e-30
    return out, bound


SHAPES = [  # (N, E, k, D, F, experts that receive no rows)
    (1, 8, 2, 64, 64, ()),        # one token
    (9, 8, 1, 48, 32, ()),        # k = 1, D not a power of two
    (23, 8, 3, 64, 96, (2, 5)),   # two experts without rows, F not a power of two
    (40, 4, 2, 32, 64, ()),       # more rows per expert than one tile
]
FORMS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
         (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("mxfp8", [False, True])
@pytest.mark.parametrize("weight_dtype, input_dtype", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_is_within_the_rounding_bound_of_the_fp64_chain(shape, weight_dtype, input_dtype, mxfp8):
    N, E, k, D, F, skip = shape
    u, weights, ids, w13, w2 = _inputs(N, E, k, D, F, weight_dtype, input_dtype, skip_experts=skip)
    spec = _spec(u, ids, w13, mxfp8)
    out = moe.mega_moe(u, weights, ids, w13, w2, spec)
    assert out.shape == (N, D) and out.dtype == input_dtype
    ref, bound = _fp64_reference_and_bound(u, weights, ids, w13, w2, spec)
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("weight_dtype, input_dtype", FORMS)
def test_kernel_equals_the_models_own_dispatch(weight_dtype, input_dtype):
    # the op's eager reference is Experts._grouped / _gathered: the same rounding points, so the two
    # differ by fp32 summation order (D = F = 64 terms: 64 * 2^-24 of the sums' magnitudes, a few
    # times max |ref|) or, where a bf16 rounding sits on a tie, by one bf16 step of an intermediate
    u, weights, ids, w13, w2 = _inputs(17, 8, 2, 64, 64, weight_dtype, input_dtype, seed=3, skip_experts=(7,))
    spec = _spec(u, ids, w13, mxfp8=False)
    out, ref = moe.mega_moe(u, weights, ids, w13, w2, spec), moe.reference(u, weights, ids, w13, w2, spec)
    step = U_BF16 if torch.bfloat16 in (weight_dtype, input_dtype) else 2 * 64 * U_FP32
    assert (out.float() - ref.float()).abs().max() <= 4 * step * ref.float().abs().max()
    experts = Experts.holding(w13, w2, 10.0)
    assert torch.equal(ref, experts(u, weights, ids))  # the reference is the module's forward (no MXFP8)


PLACEMENTS = [  # (weight dtype, input dtype, weight_at, weighted_dtype, swiglu_dtype): HF's and the forms
    (torch.float32, torch.float32, "after", "float32", "float32"),      # HF fp32 (grouped_mm fallback, batched_mm)
    (torch.bfloat16, torch.bfloat16, "after", "bfloat16", "bfloat16"),  # HF bf16: every op rounded to bf16
    (torch.bfloat16, torch.bfloat16, "after", "float32", "float32"),    # bf16 GEMMs, fp32 SwiGLU and product
    (torch.bfloat16, torch.bfloat16, "before", "float32", "bfloat16"),  # HF's bf16 SwiGLU, the model's placement
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: "-".join(str(x).removeprefix("torch.") for x in p))
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_the_weight_after_w2_and_a_bf16_swiglu_are_within_the_rounding_bound_of_the_fp64_chain(shape, placement):
    N, E, k, D, F, skip = shape
    weight_dtype, input_dtype, weight_at, weighted_dtype, swiglu_dtype = placement
    u, weights, ids, w13, w2 = _inputs(N, E, k, D, F, weight_dtype, input_dtype, skip_experts=skip)
    spec = _spec(u, ids, w13, False, weight_at=weight_at, weighted_dtype=weighted_dtype, swiglu_dtype=swiglu_dtype)
    out = moe.mega_moe(u, weights, ids, w13, w2, spec)
    ref, bound = _fp64_reference_and_bound(u, weights, ids, w13, w2, spec)
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    # the op's eager reference (lowering.mega_moe._reference_plain) obeys the same bound
    plain = moe.reference(u, weights, ids, w13, w2, spec).double()
    assert ((plain - ref).abs() <= bound).all()
    if weight_at == "after" and weight_dtype == torch.float32:  # no rounding but fp32's: far inside
        assert (err <= bound / 4).all()


def test_the_weight_after_w2_with_mxfp8_is_within_the_bound():
    u, weights, ids, w13, w2 = _inputs(9, 8, 2, 64, 64, torch.bfloat16, torch.bfloat16, seed=4)
    spec = _spec(u, ids, w13, True, weight_at="after", weighted_dtype="bfloat16")
    ref, bound = _fp64_reference_and_bound(u, weights, ids, w13, w2, spec)
    assert ((moe.mega_moe(u, weights, ids, w13, w2, spec).double() - ref).abs() <= bound).all()


def test_no_tokens_give_an_empty_output():
    u, weights, ids, w13, w2 = _inputs(1, 4, 2, 32, 32, torch.float32, torch.float32)
    spec = _spec(u, ids, w13, mxfp8=False)
    assert moe.mega_moe(u[:0], weights[:0], ids[:0], w13, w2, spec).shape == (0, 32)


def test_unsupported_specs_and_bad_inputs_say_why():
    base = dict(n_experts=8, k=2, hidden=64, expert_dim=64, weight_dtype="bfloat16", input_dtype="bfloat16",
                swiglu_limit=10.0, mxfp8=True, out_dtype="bfloat16")
    assert moe.unsupported_reason(moe.MoeSpec(**base)) is None
    cases = {"expert_dim": 48, "weight_dtype": "float16", "k": 9, "swiglu_limit": float("inf"), "precision": "fp8",
             "weight_at": "between", "weighted_dtype": "bfloat16", "swiglu_dtype": "float16"}
    for field, value in cases.items():
        reason = moe.unsupported_reason(moe.MoeSpec(**base | {field: value}))
        assert reason, field
    assert "MXFP8 blocks of 32" in moe.unsupported_reason(moe.MoeSpec(**base | {"expert_dim": 48}))
    u, weights, ids, w13, w2 = _inputs(3, 8, 2, 64, 64, torch.bfloat16, torch.bfloat16)
    spec = moe.MoeSpec(**base)
    with pytest.raises(ValueError, match="w2 must be"):
        moe.validate(u, weights, ids, w13, w2[:, :, :32], spec)
    with pytest.raises(ValueError, match="ids must be int64"):
        moe.validate(u, weights, ids.int(), w13, w2, spec)


def test_generated_source_rounds_where_the_form_does():
    u, weights, ids, w13, w2 = _inputs(2, 8, 2, 64, 64, torch.bfloat16, torch.float32)
    grouped = moe.generate_source(_spec(u, ids, w13, mxfp8=True))
    assert "_grouped_mm writes gate_up in bf16" in grouped and "_mxfp8(act" in grouped
    assert "tokens.to(bfloat16)" in grouped  # fp32 tokens meet bf16 weights
    gathered = moe.generate_source(_spec(u, ids, w13.float(), mxfp8=False))
    assert "_round_bfloat16(g)" not in gathered and "_mxfp8(act" not in gathered
    assert 'input_precision="tf32x3"' in gathered
    after = moe.generate_source(_spec(u, ids, w13, mxfp8=False, weight_at="after", weighted_dtype="bfloat16",
                                      swiglu_dtype="bfloat16"))
    assert "the weight after w2, in its epilogue" in after and "the weight enters before w2" not in after
    assert "the chain's bf16 product down * w" in after
