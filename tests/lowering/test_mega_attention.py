"""MegaAttention's core kernel (lowering/mega_attention.py) against the model's chain, on CPU via
the Triton interpreter (the source CUDA compiles).

The chain is `Attention._output` before WO-A: sparse attention with the sink in fp32, inverse
RoPE of the tail, the cast to the model's dtype, MXFP8 under quant="ref". The kernel's fp32 core
differs from it in the last bits only (summation order), so the checks are, per case:
  - the core (fp32 out, no MXFP8) within 1e-5 of the chain, relative to the output's scale;
  - the epilogue's roundings exact: the kernel's rounded output equals torch's rounding (the
    model's `to(dtype)` and `fake_quant_mxfp8`) of the kernel's own fp32 output, bit for bit;
  - end to end, an element that differs from the chain's is one rounding step away (the fp32
    values straddled a rounding boundary); such elements are counted and must be rare.
"""

import pytest
import torch

from megafuse.lowering import kernel_cache
from megafuse.lowering.mega_attention import (AttentionSpec, choose_config, generate_source, mega_attention, reference,
                                              unsupported_reason)
from megafuse.model import quant
from megafuse.model.rope import apply_rope
from tests.marks import slow_beyond


@pytest.fixture(autouse=True)
def _kernel_cache_in_tmp(tmp_path_factory):
    kernel_cache.set_cache_dir(tmp_path_factory.getbasetemp() / "kernels")
    yield
    kernel_cache.set_cache_dir(None)


def make_inputs(R, H, Dh, rd, J, dtype, seed, p_valid=0.7):
    """Random rows; row 0 has no valid key (its output is exactly 0), row 1 one valid key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, Dh, generator=g).to(dtype)
    keys = torch.randn(R, J, Dh, generator=g).to(dtype)
    valid = torch.rand(R, J, generator=g) < p_valid
    valid[0] = False
    if R > 1 and J:
        valid[1] = False
        valid[1, J - 1] = True
    sink = torch.randn(H, generator=g)
    angles = torch.rand(R, rd // 2, generator=g) * 100.0  # RoPE angles of positions up to ~100
    return q, keys, valid, sink, angles


def spec_for(H, Dh, rd, dtype, out_dtype=None, mxfp8=False, q_rope=False):
    name = str(dtype).removeprefix("torch.")
    return AttentionSpec(heads=H, head_dim=Dh, rope_dim=rd, scale=Dh ** -0.5, key_dtype=name,
                         out_dtype=out_dtype or name, mxfp8=mxfp8, q_rope=q_rope)


# (R, H, Dh, rope_dim, J): tiny's attention (4 heads x 64, rd 16) with its window + top-k keys; a head
# count that is not a power of two; no RoPE; a long key list crossing many tiles; 64 heads (one block)
CASES = [(5, 4, 64, 16, 14), (3, 5, 32, 8, 7), (4, 4, 64, 0, 9), (2, 2, 32, 32, 70), (2, 64, 64, 16, 20)]


@pytest.mark.parametrize("R, H, Dh, rd, J", slow_beyond(CASES, fast=2))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_core_equals_the_chain_in_fp32(R, H, Dh, rd, J, dtype):
    inputs = make_inputs(R, H, Dh, rd, J, dtype, seed=R * 100 + J)
    spec = spec_for(H, Dh, rd, dtype, out_dtype="float32")
    got, want = mega_attention(*inputs, spec), reference(*inputs, spec)
    assert got.dtype == torch.float32 and got.shape == (R, H, Dh)
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # no valid key: exactly 0, as the chain


@pytest.mark.parametrize("R, H, Dh, rd, J", slow_beyond(CASES, fast=1))
@pytest.mark.parametrize("mxfp8", [False, True])
def test_bf16_epilogue_rounds_like_torch_and_the_output_matches_the_chain(R, H, Dh, rd, J, mxfp8):
    inputs = make_inputs(R, H, Dh, rd, J, torch.bfloat16, seed=R * 10 + J)
    spec = spec_for(H, Dh, rd, torch.bfloat16, mxfp8=mxfp8)
    got = mega_attention(*inputs, spec)
    core = mega_attention(*inputs, spec_for(H, Dh, rd, torch.bfloat16, out_dtype="float32"))
    rounded = core.to(torch.bfloat16)
    assert torch.equal(got, quant.fake_quant_mxfp8(rounded) if mxfp8 else rounded)
    want = reference(*inputs, spec)
    differs = got != want
    if differs.any():  # one rounding step apart: bf16's 2^-7 relative, or one e4m3 step (2^-3 relative)
        step = 2.0 ** -3 if mxfp8 else 2.0 ** -7
        gap = (got.float() - want.float()).abs()[differs]
        assert bool((gap <= step * want.float().abs()[differs].clamp(min=2.0 ** -9) * 1.01).all())
    assert int(differs.sum()) <= max(2, differs.numel() // 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_q_rope_in_the_prologue_rotates_q_as_the_chain_does(dtype, splits):
    """q_rope: the kernel on q before its RoPE equals the kernel on q rotated (and rounded) by
    apply_rope, and the chain; in bf16 the rotated q is rounded to bf16 as the chain rounds it."""
    R, H, Dh, rd, J = 4, 4, 64, 16, 40
    q, keys, valid, sink, angles = make_inputs(R, H, Dh, rd, J, dtype, seed=11)
    spec = spec_for(H, Dh, rd, dtype, out_dtype="float32", q_rope=True)
    config = choose_config(spec, R, J, splits, device="cpu")
    got = mega_attention(q, keys, valid, sink, angles, spec, config)
    roped = apply_rope(q, angles[:, None, :])
    assert not torch.equal(roped, q)
    rotated_first = mega_attention(roped, keys, valid, sink, angles, spec_for(H, Dh, rd, dtype, out_dtype="float32"), config)
    want = reference(q, keys, valid, sink, angles, spec)
    assert float((got - rotated_first).abs().max()) <= 1e-6 * max(1.0, float(want.abs().max()))
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_keys_merge_to_the_unsplit_result(dtype):
    """300 keys (5 tiles of 64 at head_dim 32) split 1, 2 and 5 ways: the partial results merge to
    the chain's; row 0 has no valid key, row 1 one key in the last split, row 2 none in the first."""
    R, H, Dh, rd, J = 3, 4, 32, 8, 300
    q, keys, valid, sink, angles = make_inputs(R, H, Dh, rd, J, dtype, seed=7)
    valid[2, :128] = False
    spec = spec_for(H, Dh, rd, dtype, out_dtype="float32")
    want = reference(q, keys, valid, sink, angles, spec)
    assert choose_config(spec, R, J).splits == 5  # few rows: every tile its own program
    for splits in (1, 2, 5):
        assert choose_config(spec, R, J, splits).splits == splits
        got = mega_attention(q, keys, valid, sink, angles, spec, choose_config(spec, R, J, splits, device="cpu"))
        assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), splits
        assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_the_launch_fits_hopper_at_v4_widths():
    """64 heads x 512 (bf16): 16 heads a program (a 64-register accumulator), 32-key tiles of 32 KB;
    decode rows split the keys until rows x head blocks x splits fills the GPU twice over; from 64
    rows 32 heads a program at the 16-head tile's split (the sweep's fastest)."""
    spec = AttentionSpec(heads=64, head_dim=512, rope_dim=64, scale=512 ** -0.5, key_dtype="bfloat16",
                         out_dtype="bfloat16", mxfp8=True)
    one = choose_config(spec, rows=1, n_keys=640)
    assert (one.block_h, one.block_j, one.splits, one.keys_per_split) == (16, 32, 10, 64)
    sixty_four = choose_config(spec, rows=64, n_keys=640)
    assert (sixty_four.block_h, sixty_four.splits, sixty_four.keys_per_split) == (32, 2, 320)
    assert (choose_config(spec, rows=63, n_keys=640).block_h, choose_config(spec, rows=4096, n_keys=640).splits) == (16, 1)
    few_heads = AttentionSpec(heads=4, head_dim=64, rope_dim=16, scale=0.125, key_dtype="float32", out_dtype="float32",
                              mxfp8=False)
    assert choose_config(few_heads, rows=128, n_keys=64).block_h == 16  # never past the heads' own power of two
    with pytest.raises(ValueError, match="splits must be >= 1"):
        choose_config(spec, 1, 640, splits=0)


def test_mxfp8_rounds_ties_to_even_subnormals_and_saturation_like_the_model():
    """One valid key and a sink far below it: o is that key exactly, so the MXFP8 epilogue sees
    chosen values: midpoints between e4m3 neighbours (ties go to the even code), subnormal
    midpoints, a block whose amax sets scale 1 and blocks whose values need other scales."""
    block = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -7 * 1.0625, 0.0]
                         + [0.5] * 24)
    Dh = 64
    key = torch.cat((block, block * 2.0 ** -20))[None, None, :]  # the second block: a tiny scale
    spec = AttentionSpec(heads=1, head_dim=Dh, rope_dim=0, scale=1.0, key_dtype="float32", out_dtype="float32",
                         mxfp8=True)
    inputs = (torch.ones(1, 1, Dh) * 1e-3, key, torch.ones(1, 1, dtype=torch.bool), torch.tensor([-1e4]),
              torch.zeros(1, 0))
    got = mega_attention(*inputs, spec)
    assert torch.equal(got[0, 0], quant.fake_quant_mxfp8(key[0, 0]))
    assert got[0, 0, 1] == 1.0 and got[0, 0, 2] == 1.25 and got[0, 0, 4] == 0.0 and got[0, 0, 5] == 2.0 ** -8


def test_empty_and_keyless_rows():
    q, keys, valid, sink, angles = make_inputs(3, 4, 32, 8, 0, torch.float32, seed=1)
    spec = spec_for(4, 32, 8, torch.float32)
    assert torch.equal(mega_attention(q, keys, valid, sink, angles, spec), torch.zeros(3, 4, 32))
    none = mega_attention(q[:0], keys[:0], valid[:0], sink, angles[:0], spec)
    assert none.shape == (0, 4, 32)


def test_unsupported_specs_and_bad_inputs_are_named():
    good = spec_for(4, 64, 16, torch.float32)
    assert unsupported_reason(good) is None
    for change, message in ((dict(head_dim=48), "power of two"), (dict(rope_dim=15), "even"),
                            (dict(rope_dim=80), "within head_dim"), (dict(key_dtype="int8"), "not supported"),
                            (dict(heads=0), "at least one"), (dict(head_dim=16, mxfp8=True), "MXFP8 blocks"),
                            (dict(rope_dim=0, q_rope=True), "q RoPE needs rope_dim")):
        spec = AttentionSpec(**{**good.__dict__, **change})
        assert message in unsupported_reason(spec)
        with pytest.raises(ValueError, match=message):
            generate_source(spec)
    q, keys, valid, sink, angles = make_inputs(3, 4, 64, 16, 5, torch.float32, seed=2)
    with pytest.raises(ValueError, match="valid must be bool"):
        mega_attention(q, keys, valid.int(), sink, angles, good)
    with pytest.raises(ValueError, match=r"angles must be float32 \[3, 8\]"):
        mega_attention(q, keys, valid, sink, angles[:, :4], good)
    with pytest.raises(ValueError, match="does not match spec key_dtype"):
        mega_attention(q.bfloat16(), keys.bfloat16(), valid, sink, angles, good)
    with pytest.raises(ValueError, match=r"keys must be \[3, J, 64\]"):
        mega_attention(q, keys[:2], valid[:2], sink, angles, good)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_in_any_layout_give_the_contiguous_result(dtype):
    """Views as a compiled graph hands them over: angles transposed (a rotary table computed as
    inv_freq x positions, then transposed), q head-major, keys shared by the rows (stride 0), valid
    a column slice; the result equals the contiguous inputs' and the chain's."""
    R, H, Dh, rd, J = 6, 2, 32, 16, 20
    q, keys, valid, sink, angles = make_inputs(R, H, Dh, rd, J, dtype, seed=7)
    spec = spec_for(H, Dh, rd, dtype, out_dtype="float32")
    views = (q.transpose(0, 1).contiguous().transpose(0, 1), keys[:1].expand(R, J, Dh),
             torch.cat((valid, valid), 1)[:, :J], sink, angles.t().contiguous().t())
    assert views[4].stride() == (1, R) and views[0].stride(1) == R * Dh
    dense = tuple(t.contiguous() for t in views)
    got = mega_attention(*views, spec)
    assert torch.equal(got, mega_attention(*dense, spec))
    want = reference(*dense, spec)
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
