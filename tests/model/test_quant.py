"""Specifications of the reference quantisation formats in model/quant.py (docs/model.md section 6).

References here are built independently of the module: e2m1 rounding by brute force over the eight
magnitudes in plain Python, scales read back from the encoded bytes with Python arithmetic, error
bounds derived from each grid's spacing.
"""

import math

import pytest
import torch

from megafuse.model.quant import (
    decode_global_fp4,
    decode_index_mxfp4,
    decode_swa_fp8,
    encode_global_fp4,
    encode_index_mxfp4,
    encode_swa_fp8,
    fake_quant_global_fp4,
    fake_quant_index_mxfp4,
    fake_quant_mxfp8,
    fake_quant_swa_fp8,
    row_bytes,
)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# name -> (encode, decode, fake_quant, block, element bytes per value)
FORMATS = {
    "swa_fp8": (encode_swa_fp8, decode_swa_fp8, fake_quant_swa_fp8, 32, 1.0),
    "global_fp4": (encode_global_fp4, decode_global_fp4, fake_quant_global_fp4, 16, 0.5),
    "index_mxfp4": (encode_index_mxfp4, decode_index_mxfp4, fake_quant_index_mxfp4, 32, 0.5),
}
SHAPES = [(512,), (3, 512), (2, 3, 128), (0, 256)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def spread_input(shape, dtype=torch.float32, seed=0):
    """Random rows whose 16-value chunks span magnitudes 2^-20..2^12, with one all-zero chunk."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.numel() == 0:
        return x.to(dtype)
    chunks = x.unflatten(-1, (shape[-1] // 16, 16))
    magnitude = torch.randint(-20, 13, chunks.shape[:-1] + (1,), generator=g).float().exp2()
    chunks = chunks * magnitude
    chunks.reshape(-1, 16)[0] = 0.0
    return chunks.flatten(-2).to(dtype)


def split(fmt, b):
    """Encoded rows -> (element bytes, scale bytes)."""
    _, _, _, block, per_value = FORMATS[fmt]
    d = round(b.shape[-1] / (per_value + 1 / block))
    return b[..., : int(d * per_value)], b[..., int(d * per_value) :]


def ue8m0_scales(scale_bytes):
    return torch.tensor([2.0 ** (int(e) - 127) for e in scale_bytes.flatten()]).reshape(
        scale_bytes.shape
    )


def e2m1_reference(v):
    """Nearest e2m1 value to v by brute force; a tie goes to the even code; sign kept."""
    m = abs(v)
    best = min(range(8), key=lambda code: (abs(E2M1[code] - m), code % 2))
    return math.copysign(E2M1[best], v)


def blocks_of(t, block):
    return t.float().unflatten(-1, (t.shape[-1] // block, block))


# --- sizes --------------------------------------------------------------------------------------


def test_row_bytes_match_the_kv_budget():
    assert row_bytes("swa_fp8", 512) == 528
    assert row_bytes("global_fp4", 512) == 288
    assert row_bytes("index_mxfp4", 128) == 68
    # 890 B/token of global KV in docs/model.md section 6: 3 x (288 + 68) / 2 + (288 + 68).
    per_source = row_bytes("global_fp4", 512) + row_bytes("index_mxfp4", 128)
    assert 3 * per_source / 2 + per_source == 890


@pytest.mark.parametrize("fmt,dim,nbytes", [("swa_fp8", 512, 528), ("global_fp4", 512, 288),
                                            ("index_mxfp4", 128, 68)])
def test_encoded_rows_have_row_bytes(fmt, dim, nbytes):
    encode = FORMATS[fmt][0]
    b = encode(torch.randn(5, dim))
    assert b.dtype == torch.uint8 and b.shape == (5, nbytes)


def test_row_bytes_rejects_unknown_format_naming_the_valid_ones():
    with pytest.raises(ValueError, match="global_fp4.*index_mxfp4.*swa_fp8"):
        row_bytes("nvfp4", 512)


# --- decode(encode(x)) is fake_quant(x) ---------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_of_encode_is_fake_quant_exactly(fmt, shape, dtype):
    encode, decode, fake_quant, _, _ = FORMATS[fmt]
    x = spread_input(shape, dtype, seed=len(shape))
    fq = fake_quant(x)
    assert fq.shape == x.shape and fq.dtype == dtype
    assert torch.equal(decode(encode(x), dtype=dtype), fq)
    assert decode(encode(x)).dtype == torch.float32


def test_mxfp8_is_the_swa_fp8_format():
    x = spread_input((4, 256), torch.bfloat16)
    assert torch.equal(fake_quant_mxfp8(x), fake_quant_swa_fp8(x))


# --- error bounds, per block --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swa_fp8_error_is_half_an_e4m3_step(dtype):
    # Within a block v = x / s has |v| <= 448; e4m3 has 3 mantissa bits, so rounding moves a normal
    # v by at most half a step = 2^-4 |v|, and a subnormal v (|v| < 2^-6) by at most 2^-10.
    x = spread_input((8, 512), dtype, seed=1)
    b = encode_swa_fp8(x)
    scale = ue8m0_scales(split("swa_fp8", b)[1]).unsqueeze(-1)
    xb = blocks_of(x, 32)
    err = (blocks_of(fake_quant_swa_fp8(x), 32) - xb).abs()
    bound = torch.maximum(xb.abs() * 2.0**-4, 2.0**-10 * scale)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    # And per block: no value moves by more than 1/16 of the block's amax.
    amax = xb.abs().amax(-1, keepdim=True)
    assert (err.amax(-1, keepdim=True) <= torch.maximum(amax * 2.0**-4, 2.0**-10 * scale)).all()


def e2m1_half_step(v):
    """Half the e2m1 grid spacing around |v|: steps are 0.5 up to 2, 1 up to 4, 2 up to 6."""
    v = v.abs()
    return torch.where(v <= 2, 0.25, torch.where(v <= 4, 0.5, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_fp4_error_is_half_an_e2m1_step_of_the_block_scale(dtype):
    x = spread_input((8, 512), dtype, seed=2)
    b = encode_global_fp4(x)
    scale = split("global_fp4", b)[1].view(torch.float8_e4m3fn).float().unsqueeze(-1)
    xb = blocks_of(x, 16)
    amax = xb.abs().amax(-1, keepdim=True)
    # The stored scale is amax/6 clamped to [2^-9, 448] and rounded to e4m3 (torch's cast here).
    expected = (amax / 6).clamp(2.0**-9, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale, expected)
    err = (blocks_of(fake_quant_global_fp4(x), 16) - xb).abs()
    v = xb / scale
    # Where amax/6 lies in e4m3's normal range [2^-6, 448], the scale is within 2^-4 of it, so
    # |v| <= 6 / (1 - 2^-4) = 6.4 and saturating at 6 costs at most 0.4 < the top half step of 1.
    normal = ((amax / 6 >= 2.0**-6) & (amax / 6 <= 448)).squeeze(-1)
    assert normal.any() and (~normal).any()
    assert (err[normal] <= (e2m1_half_step(v) * scale)[normal]).all()
    assert (err[normal].amax(-1) <= scale[normal].squeeze(-1)).all()
    # Outside it (a subnormal scale rounded far down, or one clamped at 448 or 2^-9) values past 6s
    # saturate; that is the only extra error: nothing moves by more than |x| - 6s.
    saturation = xb.abs() - 6 * scale
    assert (err <= torch.maximum(e2m1_half_step(v) * scale, saturation)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_mxfp4_error_is_half_an_e2m1_step_of_the_block_scale(dtype):
    x = spread_input((8, 128), dtype, seed=3)
    b = encode_index_mxfp4(x)
    scale = ue8m0_scales(split("index_mxfp4", b)[1]).unsqueeze(-1)
    xb = blocks_of(x, 32)
    err = (blocks_of(fake_quant_index_mxfp4(x), 32) - xb).abs()
    assert (err <= e2m1_half_step(xb / scale) * scale).all()
    assert (err.amax(-1, keepdim=True) <= scale).all()


# --- ue8m0 scales -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,elem_max", [("swa_fp8", 448.0), ("index_mxfp4", 6.0)])
def test_ue8m0_scale_is_the_smallest_power_of_two_that_fits(fmt, elem_max):
    encode, _, _, block, _ = FORMATS[fmt]
    x = spread_input((16, 256), seed=4)
    scale_bytes = split(fmt, encode(x))[1]
    assert ((scale_bytes >= 1) & (scale_bytes <= 254)).all()
    scale = ue8m0_scales(scale_bytes)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # a power of two
    amax = blocks_of(x, block).abs().amax(-1)
    assert (amax / scale <= elem_max).all()
    # Smallest: half the scale would not fit, unless the block is below the amax floor.
    floor = 1e-4 if fmt == "swa_fp8" else 6 * 2.0**-126
    live = amax > floor
    assert live.any() and (amax[live] / scale[live] > elem_max / 2).all()


def test_swa_fp8_scale_steps_up_just_past_448():
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0] = 448.0, 449.0
    assert encode_swa_fp8(x)[:, 32].tolist() == [127, 128]  # scales 1 and 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_all_zero_blocks_decode_to_zeros(fmt):
    encode, decode, fake_quant, _, _ = FORMATS[fmt]
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    assert torch.equal(decode(encode(x)), torch.zeros(3, 128))
    assert torch.equal(fake_quant(x), x)
    assert torch.equal(fake_quant_mxfp8(x), x)


# --- e2m1 rounding ------------------------------------------------------------------------------


def pinned_unit_scale(values):
    """Blocks of 32 whose first value is 6.0, so the MXFP4 scale is exactly 1."""
    body = torch.as_tensor(values, dtype=torch.float32).reshape(-1, 31)
    return torch.cat((torch.full((body.shape[0], 1), 6.0), body), dim=-1)


def test_e2m1_ties_go_to_the_even_code():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    values = ties + [-t for t in ties] + [0.0] * 17
    got = fake_quant_index_mxfp4(pinned_unit_scale(values))[0, 1:15].tolist()
    assert got == want + [-w for w in want]


def test_e2m1_sign_and_saturation():
    # Scale clamps at 448 when amax/6 > 448, so these land beyond 6 before rounding.
    x = torch.zeros(16)
    x[:4] = torch.tensor([5376.0, -4000.0, 2000.0, -0.1])
    values = (fake_quant_global_fp4(x) / 448).tolist()[:4]
    assert values == [6.0, -6.0, 4.0, -0.0] and math.copysign(1, values[3]) == -1
    codes = encode_global_fp4(x)[:2].tolist()
    assert codes == [0x7 | 0xF << 4, 0x6 | 0x8 << 4]  # -6 = 0b1111, -0 = 0b1000


def test_e2m1_matches_brute_force_nearest_even():
    g = torch.Generator().manual_seed(5)
    midpoints = [(a + b) / 2 for a, b in zip(E2M1, E2M1[1:])]
    near_ties = [math.nextafter(m, d) for m in midpoints for d in (0, 7)]
    random = ((torch.rand(31 * 64, generator=g) * 2 - 1) * 6).tolist()
    values = midpoints + near_ties + list(E2M1) + random
    values += [-v for v in values]
    values += [0.0] * (-len(values) % 31)
    x = pinned_unit_scale(values)
    got = fake_quant_index_mxfp4(x)[:, 1:].flatten().tolist()
    want = [e2m1_reference(v) for v in x[:, 1:].flatten().tolist()]
    assert got == want


def test_nibble_order_puts_the_even_element_low():
    x = torch.zeros(16)
    x[:4] = torch.tensor([1.0, 6.0, -0.5, 3.0])  # amax 6 -> e4m3 scale exactly 1.0
    b = encode_global_fp4(x)
    assert b.tolist()[:2] == [0x72, 0x59]  # (6 -> 7, 1 -> 2), (3 -> 5, -0.5 -> 0b1001)
    assert b.tolist()[8] == 0x38  # e4m3 1.0 = 0 0111 000


# --- torch.compile ------------------------------------------------------------------------------


def compile_input():
    """One [4, 256] input mixing random blocks, an all-zero block, e2m1 ties and a huge block."""
    x = spread_input((4, 256), seed=6)
    x[1, :32] = pinned_unit_scale([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [-0.75] * 24)
    x[2, :32] = 0.0
    x[3, :32] = 1e4 * torch.randn(32)
    return x


@pytest.mark.parametrize(
    "fn", [fake_quant_swa_fp8, fake_quant_global_fp4, fake_quant_index_mxfp4, fake_quant_mxfp8,
           encode_swa_fp8, encode_global_fp4, encode_index_mxfp4],
    ids=lambda f: f.__name__,
)
def test_compiled_equals_eager(fn):
    x = compile_input()
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


# --- shape errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_dim_not_a_multiple_of_the_block_is_rejected(fmt):
    encode, decode, fake_quant, block, _ = FORMATS[fmt]
    dim = block + 8
    for fn in (encode, fake_quant):
        with pytest.raises(ValueError, match=rf"{fmt}.*{dim}.*block size {block}"):
            fn(torch.randn(2, dim))
    with pytest.raises(ValueError, match=f"block size {block}"):
        row_bytes(fmt, dim)
    with pytest.raises(ValueError, match=f"{fmt}.*block size {block}"):
        decode(torch.zeros(2, row_bytes(fmt, 2 * block) + 1, dtype=torch.uint8))


def test_mxfp8_dim_error_names_the_block():
    with pytest.raises(ValueError, match=r"mxfp8.*40.*block size 32"):
        fake_quant_mxfp8(torch.randn(40))
