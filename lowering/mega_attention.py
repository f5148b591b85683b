"""MegaAttention's core: sparse attention with a sink, inverse RoPE and MXFP8 in one generated Triton launch.

For each query row r (a token of a batched step) and head h, over the row's own J key rows
(K = V, MQA: every head of a row reads the same rows):

    s_j  = (q[r, h] . k[r, j]) * scale                  fp32, j valid
    o    = sum_j e^(s_j - m) k[r, j] / (sum_j e^(s_j - m) + e^(sink_h - m)),   m = max(sink_h, max_j s_j)
    o    = RoPE^-1(o) on the last rope_dim dims          (pairs (2i, 2i+1) rotated by -angle_i)
    out  = o rounded to out_dtype, then (mxfp8) through MXFP8: e4m3 values with a ue8m0 scale per 32

This is the chain `model.attention.Attention._output` runs before its WO-A GEMM, on keys already
decoded and gathered (`reference` is that chain, calling the model's functions, so the formula
exists once). A query whose keys are all invalid gets exactly 0, as in the chain: the sink joins
the max, so the denominator never vanishes.

Kernel design
-------------
One program per (row, block of BLOCK_H heads, split of the row's keys), a row's head blocks adjacent
(its keys come from HBM once, from L2 for the other blocks): the row's key tile
[BLOCK_J, head_dim] is loaded once and used by every head of the block (heads sit in the MMA's M
dimension, the MQA saving). An online softmax runs over the split's keys with its running max
started at the sink, the [BLOCK_H, head_dim] accumulator in fp32 registers. The epilogue divides,
rotates the tail back (cos and sin of the angles are taken with torch before the launch, as
`apply_rope` takes them, so the rotation uses the chain's very values), rounds to out_dtype and,
with mxfp8, rounds each block of 32 through e4m3 under its power-of-two scale, all in registers.

`choose_config` sizes the tiles for Hopper (16 heads x 512 dims of accumulator, 32 KB key tiles,
tl.dot's minimum of 16 on every dim) and splits the keys where rows x head blocks would leave SMs
idle (decode): each split's program stores its running max, its running sum (without the sink) and
its unnormalised o to an fp32 workspace, and `mega_attention_kernel_combine` merges the splits
under their common max, adds the sink's e^(sink - m) once and runs the epilogue. Every split's max
starts at the sink, a finite lower bound of the row's max, so a split whose keys are all invalid
adds exactly nothing. With one split the kernel finishes the row itself (one launch).

Numerics: fp32 keys: both dots at fp32-level accuracy ("tf32x3"), as the chain computes in fp32
from upcast operands. 16-bit keys: q K^T is one 16-bit MMA with fp32 accumulation (16-bit products
are exact in fp32, so this is the chain's fp32 dot up to summation order), and P V splits p into
two 16-bit parts (hi + lo, each rounded to nearest: p to 2^-18 relative for bf16) against the exact
keys: fp32-level accuracy at the 16-bit MMA rate (the interpreter upcasts before its dots: numpy
has no bf16 dot). The e4m3 rounding is done with integer and fp32 arithmetic (ties to even,
subnormals, saturation at 448), so CPU and GPU round identically. The kernel may differ from the
chain in the last fp32 bits (summation order, fused multiply-adds); an MXFP8 value can then differ
by one e4m3 step where the fp32 value sits on a rounding tie of the chain's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import string
from dataclasses import dataclass
from pathlib import Path

import torch
import triton.language  # noqa: F401  (import Triton before any kernel module: see kernel_cache)

from megafuse.model import quant
from megafuse.model.attention import sparse_attention_with_sink
from megafuse.model.rope import apply_rope

from . import kernel_cache, snippets
from .launch import COMPILE_OPTIONS, empty, require_one_device

KERNEL_NAME = "mega_attention_kernel"
COMBINE_NAME = f"{KERNEL_NAME}_combine"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MXFP8_BLOCK = 32
MAX_HEAD_DIM = 1024  # the fp32 accumulator of BLOCK_H heads x head_dim lives in registers


@dataclass(frozen=True)
class AttentionSpec:
    """Everything the generator specialises on. `rope_dim=0`: no inverse RoPE."""
    heads: int
    head_dim: int
    rope_dim: int
    scale: float
    key_dtype: str  # q's and the keys' dtype (the chain upcasts both to fp32)
    out_dtype: str  # the dtype the chain rounds o to before its quantisation
    mxfp8: bool  # round the output through MXFP8 (quant="ref")
    q_rope: bool = False  # rotate q's tail by +angle first (the chain's RoPE of q, rounded to key_dtype)

    @functools.cache  # the launch path asks for it on every call: hash the JSON once per spec
    def key(self) -> str:
        """Short stable hash of the spec and of the generator's template (file names, memo keys)."""
        fields = dataclasses.asdict(self) | {"scale": float(self.scale).hex()}
        text = json.dumps(fields, sort_keys=True) + _GENERATOR_FINGERPRINT
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {"key": self.key(), "unsupported": unsupported_reason(self)}


def unsupported_reason(spec: AttentionSpec) -> str | None:
    """None if the generator handles `spec`, else a sentence saying why not (for the pass report)."""
    for what, dtype in (("key", spec.key_dtype), ("output", spec.out_dtype)):
        if dtype not in DTYPES:
            return f"{what} dtype {dtype!r} is not supported (float32, bfloat16 or float16 only)"
    if spec.heads < 1:
        return f"{spec.heads} heads: at least one is needed"
    if not 16 <= spec.head_dim <= MAX_HEAD_DIM or spec.head_dim & (spec.head_dim - 1):
        return f"head_dim {spec.head_dim} must be a power of two in 16..{MAX_HEAD_DIM} (one register tile per head)"
    if spec.rope_dim < 0 or spec.rope_dim % 2 or spec.rope_dim > spec.head_dim:
        return f"rope_dim {spec.rope_dim} must be even and within head_dim {spec.head_dim}"
    if spec.q_rope and not spec.rope_dim:
        return "the q RoPE needs rope_dim > 0"
    if spec.mxfp8 and spec.head_dim % MXFP8_BLOCK:
        return f"MXFP8 blocks of {MXFP8_BLOCK} must tile head_dim {spec.head_dim}"
    if not abs(spec.scale) < float("inf"):
        return f"score scale {spec.scale!r} must be finite"
    return None


# ----------------------------------------------------------------------------------------------
# The generated kernel
# ----------------------------------------------------------------------------------------------

_TEMPLATE = string.Template('''"""Generated by megafuse.lowering.mega_attention: do not edit. Spec $KEY:
$SPEC_LINE
"""
import triton
import triton.language as tl

H = tl.constexpr($H)
DH = tl.constexpr($DH)
HALF = tl.constexpr($HALF)
ROPE_PAIRS = tl.constexpr($ROPE_PAIRS)  # rotated pairs: the last ROPE_PAIRS of the HALF pairs
SCALE = tl.constexpr($SCALE)

$COMBINERS

$ROUND_16BIT


$MXFP8


@triton.jit
def _dot16(a, b, acc, INTERPRETED: tl.constexpr):
    """a @ b + acc for 16-bit a and b, fp32 accumulation on tensor cores."""
    if INTERPRETED:  # numpy cannot dot bf16; 16-bit products are exact in fp32, so the sums agree
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _row_and_heads(BLOCK_H: tl.constexpr):
    """The program's query row and its block of heads: program_id(0) runs over rows x head blocks,
    the head blocks of a row adjacent."""
    blocks: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    return tl.program_id(0) // blocks, (tl.program_id(0) % blocks) * BLOCK_H + tl.arange(0, BLOCK_H)


@triton.jit
def _rope_pairs(x, row, cos_ptr, sin_ptr, stride_angle_row, BLOCK_H: tl.constexpr):
    """x [BLOCK_H, DH] fp32 as its (even, odd) elements [BLOCK_H, HALF] and the row's cos and sin
    [1, HALF]: 1 and 0 outside the rotated tail, so a rotation leaves those pairs as they are."""
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, HALF, 2)))
    angle = tl.arange(0, HALF) - (HALF - ROPE_PAIRS)
    rotated = angle >= 0
    cos = tl.load(cos_ptr + row * stride_angle_row + angle, mask=rotated, other=1.0)[None, :]
    sin = tl.load(sin_ptr + row * stride_angle_row + angle, mask=rotated, other=0.0)[None, :]
    return even, odd, cos, sin


@triton.jit
def _finish(o, row, heads, head_ok, dims, cos_ptr, sin_ptr, out_ptr, stride_angle_row, stride_out_row,
            stride_out_head, BLOCK_H: tl.constexpr):
    """The epilogue on o [BLOCK_H, DH] fp32: inverse RoPE, the rounding, MXFP8, the store."""
$ROPE_LINES
$ROUND_LINES
$MXFP8_LINES
    tl.store(out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
             o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def $KERNEL(q_ptr, k_ptr, valid_ptr, sink_ptr, cos_ptr, sin_ptr, out_ptr, m_ptr, l_ptr, part_ptr, J,
            KEYS_PER_SPLIT, stride_q_row, stride_q_head, stride_k_row, stride_k_key, stride_valid_row,
            stride_angle_row, stride_out_row, stride_out_head, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr,
            SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (row, block of heads, split): the split's keys; with SPLITS > 1 its partial result
    (running max, running sum without the sink, unnormalised o) goes to the workspace for
    ${KERNEL}_combine, else the program finishes the row itself. A row's head blocks are adjacent
    programs, so its key tiles come from HBM once and from L2 for the other blocks."""
    row, heads = _row_and_heads(BLOCK_H)
    head_ok = heads < H
    dims = tl.arange(0, DH)
    q = tl.load(q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
                mask=head_ok[:, None], other=0.0)
$Q_ROPE_LINES
    # the running max starts at the sink (a finite lower bound of the final max in every split); the
    # sink's e^(sink - m) starts the running sum at 1 where one program sees all keys, else the
    # combine adds it once
    m = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    total = tl.full((BLOCK_H,), 1.0 if SPLITS == 1 else 0.0, tl.float32)
    acc = tl.full((BLOCK_H, DH), 0.0, tl.float32)
    first = tl.program_id(1) * KEYS_PER_SPLIT
    last = tl.minimum(first + KEYS_PER_SPLIT, J)
    for start in range(first, last, BLOCK_J):
        keys = start + tl.arange(0, BLOCK_J)
        ok = (keys < last) & (tl.load(valid_ptr + row * stride_valid_row + keys, mask=keys < last, other=0) != 0)
        k = tl.load(k_ptr + row * stride_k_row + keys[:, None] * stride_k_key + dims[None, :],
                    mask=ok[:, None], other=0.0)
$SCORE_LINE
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _maximum))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.reduce(p, 1, _add)
$PV_LINES
        m = m_new
    if SPLITS == 1:
        _finish(acc / total[:, None], row, heads, head_ok, dims, cos_ptr, sin_ptr, out_ptr, stride_angle_row,
                stride_out_row, stride_out_head, BLOCK_H)
    else:
        at = (row * SPLITS + tl.program_id(1)) * H + heads
        tl.store(m_ptr + at, m, mask=head_ok)
        tl.store(l_ptr + at, total, mask=head_ok)
        tl.store(part_ptr + at[:, None] * DH + dims[None, :], acc, mask=head_ok[:, None])


@triton.jit
def ${KERNEL}_combine(sink_ptr, cos_ptr, sin_ptr, out_ptr, m_ptr, l_ptr, part_ptr, stride_angle_row,
                      stride_out_row, stride_out_head, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr):
    """Program (row, block of heads): the splits' partial results merged under their common max,
    the sink's term added once, then the epilogue."""
    row, heads = _row_and_heads(BLOCK_H)
    head_ok = heads < H
    dims = tl.arange(0, DH)
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    m = sink
    for split in range(SPLITS):
        m = tl.maximum(m, tl.load(m_ptr + (row * SPLITS + split) * H + heads, mask=head_ok, other=0.0))
    total = tl.exp(sink - m)
    acc = tl.full((BLOCK_H, DH), 0.0, tl.float32)
    for split in range(SPLITS):
        at = (row * SPLITS + split) * H + heads
        weight = tl.exp(tl.load(m_ptr + at, mask=head_ok, other=0.0) - m)
        total += tl.load(l_ptr + at, mask=head_ok, other=0.0) * weight
        acc += tl.load(part_ptr + at[:, None] * DH + dims[None, :], mask=head_ok[:, None], other=0.0) * weight[:, None]
    _finish(acc / total[:, None], row, heads, head_ok, dims, cos_ptr, sin_ptr, out_ptr, stride_angle_row,
            stride_out_row, stride_out_head, BLOCK_H)
''')

_ROPE_LINES = '''    # inverse RoPE of the tail: pair i = (2i, 2i + 1), rotated by -angle
    even, odd, cos, sin = _rope_pairs(o, row, cos_ptr, sin_ptr, stride_angle_row, BLOCK_H)
    o = tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin), (BLOCK_H, DH))'''

# The chain's RoPE of q (model.rope.apply_rope): the tail's pairs rotated by +angle in fp32 and
# rounded back to q's dtype, once per program, before the first score.
_Q_ROPE_LINES = '''    even, odd, cos, sin = _rope_pairs(q.to(tl.float32), row, cos_ptr, sin_ptr, stride_angle_row, BLOCK_H)
    q = tl.reshape(tl.join(even * cos - odd * sin, even * sin + odd * cos), (BLOCK_H, DH))
    q = $Q_ROUND.to(q_ptr.dtype.element_ty)'''

# P V: fp32 keys multiply fp32 p at fp32-level accuracy (tf32x3). 16-bit keys are exact in the MMA's
# own dtype, so q K^T is one 16-bit MMA with fp32 accumulation (exact products, as the chain's fp32
# dot of upcast values) and p is split into two 16-bit parts (p = hi + lo to 2^-18 relative for
# bf16), both rounded to nearest as torch rounds, two MMAs: fp32-level accuracy at 16-bit MMA rates.
_SCORES_FP32 = '''        s = tl.dot(q, tl.trans(k), input_precision="tf32x3") * SCALE'''
_PV_FP32 = '''        acc = tl.dot(p, k, acc * alpha[:, None], input_precision="tf32x3")'''
_SCORES_16BIT = '''        s = _dot16(q, tl.trans(k), tl.full((BLOCK_H, BLOCK_J), 0.0, tl.float32), INTERPRETED) * SCALE'''
_PV_16BIT = '''        p_hi = _round_$KEY_DTYPE(p)
        p_lo = _round_$KEY_DTYPE(p - p_hi)
        acc = _dot16(p_hi.to(k.dtype), k, acc * alpha[:, None], INTERPRETED)
        acc = _dot16(p_lo.to(k.dtype), k, acc, INTERPRETED)'''

_ROUNDING = ("bfloat16", "float16")  # out dtypes the epilogue rounds to (snippets.ROUND_16BIT)

# Any edit of this module (template, generator code) or of the shared snippets changes every spec's key.
_GENERATOR_FINGERPRINT = hashlib.sha1(Path(__file__).read_bytes() + snippets.SOURCE).hexdigest()


def generate_source(spec: AttentionSpec) -> str:
    """The Triton module for `spec` (raises ValueError for an unsupported spec)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_attention cannot generate this spec: {reason}")
    round_lines = ""
    if spec.out_dtype in _ROUNDING:
        round_lines = f"    o = _round_{spec.out_dtype}(o)  # the chain's o.to({spec.out_dtype}), in fp32 registers"
    mxfp8_lines = "    o = _mxfp8(o, BLOCK_H, DH)  # quant=\"ref\": MXFP8 in WO-A's input layout" if spec.mxfp8 else ""
    q_rope_lines = ""
    if spec.q_rope:
        q_round = f"_round_{spec.key_dtype}(q)" if spec.key_dtype in _ROUNDING else "q"
        q_rope_lines = string.Template(_Q_ROPE_LINES).substitute(Q_ROUND=q_round)
    spec_line = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(spec).items())
    sixteen = spec.key_dtype != "float32"
    pv_lines = string.Template(_PV_16BIT).substitute(KEY_DTYPE=spec.key_dtype) if sixteen else _PV_FP32
    return _TEMPLATE.substitute(
        SCORE_LINE=_SCORES_16BIT if sixteen else _SCORES_FP32, PV_LINES=pv_lines,
        COMBINERS=snippets.COMBINERS, ROUND_16BIT=snippets.ROUND_16BIT,
        KEY=spec.key(), SPEC_LINE=spec_line, KERNEL=KERNEL_NAME, H=spec.heads, DH=spec.head_dim,
        HALF=spec.head_dim // 2, ROPE_PAIRS=spec.rope_dim // 2, SCALE=repr(float(spec.scale)),
        MXFP8=snippets.MXFP8, ROPE_LINES=_ROPE_LINES if spec.rope_dim else "",
        ROUND_LINES=round_lines, MXFP8_LINES=mxfp8_lines, Q_ROPE_LINES=q_rope_lines)


def kernel_name(spec: AttentionSpec) -> str:
    """The cache file stem: content-addressed by the spec and the generator's template."""
    return f"mega_attention_{spec.key()}"


def source_path(spec: AttentionSpec):
    """Write (if needed) and return the cached source file of `spec`."""
    return kernel_cache.write_source(kernel_name(spec), generate_source(spec))


def load(spec: AttentionSpec, interpret: bool, attr: str = KERNEL_NAME):
    """The jitted kernel `attr` of `spec`'s module for one mode (the source goes to the cache on
    first use): KERNEL_NAME, or COMBINE_NAME, the merge of a split launch."""
    return kernel_cache.load_generated(kernel_name(spec), lambda: generate_source(spec), attr, interpret)


# ----------------------------------------------------------------------------------------------
# Launch and reference
# ----------------------------------------------------------------------------------------------

def validate(q, keys, valid, sink, angles, spec: AttentionSpec) -> None:
    """Raise ValueError if the launcher must refuse these inputs; shapes, dtypes and devices only
    (a pass runs it on a match's fake tensors: an unfused chain, never a run-time error)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_attention: unsupported spec: {reason}")
    H, Dh = spec.heads, spec.head_dim
    if q.dim() != 3 or tuple(q.shape[1:]) != (H, Dh):
        raise ValueError(f"mega_attention: q must be [R, {H}, {Dh}], got {list(q.shape)}")
    R = q.shape[0]
    if keys.dim() != 3 or keys.shape[0] != R or keys.shape[2] != Dh:
        raise ValueError(f"mega_attention: keys must be [{R}, J, {Dh}], got {list(keys.shape)}")
    if tuple(valid.shape) != tuple(keys.shape[:2]) or valid.dtype != torch.bool:
        raise ValueError(f"mega_attention: valid must be bool {list(keys.shape[:2])}, got {valid.dtype} {list(valid.shape)}")
    if tuple(sink.shape) != (H,):
        raise ValueError(f"mega_attention: sink must be [{H}], got {list(sink.shape)}")
    if tuple(angles.shape) != (R, spec.rope_dim // 2) or angles.dtype != torch.float32:
        raise ValueError(f"mega_attention: angles must be float32 [{R}, {spec.rope_dim // 2}], "
                         f"got {angles.dtype} {list(angles.shape)}")
    for name, t in (("q", q), ("keys", keys)):
        if t.dtype != DTYPES[spec.key_dtype]:
            raise ValueError(f"mega_attention: {name} dtype {t.dtype} does not match spec key_dtype {spec.key_dtype}")
    require_one_device("mega_attention", q, keys, valid, sink, angles)


@dataclass(frozen=True)
class LaunchConfig:
    """How one launch tiles its work: heads per program (the MMA's M), keys per tile, and the
    split of each row's keys over programs (SPLITS > 1 adds the combine launch)."""
    block_h: int
    block_j: int
    splits: int
    keys_per_split: int
    num_warps: int = 4
    num_stages: int = 2


# Register and shared-memory budgets of one program (4 warps): the fp32 accumulator
# [block_h, head_dim] in registers (64 a thread at 8192 elements), a key tile of at most 32 KB per
# pipeline stage. Their sizes are powers of two; tl.dot needs at least 16 along every dim.
ACC_ELEMENTS = 8192
KEY_TILE_BYTES = 32 * 1024
MIN_DOT = 16
WIDE_ROWS = 64  # from this many rows a program takes twice the heads: fewer key reads, enough programs
TARGET_PROGRAMS = 2 * 132  # two programs per H200 SM: fewer rows x head blocks than this split the keys
MAX_SPLITS = 16  # the combine reads splits x heads x head_dim fp32 per row


def choose_config(spec: AttentionSpec, rows: int, n_keys: int, splits: int | None = None,
                  device: str = "cuda") -> LaunchConfig:
    """The launch for `rows` query rows of `n_keys` keys each; `splits` forces the key split (tests,
    sweeps), else on a GPU it grows until rows x head blocks x splits reaches TARGET_PROGRAMS. The
    interpreter (device "cpu") runs programs one after the other and reduces element by element:
    there no split, and tiles no larger than the data."""
    if device == "cuda":
        block_h = max(MIN_DOT, min(_next_pow2(spec.heads), max(MIN_DOT, ACC_ELEMENTS // spec.head_dim)))
        block_j = max(MIN_DOT, min(64, KEY_TILE_BYTES // (spec.head_dim * DTYPES[spec.key_dtype].itemsize)))
    else:  # the interpreter reduces element by element in Python: no padding to the MMA's minimum
        block_h, block_j = min(_next_pow2(spec.heads), 64), MIN_DOT
    tiles = max(1, -(-n_keys // block_j))
    if splits is None and device != "cuda":
        splits = 1
    elif splits is None:
        programs = rows * -(-spec.heads // block_h)
        splits = min(MAX_SPLITS, tiles, max(1, -(-TARGET_PROGRAMS // max(programs, 1))))
    elif splits < 1:
        raise ValueError(f"mega_attention: splits must be >= 1, got {splits}")
    keys_per_split = -(-tiles // min(splits, tiles)) * block_j
    if device == "cuda" and rows >= WIDE_ROWS:  # twice the heads at the narrow tile's split (as swept)
        block_h = min(2 * block_h, max(block_h, _next_pow2(spec.heads)))
    return LaunchConfig(block_h, block_j, max(1, -(-n_keys // keys_per_split)), keys_per_split)


def mega_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                   angles: torch.Tensor, spec: AttentionSpec, config: LaunchConfig | None = None) -> torch.Tensor:
    """out [R, H, head_dim] in out_dtype (module doc) from q [R, H, head_dim], keys [R, J, head_dim],
    valid [R, J] bool, sink [H] and the rows' RoPE angles [R, rope_dim / 2] fp32: one launch, or two
    where the keys are split over programs (`config`, by default `choose_config` for the tensors'
    device), after the angles' cos and sin, taken with torch as `apply_rope` takes them."""
    validate(q, keys, valid, sink, angles, spec)
    R, J = keys.shape[:2]
    out = empty((R, spec.heads, spec.head_dim), DTYPES[spec.out_dtype], q.device)
    if R == 0:
        return out
    config = config or choose_config(spec, R, J, device=q.device.type)
    angles = angles.contiguous()  # the kernel steps the angles' rows only (a rotary table may arrive transposed)
    cos, sin = angles.cos(), angles.sin()
    q, keys, valid = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, valid))
    sink = sink.contiguous()
    interpret = q.device.type != "cuda"
    programs = (R * -(-spec.heads // config.block_h),)  # rows x head blocks (_row_and_heads)
    partial = (R, config.splits, spec.heads)
    m, total = (empty(partial, torch.float32, q.device) for _ in range(2)) if config.splits > 1 else (out, out)
    acc = empty((*partial, spec.head_dim), torch.float32, q.device) if config.splits > 1 else out
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages, **COMPILE_OPTIONS)
    on_device = contextlib.nullcontext() if interpret else torch.cuda.device(q.device)
    with on_device:
        load(spec, interpret)[(*programs, config.splits)](
            q, keys, valid, sink, cos, sin, out, m, total, acc, J, config.keys_per_split, q.stride(0), q.stride(1),
            keys.stride(0), keys.stride(1), valid.stride(0), cos.stride(0), out.stride(0), out.stride(1),
            BLOCK_H=config.block_h, BLOCK_J=config.block_j, SPLITS=config.splits, INTERPRETED=interpret, **options)
        if config.splits > 1:
            load(spec, interpret, COMBINE_NAME)[programs](
                sink, cos, sin, out, m, total, acc, cos.stride(0), out.stride(0), out.stride(1),
                BLOCK_H=config.block_h, SPLITS=config.splits, **options)
    return out


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def reference(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
              angles: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """The chain in plain torch, from the model's own functions (`Attention._output` before WO-A)."""
    if spec.q_rope:
        q = apply_rope(q, angles[:, None, :])
    o = sparse_attention_with_sink(q[None], keys[None], valid[None], sink, spec.scale)[0]
    if spec.rope_dim:
        o = apply_rope(o, angles[:, None, :], inverse=True)
    o = o.to(DTYPES[spec.out_dtype])
    return quant.fake_quant_mxfp8(o) if spec.mxfp8 else o
