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

# The generators hash this into their kernels' keys: an edit here changes every generated kernel.
SOURCE = Path(__file__).read_bytes()
