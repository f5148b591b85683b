"""Reference quantisation formats: the one place where each format's rounding lives.

The model's fake quantisation (`quant="ref"`), the runtime's KV caches and the kernels' test
references all call this module, so a rounding rule can never drift between them (docs/model.md section 6).
Every format is built the same way:

    quantize_<fmt>(x) -> (values, scales)     the core: values on the element grid, scales per block
    encode_<fmt>(x)   -> uint8 bytes          packs the core's output, never re-rounds
    decode_<fmt>(b)   -> float tensor         values * scales from the bytes
    fake_quant_<fmt>(x) = values * scales     the core without packing, in x's dtype

so `decode(encode(x)) == fake_quant(x)` holds bit for bit. A block is a run of contiguous values
along the last dim; x may have any leading shape `[..., dim]` and any float dtype (the maths is
done in fp32). Everything is plain tensor ops with no data-dependent Python, so it traces under
`torch.compile(fullgraph=True)`.

Formats and byte rows (`d` = dim of the row):

| format | element | block | scale | row bytes | 512 dims | 128 dims |
|---|---|---|---|---|---|---|
| `swa_fp8` (SWA K=V) | e4m3 | 32 | ue8m0, `2^ceil(log2(max(amax,1e-4)/448))` | `[0,d)` e4m3 codes, `[d, d+d/32)` ue8m0 bytes | 528 | 132 |
| `global_fp4` (global KV) | e2m1 | 16 | e4m3, `e4m3(clamp(amax/6, 2^-9, 448))` | `[0,d/2)` e2m1 pairs, `[d/2, d/2+d/16)` e4m3 scales | 288 | 72 |
| `index_mxfp4` (indexer K) | e2m1 | 32 | ue8m0, `2^ceil(log2(max(amax,6*2^-126)/6))` | `[0,d/2)` e2m1 pairs, `[d/2, d/2+d/32)` ue8m0 bytes | 272 | 68 |
| `mxfp8` (GEMM activations) | e4m3 | 32 | same as `swa_fp8` (same code) | fake quant only | | |

Element and scale encodings:

| name | bits | values |
|---|---|---|
| e4m3 (`float8_e4m3fn`) | s eeee mmm, bias 7 | finite up to +-448, no inf; round to nearest even, saturating |
| e2m1 | s ee m in a nibble: sign bit 3, magnitude code bits 0-2 | codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 |
| ue8m0 | one byte e, no sign, no mantissa | 2^(e-127); we emit 1..254 only |
| e2m1 pair byte | low nibble = even element (2i), high nibble = odd element (2i+1) | |

Division by a scale is an fp32 true division (correctly rounded) followed by rounding to the element
grid; for the power-of-two scales the division is exact. Kernels must match this order to match
bit for bit. inf/NaN inputs are outside the contract.
"""

from __future__ import annotations

import torch

# Largest finite e4m3fn magnitude; the element grid of the FP8 formats saturates here.
E4M3_MAX = 448.0
# Largest e2m1 magnitude.
E2M1_MAX = 6.0
# e2m1 magnitudes indexed by their 3-bit code (a code's index is its bit pattern).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# SWA / MXFP8 amax floor from docs/model.md section 6: blocks quieter than 1e-4 all share scale 2^-22.
_FP8_AMAX_FLOOR = 1e-4
# Global FP4 scale floor: the smallest e4m3 subnormal, so the rounded scale is never 0.
_FP4_SCALE_MIN = 2.0**-9
# Indexer MXFP4 amax floor: the smallest amax whose scale 2^ceil(log2(amax/6)) is still a normal
# fp32 (2^-126). It keeps all-zero blocks at 0 instead of 0/0 = NaN, and it keeps the scale normal
# so a flush-to-zero kernel cannot turn it into 0.
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126

_BLOCK = {"swa_fp8": 32, "mxfp8": 32, "global_fp4": 16, "index_mxfp4": 32}
# Bits per element of the byte-row formats (the ones with encode/decode and a KV row size).
_ELEMENT_BITS = {"swa_fp8": 8, "global_fp4": 4, "index_mxfp4": 4}


# --- shapes -------------------------------------------------------------------------------------


def _blocks(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 view of x as [..., dim // block, block]; rejects a dim the block does not divide."""
    if x.dim() == 0:
        raise ValueError(f"{fmt}: expected a tensor of shape [..., dim], got a scalar")
    block = _BLOCK[fmt]
    dim = x.shape[-1]
    if dim % block != 0:
        raise ValueError(f"{fmt}: last dim {dim} is not a multiple of the block size {block}")
    return x.float().unflatten(-1, (dim // block, block))


def row_bytes(format_name: str, dim: int) -> int:
    """Bytes of one encoded row of `dim` values: elements, then one scale byte per block."""
    if format_name not in _ELEMENT_BITS:
        valid = ", ".join(sorted(_ELEMENT_BITS))
        raise ValueError(f"unknown quant format {format_name!r}; valid formats: {valid}")
    block = _BLOCK[format_name]
    if dim % block != 0:
        raise ValueError(f"{format_name}: dim {dim} is not a multiple of the block size {block}")
    return dim * _ELEMENT_BITS[format_name] // 8 + dim // block


def _row_dim(b: torch.Tensor, fmt: str) -> int:
    """The `dim` of an encoded row of b.shape[-1] bytes (inverse of row_bytes)."""
    if b.dtype != torch.uint8:
        raise ValueError(f"{fmt}: encoded rows must be uint8, got {b.dtype}")
    block = _BLOCK[fmt]
    # Bytes per block: the packed elements plus the scale byte.
    per_block = block * _ELEMENT_BITS[fmt] // 8 + 1
    n = b.shape[-1] if b.dim() > 0 else 0
    if b.dim() == 0 or n % per_block != 0:
        raise ValueError(
            f"{fmt}: a row of {n} bytes is not a whole number of {per_block}-byte blocks "
            f"(block size {block})"
        )
    return n // per_block * block


# --- element grids ------------------------------------------------------------------------------


def _round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest e4m3 value (ties to even), saturating at +-448, returned as fp32."""
    # Clamp first so saturation never depends on the cast's out-of-range behaviour: torch 2.13's
    # CPU cast happens to saturate (even inf -> 448), but that is no contract across backends.
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 code (uint8): nearest magnitude, ties to the even code, saturating at 6.

    The magnitude code is the number of decision points below |y|. At a tie the comparison is
    strict (`>`) when the lower neighbour has the even code and inclusive (`>=`) when the upper one
    has: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0.
    Anything above 5 lands on code 7 (6.0), which is the saturation.
    """
    m = y.abs()
    code = (
        (m > 0.25).to(torch.uint8)  # 0 (code 0) | 0.5 (code 1)
        + (m >= 0.75).to(torch.uint8)  # 0.5 (1) | 1.0 (2)
        + (m > 1.25).to(torch.uint8)  # 1.0 (2) | 1.5 (3)
        + (m >= 1.75).to(torch.uint8)  # 1.5 (3) | 2.0 (4)
        + (m > 2.5).to(torch.uint8)  # 2.0 (4) | 3.0 (5)
        + (m >= 3.5).to(torch.uint8)  # 3.0 (5) | 4.0 (6)
        + (m > 5.0).to(torch.uint8)  # 4.0 (6) | 6.0 (7)
    )
    # Sign from the input, so -0.1 encodes as -0 (code 8) and decodes to -0.0 like fake quant.
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 code -> fp32 value. Magnitudes step by 0.5 (codes 0-3), 1 (4-5), 2 (6-7)."""
    c = (code & 7).float()
    magnitude = torch.where(c < 4, 0.5 * c, torch.where(c < 6, c - 2.0, 2.0 * c - 8.0))
    return torch.where((code & 8) != 0, -magnitude, magnitude)


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest e2m1 value as fp32 (one rounding rule: through the code)."""
    return _e2m1_value(_e2m1_code(y))


# --- scales -------------------------------------------------------------------------------------


def _ue8m0_scale(ratio: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(ratio)) for a positive normal fp32 ratio, exactly, as fp32.

    Read off the float bits rather than log2(): the biased exponent, plus one when any mantissa bit
    is set. log2 can round a ratio just above a power of two down onto it, which would make the
    scale too small and saturate the block's largest value.
    """
    bits = ratio.view(torch.int32)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    # 254 = 2^127, the largest ue8m0 scale (255 is NaN); only reachable from inf inputs.
    return (biased.clamp(max=254) << 23).view(torch.float32)


def _ue8m0_byte(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two normal fp32 scale -> its ue8m0 byte (the fp32 biased exponent)."""
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _ue8m0_from_byte(byte: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte -> fp32 scale 2^(byte-127). Byte 0 is 2^-127, a subnormal in fp32."""
    e = byte.to(torch.int32)
    normal = (e << 23).view(torch.float32)
    return torch.where(e == 0, torch.full_like(normal, 2.0**-127), normal)


# --- cores: (values on the element grid, per-block scales) --------------------------------------


def _quantize_e4m3_ue8m0(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(x, fmt)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = _ue8m0_scale(amax.clamp(min=_FP8_AMAX_FLOOR) / E4M3_MAX)
    # Power-of-two division is exact, so this is one rounding: to e4m3.
    values = _round_e4m3(blocks / scale)
    return values.flatten(-2), scale.squeeze(-1)


def quantize_swa_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA KV core: (e4m3 values [..., d] fp32, power-of-two scales [..., d/32] fp32)."""
    return _quantize_e4m3_ue8m0(x, "swa_fp8")


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 activation core: the SWA FP8 format under its GEMM name."""
    return _quantize_e4m3_ue8m0(x, "mxfp8")


def quantize_global_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global KV core: (e2m1 values [..., d] fp32, e4m3-valued scales [..., d/16] fp32).

    NVFP4 without the second-level (per-tensor) scale: the block scale alone must cover the
    range, hence the clamp to e4m3's [2^-9, 448] before rounding it to e4m3.
    """
    blocks = _blocks(x, "global_fp4")
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = _round_e4m3(amax.div(E2M1_MAX).clamp(_FP4_SCALE_MIN, E4M3_MAX))
    # Divide by the rounded scale (the one that is stored); a scale rounded down can push the
    # block's amax past 6, which the e2m1 rounding saturates.
    values = _round_e2m1(blocks / scale)
    return values.flatten(-2), scale.squeeze(-1)


def quantize_index_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer K core: (e2m1 values [..., d] fp32, power-of-two scales [..., d/32] fp32)."""
    blocks = _blocks(x, "index_mxfp4")
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # ceil keeps amax / scale <= 6, so only the floor-guarded blocks ever round rather than fit.
    scale = _ue8m0_scale(amax.clamp(min=_MXFP4_AMAX_FLOOR) / E2M1_MAX)
    values = _round_e2m1(blocks / scale)
    return values.flatten(-2), scale.squeeze(-1)


# --- fake quantisation (the model's `quant="ref"`) ----------------------------------------------


def _dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # values [..., d] times scale [..., d/block]; the product is exact in fp32 for every format
    # here (at most 4 + 4 significant bits), so casting to bf16 afterwards is exact too.
    block = values.shape[-1] // scale.shape[-1]
    out = values.unflatten(-1, (scale.shape[-1], block)) * scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)


def fake_quant_swa_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded through the SWA KV FP8 format; same shape and dtype as x."""
    return _dequantize(*quantize_swa_fp8(x), x.dtype)


def fake_quant_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded through MXFP8 (e4m3 + ue8m0 per 32 along the last dim); same shape and dtype."""
    return _dequantize(*quantize_mxfp8(x), x.dtype)


def fake_quant_global_fp4(x: torch.Tensor) -> torch.Tensor:
    """x rounded through the global KV FP4 format; same shape and dtype as x."""
    return _dequantize(*quantize_global_fp4(x), x.dtype)


def fake_quant_index_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x rounded through the indexer MXFP4 format; same shape and dtype as x."""
    return _dequantize(*quantize_index_mxfp4(x), x.dtype)


# --- byte rows (the runtime's cache layout) -----------------------------------------------------


def _pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """e2m1 grid values [..., d] -> uint8 [..., d/2], element 2i in the low nibble of byte i."""
    # The values are already on the grid, so taking their code again is exact, not a re-rounding.
    code = _e2m1_code(values).unflatten(-1, (values.shape[-1] // 2, 2))
    return code[..., 0] | (code[..., 1] << 4)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., d/2] -> fp32 e2m1 values [..., d] (inverse of _pack_e2m1)."""
    code = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return _e2m1_value(code)


def _e4m3_bytes(values: torch.Tensor) -> torch.Tensor:
    # Exact: the values are e4m3 already.
    return values.to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_from_bytes(b: torch.Tensor) -> torch.Tensor:
    # Same-size dtype view works on the non-contiguous slice of a row.
    return b.view(torch.float8_e4m3fn).float()


def encode_swa_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> uint8 [..., d + d/32]: e4m3 codes, then ue8m0 scale bytes."""
    values, scale = quantize_swa_fp8(x)
    return torch.cat((_e4m3_bytes(values), _ue8m0_byte(scale)), dim=-1)


def decode_swa_fp8(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., d + d/32] -> [..., d] in dtype."""
    d = _row_dim(b, "swa_fp8")
    return _dequantize(_e4m3_from_bytes(b[..., :d]), _ue8m0_from_byte(b[..., d:]), dtype)


def encode_global_fp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> uint8 [..., d/2 + d/16]: packed e2m1 pairs, then e4m3 scale bytes."""
    values, scale = quantize_global_fp4(x)
    return torch.cat((_pack_e2m1(values), _e4m3_bytes(scale)), dim=-1)


def decode_global_fp4(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., d/2 + d/16] -> [..., d] in dtype."""
    d = _row_dim(b, "global_fp4")
    return _dequantize(_unpack_e2m1(b[..., : d // 2]), _e4m3_from_bytes(b[..., d // 2 :]), dtype)


def encode_index_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] -> uint8 [..., d/2 + d/32]: packed e2m1 pairs, then ue8m0 scale bytes."""
    values, scale = quantize_index_mxfp4(x)
    return torch.cat((_pack_e2m1(values), _ue8m0_byte(scale)), dim=-1)


def decode_index_mxfp4(b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., d/2 + d/32] -> [..., d] in dtype."""
    d = _row_dim(b, "index_mxfp4")
    return _dequantize(_unpack_e2m1(b[..., : d // 2]), _ue8m0_from_byte(b[..., d // 2 :]), dtype)
