"""Triton source shared by the generated kernels' templates. A generated module stands alone (it is
written to the kernel cache and imported by path), so the templates embed these helpers as text.
"""

from pathlib import Path

COMBINERS = '''# Reductions go through tl.reduce with these combiners, and tl.full stands in for tl.zeros:
# tl.max / tl.sum / tl.zeros are @triton.jit library functions whose mode (interpreter or
# compiler) was fixed when Triton was first imported, while this module is loaded once per mode
# (see megafuse.lowering.kernel_cache). Builtins like tl.reduce work in both.


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add(a, b):
    return a + b


# The interpreter reduces with numpy only for Triton's own combiners (by identity) and calls any
# other once per element; this module is imported once per mode, so the choice is made per import.
if __import__("os").environ.get("TRITON_INTERPRET") == "1" and hasattr(tl.standard, "_sum_combine"):
    _add, _maximum = tl.standard._sum_combine, tl.standard._elementwise_max
'''

ROUND_16BIT = '''# Rounding an fp32 value to a 16-bit dtype and back, as torch's casts do (to nearest, ties to even),
# in integer arithmetic: `.to(tl.bfloat16)` rounds so on the GPU, but the interpreter's cast
# truncates, and the CPU tests must select exactly what the chain selects.
@triton.jit
def _round_bfloat16(x):
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)  # NaN stays NaN


@triton.jit
def _round_float16(x):
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0xFFF + ((bits >> 13) & 1)) & -8192).to(tl.float32, bitcast=True)  # 10 mantissa bits
    magnitude = tl.where(x < 0, -x, x)
    subnormal = (magnitude + 0.5) - 0.5  # below 2^-14 fp16 steps by 2^-24: fp32's step in [0.5, 1)
    rounded = tl.where(magnitude < 6.103515625e-05, tl.where(x < 0, -subnormal, subnormal), normal)
    rounded = tl.where(rounded > 65504.0, float("inf"), tl.where(rounded < -65504.0, float("-inf"), rounded))
    return tl.where(x == x, rounded, x)
'''

MXFP8 = '''# MXFP8 (model.quant): each block of 32 along the last dim through e4m3 under its ue8m0 scale, in
# integer and fp32 arithmetic (ties to even, subnormals, saturation at 448), so the interpreter and
# the GPU round identically.
@triton.jit
def _round_e4m3(y):
    """fp32 -> the nearest e4m3 value (ties to even; subnormals; |y| <= 448 given), as fp32."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3's smallest normal exponent is -6
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    # x + 1.5 * 2^23 - 1.5 * 2^23 rounds x (|x| < 2^22) to an integer, ties to even, in fp32
    return ((y / step + 12582912.0) - 12582912.0) * step


@triton.jit
def _mxfp8(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """x [ROWS, COLS] with each block of 32 along COLS rounded through e4m3 under its ue8m0 scale."""
    blocks = tl.reshape(x, (ROWS, COLS // 32, 32))
    amax = tl.maximum(tl.reduce(tl.abs(blocks), 2, _maximum), 0.0001) / 448.0  # quant._FP8_AMAX_FLOOR
    bits = amax.to(tl.int32, bitcast=True)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # 2^ceil(log2(amax / 448))
    scale = (tl.minimum(biased, 254) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(blocks / scale[:, :, None], -448.0), 448.0)
    return tl.reshape(_round_e4m3(y) * scale[:, :, None], (ROWS, COLS))
'''

# The generators hash this into their kernels' keys: an edit here changes every generated kernel.
SOURCE = Path(__file__).read_bytes()
