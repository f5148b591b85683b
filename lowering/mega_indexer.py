"""Mega-Indexer: a lightning indexer's step (index keys from their cache bytes, scores, top-k) in generated Triton.

For R query rows, each of a request whose index keys lie in the cache pool's pages:

    keys[r, n]  = decode(pool[pages[r, n // P], n % P])     P entries a page; the row's bytes decoded
    I[r, n]     = sum_h w[r, h] relu(q[r, h] . keys[r, n])    q [R, H, d], w [R, H] fp32
    I[r, n]     = -inf where n >= (positions[r] + 1) // ratio  (entries the row cannot see yet)
                  or where not allowed[r, n]
    topk[r]     = the K entries of largest I (ties to the lowest entry), ascending, -1 where fewer
                  than K are visible

where `allowed` [R, N] (optional, bool) also masks the scores: a reindex layer's candidate blocks.
The op returns the masked scores beside the top-k (the candidate source picks its blocks from them).
This is the model's `Attention._select` on its step path (`model.attention.index_scores` and
`select_topk` over `row_codec(cfg, "index_keys").decode`): `reference` calls those functions, so
the formula exists once.

Kernels (one generated module, two launches in stream order)
------------------------------------------------------------
1. `mega_indexer_kernel`, grid (R, N / BLOCK_N): each program decodes BLOCK_N entries of its row
   straight from the pool's bytes (the page table gathers the pages; no decoded copy of the keys
   exists), takes the H x BLOCK_N logits in one `tl.dot`, then ReLU, the head weights, the sum over
   heads and the visibility mask in registers, and stores the scores [R, N] fp32.
2. `_select_kernel`, grid (R / BLOCK_R,): the top-K without a sort. Each score maps to an unsigned
   key that orders as the float does; a radix search, a byte a pass from the top (four sweeps, each
   a 256-bin histogram of the keys that agree with the bytes already fixed), finds each row's K-th
   largest key t and how many of the keys equal to it are wanted; a row whose K-th largest is
   -inf takes every score above -inf. One sweep in entry order then writes the entries above t and
   the lowest-entry ones equal to it, which comes out ascending, and pads with -1.

Numerics: bf16 queries against keys of bf16 values (MXFP4, or raw bf16) dot exactly in bf16 with
fp32 accumulation; otherwise the dot runs in tf32x3 (each operand split in two tf32 parts: exact
where one side holds few bits, as MXFP4 keys and the model's MXFP4-rounded queries do). The sums run
in another order than torch's einsum, so a score can differ in its last fp32 bit and an entry within
that of the K-th score can be chosen instead of its neighbour: the same top-k sets, ties aside.
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

from megafuse.model.attention import index_scores, select_topk, visible_entries
from megafuse.model.cache import RowCodec, _quant_codec, _raw_codec

from . import kernel_cache, snippets
from .launch import COMPILE_OPTIONS, empty, require_one_device

MXFP4_BLOCK = 32
# the pool rows' formats (model/cache.py row_codec): MXFP4 (quant "ref"), or raw fp32 / bf16 bits (quant "none")
KEY_FORMATS = {"index_mxfp4": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
KERNEL_NAME = "mega_indexer_kernel"
SELECT_NAME = "_select_kernel"
KERNEL_NAMES = (KERNEL_NAME, SELECT_NAME)


@dataclass(frozen=True)
class IndexerSpec:
    """What the generator specialises on. key_format: the pool rows' format (KEY_FORMATS)."""
    heads: int
    head_dim: int
    topk: int
    ratio: int
    per_page: int  # entries a page holds
    key_format: str
    q_dtype: str
    allowed: bool = False  # a bool [R, N] mask narrows the selectable entries (a reindex layer's candidate blocks)

    @functools.cache
    def key(self) -> str:
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha1((fields + _GENERATOR_FINGERPRINT).encode()).hexdigest()[:12]

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {"key": self.key(), "unsupported": unsupported_reason(self)}

    def codec(self) -> RowCodec:
        """The model's codec of these rows (model/cache.py)."""
        if self.key_format == "index_mxfp4":
            return _quant_codec("index_mxfp4", self.head_dim)
        return _raw_codec(self.head_dim, KEY_FORMATS[self.key_format])

    @property
    def row_bytes(self) -> int:
        return self.codec().row_bytes


def unsupported_reason(spec: IndexerSpec) -> str | None:
    """None if the generator handles `spec`, else a sentence saying why not (for the pass report)."""
    if spec.key_format not in KEY_FORMATS:
        return f"key format {spec.key_format!r} is not one of {', '.join(KEY_FORMATS)}"
    if spec.q_dtype not in ("float32", "bfloat16"):
        return f"query dtype {spec.q_dtype!r} is not float32 or bfloat16"
    if spec.heads < 1 or spec.head_dim < 16 or spec.head_dim & (spec.head_dim - 1):
        return f"head_dim {spec.head_dim} must be a power of two >= 16 (the reduction of one tl.dot)"
    if spec.key_format == "index_mxfp4" and spec.head_dim % MXFP4_BLOCK:
        return f"MXFP4 blocks of {MXFP4_BLOCK} must tile head_dim {spec.head_dim}"
    if spec.topk < 1 or spec.ratio < 1 or spec.per_page < 1:
        return f"top-{spec.topk}, ratio {spec.ratio} and {spec.per_page} entries a page must all be positive"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# The generated module
# ----------------------------------------------------------------------------------------------

_MXFP4_DECODE = '''@triton.jit
def _decode_keys(rows, n_ok):
    """[BLOCK_N, D] fp32 keys from MXFP4 rows: element 2i in the low nibble of byte i, then one ue8m0
    byte per block of 32 (model/quant.py)."""
    d = tl.arange(0, D)
    byte = tl.load(rows[:, None] + (d // 2)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    code = (byte >> ((d % 2) * 4)[None, :]) & 0xF
    c = (code & 7).to(tl.float32)
    magnitude = tl.where(c < 4, 0.5 * c, tl.where(c < 6, c - 2.0, 2.0 * c - 8.0))
    value = tl.where((code & 8) != 0, -magnitude, magnitude)
    e = tl.load(rows[:, None] + (d // 32 + D // 2)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    scale = tl.where(e == 0, 2.0 ** -127, (e << 23).to(tl.float32, bitcast=True))
    return value * scale  # exact: 2 significant bits times a power of two'''

_RAW_DECODE = '''@triton.jit
def _decode_keys(rows, n_ok):
    \"\"\"[BLOCK_N, D] fp32 keys from raw little-endian $DTYPE rows.\"\"\"
    d = tl.arange(0, D)
    bits = tl.full([BLOCK_N, D], 0, tl.int32)
    for b in tl.static_range(WIDTH):
        byte = tl.load(rows[:, None] + (d * WIDTH + b)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        bits = bits | (byte << (8 * b))
    return $FROM_BITS'''

_TEMPLATE = string.Template('''\"\"\"Mega-Indexer kernels for spec $KEY, generated by megafuse.lowering.mega_indexer. Do not edit.

spec: $SPEC_LINE
\"\"\"
import triton
import triton.language as tl

H = tl.constexpr($H)
H_PAD = tl.constexpr($H_PAD)  # tl.dot's rows: at least 16
D = tl.constexpr($D)
K = tl.constexpr($K)
RATIO = tl.constexpr($RATIO)
PER_PAGE = tl.constexpr($PER_PAGE)
ROW_BYTES = tl.constexpr($ROW_BYTES)
BLOCK_N = tl.constexpr($BLOCK_N)
WIDTH = tl.constexpr($WIDTH)
HAS_ALLOWED = tl.constexpr($ALLOWED)

# Sums reduce and scan with tl.standard._sum_combine, a builtin's argument rather than a call of the
# @triton.jit library (tl.sum, tl.cumsum): the interpreter runs that combiner as one numpy sum, where
# another combiner runs element by element.

$DECODE


@triton.jit
def mega_indexer_kernel(q_ptr, w_ptr, pool_ptr, pages_ptr, positions_ptr, allowed_ptr, scores_ptr, N, pages_stride,
                        INTERPRETED: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    visible = n < (tl.load(positions_ptr + r).to(tl.int32) + 1) // RATIO
    if HAS_ALLOWED:
        visible = visible & (tl.load(allowed_ptr + r * N + n, mask=n < N, other=0) != 0)
    n_ok = (n < N) & visible
    page = tl.load(pages_ptr + r * pages_stride + n // PER_PAGE, mask=n_ok, other=0).to(tl.int64)
    keys = _decode_keys(pool_ptr + (page * PER_PAGE + n % PER_PAGE) * ROW_BYTES, n_ok)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + r * H * D + h[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0).to(tl.float32)
$DOT_LINES
    w = tl.load(w_ptr + r * H + h, mask=h < H, other=0.0)
    scores = tl.reduce(tl.maximum(logits, 0.0) * w[:, None], 0, tl.standard._sum_combine)
    tl.store(scores_ptr + r * N + n, tl.where(visible, scores, float("-inf")), mask=n < N)


@triton.jit
def _order_key(scores):
    """uint32 keys that order as the fp32 scores do: the sign bit flipped for +, every bit for -;
    -0.0 keyed as +0.0 (they tie, as in the chain's sort)."""
    bits = tl.where(scores == 0.0, 0.0, scores).to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)


@triton.jit
def _digit_counts(scores_ptr, rows, rows_ok, N, prefix, SHIFT: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK: tl.constexpr):
    """[BLOCK_R, 256]: per row, how many of its keys agree with `prefix` [BLOCK_R] above bit SHIFT + 8
    and hold each 8-bit digit at SHIFT (one histogram over the block's rows, a row's bins apart)."""
    counts = tl.full([BLOCK_R * 256], 0, tl.int32)
    bins_of_row = tl.arange(0, BLOCK_R)[:, None] * 256
    for start in range(0, N, BLOCK):
        n = start + tl.arange(0, BLOCK)
        ok = rows_ok[:, None] & (n < N)[None, :]
        key = _order_key(tl.load(scores_ptr + rows[:, None] * N + n[None, :], mask=ok, other=float("-inf")))
        if SHIFT < 24:
            ok = ok & ((key >> (SHIFT + 8)) == (prefix[:, None] >> (SHIFT + 8)))
        digit = ((key >> SHIFT) & 0xFF).to(tl.int32) + bins_of_row
        counts += tl.histogram(tl.reshape(digit, [BLOCK_R * BLOCK]), BLOCK_R * 256,
                               mask=tl.reshape(ok, [BLOCK_R * BLOCK]))
    return tl.reshape(counts, [BLOCK_R, 256])


@triton.jit
def _select_kernel(scores_ptr, out_ptr, R, N, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_ok = rows < R
    rows = rows.to(tl.int64)
    # each row's K-th largest key, a byte a pass from the top: the largest digit d whose keys at or
    # above it still hold the `need` keys wanted below the bytes already fixed
    prefix = tl.full([BLOCK_R], 0, tl.uint32)
    need = tl.full([BLOCK_R], K, tl.int32)
    digits = tl.arange(0, 256)[None, :]
    for level in tl.static_range(4):
        counts = _digit_counts(scores_ptr, rows, rows_ok, N, prefix, 24 - 8 * level, BLOCK_R, BLOCK)
        at_or_above = tl.reduce(counts, 1, tl.standard._sum_combine)[:, None] \
            - tl.associative_scan(counts, 1, tl.standard._sum_combine) + counts
        digit = tl.maximum(tl.reduce((at_or_above >= need[:, None]).to(tl.int32), 1, tl.standard._sum_combine) - 1, 0)
        need -= tl.reduce(tl.where(digits > digit[:, None], counts, 0), 1, tl.standard._sum_combine)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * level))
    # the K-th largest is -inf (or the row holds fewer than K keys): every score above -inf is chosen
    take_all = prefix <= 0x007FFFFF  # the key of -inf
    threshold = tl.where(take_all, 0x007FFFFF, prefix).to(tl.uint32)
    need = tl.where(take_all, 0, need)  # of the keys equal to the threshold, the lowest entries
    written = tl.full([BLOCK_R], 0, tl.int32)
    equal_seen = tl.full([BLOCK_R], 0, tl.int32)
    for start in range(0, N, BLOCK):
        n = start + tl.arange(0, BLOCK)
        ok = rows_ok[:, None] & (n < N)[None, :]
        key = _order_key(tl.load(scores_ptr + rows[:, None] * N + n[None, :], mask=ok, other=float("-inf")))
        above = (key > threshold[:, None]) & ok
        equal = ((key == threshold[:, None]) & ok).to(tl.int32)
        equal_rank = equal_seen[:, None] + tl.associative_scan(equal, 1, tl.standard._sum_combine) - equal
        chosen = (above | ((equal != 0) & (equal_rank < need[:, None]))).to(tl.int32)
        slot = written[:, None] + tl.associative_scan(chosen, 1, tl.standard._sum_combine) - chosen
        ids = tl.full([BLOCK_R, BLOCK], 0, tl.int64) + n[None, :]  # tl.zeros is a @triton.jit library function
        tl.store(out_ptr + rows[:, None] * K + slot, ids, mask=chosen != 0)
        written += tl.reduce(chosen, 1, tl.standard._sum_combine)
        equal_seen += tl.reduce(equal, 1, tl.standard._sum_combine)
    for start in range(0, K, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + rows[:, None] * K + slot[None, :], tl.full([BLOCK_R, BLOCK], -1, tl.int64),
                 mask=rows_ok[:, None] & (slot[None, :] >= written[:, None]) & (slot < K)[None, :])
''')

# Any edit of this module or of the shared snippets changes every spec's key.
_GENERATOR_FINGERPRINT = hashlib.sha1(Path(__file__).read_bytes() + snippets.SOURCE).hexdigest()


def generate_source(spec: IndexerSpec, block_n: int = 64) -> str:
    """The Triton module of `spec` (raises ValueError for an unsupported spec)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_indexer cannot generate this spec: {reason}")
    width, decode = 1, _MXFP4_DECODE
    if spec.key_format != "index_mxfp4":
        width = KEY_FORMATS[spec.key_format].itemsize
        from_bits = ("bits.to(tl.float32, bitcast=True)" if width == 4 else
                     "(bits << 16).to(tl.float32, bitcast=True)  # bf16 bits are fp32's upper half")
        decode = string.Template(_RAW_DECODE).substitute(DTYPE=spec.key_format, FROM_BITS=from_bits)
    if spec.q_dtype == "bfloat16" and spec.key_format != "float32":
        # bf16 queries, keys of bf16 values: the products are exact, the sums fp32's
        dot = ("    if INTERPRETED:  # numpy cannot dot bf16: the same exact products in fp32\n"
               "        logits = tl.dot(q, tl.trans(keys), tl.full([H_PAD, BLOCK_N], 0.0, tl.float32),\n"
               "                        input_precision=\"ieee\")\n"
               "    else:\n"
               "        logits = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)),\n"
               "                        tl.full([H_PAD, BLOCK_N], 0.0, tl.float32))")
    else:  # fp32 operands split in two tf32 parts: exact where one holds few bits (MXFP4 keys)
        dot = ("    if INTERPRETED:\n"
               "        logits = tl.dot(q, tl.trans(keys), tl.full([H_PAD, BLOCK_N], 0.0, tl.float32),\n"
               "                        input_precision=\"ieee\")\n"
               "    else:\n"
               "        logits = tl.dot(q, tl.trans(keys), tl.full([H_PAD, BLOCK_N], 0.0, tl.float32),\n"
               "                        input_precision=\"tf32x3\")")
    spec_line = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(spec).items())
    return _TEMPLATE.substitute(
        KEY=spec.key(), SPEC_LINE=spec_line, H=spec.heads, H_PAD=max(16, _next_pow2(spec.heads)), D=spec.head_dim,
        K=spec.topk, RATIO=spec.ratio, PER_PAGE=spec.per_page, ROW_BYTES=spec.row_bytes, BLOCK_N=block_n,
        ALLOWED=spec.allowed, WIDTH=width, DECODE=decode, DOT_LINES=dot)


def kernel_name(spec: IndexerSpec, block_n: int) -> str:
    return f"mega_indexer_{spec.key()}_{block_n}"


def load(spec: IndexerSpec, block_n: int, interpret: bool, attr: str):
    """The jitted kernel `attr` (one of KERNEL_NAMES) of `spec`'s module for one mode."""
    return kernel_cache.load_generated(kernel_name(spec, block_n), lambda: generate_source(spec, block_n), attr,
                                       interpret)


# ----------------------------------------------------------------------------------------------
# Launch configuration, launcher and reference
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchConfig:
    """Entries per scoring program (BLOCK_N), rows per selection program (block_rows) and entries per
    step of its sweeps (block_select)."""
    block_n: int
    block_select: int
    block_rows: int = 1
    num_warps: int = 4


def choose_config(spec: IndexerSpec, n_rows: int, *, device: torch.device | str = "cuda") -> LaunchConfig:
    """Hopper: 64 entries a scoring program (H x 64 logits over D in one MMA), a row a selection
    program (decode steps hold few rows: one SM each), sweeps of 1024 scores. The interpreter runs
    programs one after the other, each op at about the same cost whatever its size: wider blocks,
    and up to 32 rows a selection program."""
    if torch.device(device).type == "cuda":
        return LaunchConfig(block_n=64, block_select=1024, block_rows=1, num_warps=4)
    return LaunchConfig(block_n=128, block_select=_next_pow2(max(spec.topk, 256)),
                        block_rows=min(32, _next_pow2(max(n_rows, 1))))


def validate(q, w, pool, pages, positions, allowed, spec: IndexerSpec) -> None:
    """Raise ValueError if the launcher must refuse these inputs (shapes, dtypes, devices only: a
    pass runs it on a match's fake tensors)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_indexer: unsupported spec: {reason}")
    H, D = spec.heads, spec.head_dim
    if q.dim() != 3 or tuple(q.shape[1:]) != (H, D) or q.dtype != getattr(torch, spec.q_dtype):
        raise ValueError(f"mega_indexer: q must be {spec.q_dtype} [R, {H}, {D}], got {q.dtype} {list(q.shape)}")
    R = q.shape[0]
    if tuple(w.shape) != (R, H) or w.dtype != torch.float32:
        raise ValueError(f"mega_indexer: w must be float32 [{R}, {H}], got {w.dtype} {list(w.shape)}")
    if pool.dim() != 3 or tuple(pool.shape[1:]) != (spec.per_page, spec.row_bytes) or pool.dtype != torch.uint8:
        raise ValueError(f"mega_indexer: pool must be uint8 [pages, {spec.per_page}, {spec.row_bytes}], got "
                         f"{pool.dtype} {list(pool.shape)}")
    if pages.dim() != 2 or pages.shape[0] != R or pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mega_indexer: pages must be int32/int64 [{R}, max_pages], got {pages.dtype} {list(pages.shape)}")
    if tuple(positions.shape) != (R,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mega_indexer: positions must be int [{R}], got {positions.dtype} {list(positions.shape)}")
    N = pages.shape[1] * spec.per_page
    if (allowed is not None) != spec.allowed or allowed is not None and (
            tuple(allowed.shape) != (R, N) or allowed.dtype != torch.bool):
        raise ValueError(f"mega_indexer: allowed must be {'bool [' + str(R) + ', ' + str(N) + ']' if spec.allowed else 'None'}"
                         f" for this spec, got {None if allowed is None else (allowed.dtype, list(allowed.shape))}")
    require_one_device("mega_indexer", q, w, pool, pages, positions, *([allowed] if allowed is not None else []))


def mega_indexer(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor,
                 allowed: torch.Tensor | None, spec: IndexerSpec,
                 config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk [R, K] int64, the scores it chose from [R, N] fp32; module doc): every entry the rows'
    pages can hold is scored."""
    validate(q, w, pool, pages, positions, allowed, spec)
    R, device = q.shape[0], q.device
    N = pages.shape[1] * spec.per_page
    scores = empty((R, N), torch.float32, device)
    if R == 0:
        return empty((R, spec.topk), torch.int64, device), scores
    cfg = config or choose_config(spec, R, device=device)
    q, w, pool = q.contiguous(), w.contiguous(), pool.contiguous()
    pages, positions = pages if pages.stride(1) == 1 else pages.contiguous(), positions.contiguous()
    allowed = scores if allowed is None else allowed.contiguous().view(torch.int8)  # a pointer the kernel never reads
    interpret = device.type != "cuda"
    with contextlib.nullcontext() if interpret else torch.cuda.device(device):
        load(spec, cfg.block_n, interpret, KERNEL_NAME)[(R, -(-N // cfg.block_n))](
            q, w, pool, pages, positions, allowed, scores, N, pages.stride(0), INTERPRETED=interpret,
            num_warps=cfg.num_warps, **COMPILE_OPTIONS)
    return select(scores, spec, cfg), scores


def select(scores: torch.Tensor, spec: IndexerSpec, config: LaunchConfig | None = None) -> torch.Tensor:
    """topk [R, K] int64 of scores [R, N] fp32 (-inf: never chosen): the op's second launch alone, the
    K largest (ties to the lowest entry), ascending, -1 padded, as `model.attention.select_topk`."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"mega_indexer.select: scores must be float32 [R, N], got {scores.dtype} {list(scores.shape)}")
    R, N = scores.shape
    out = empty((R, spec.topk), torch.int64, scores.device)
    if R == 0:
        return out
    cfg = config or choose_config(spec, R, device=scores.device)
    interpret = scores.device.type != "cuda"
    with contextlib.nullcontext() if interpret else torch.cuda.device(scores.device):
        load(spec, cfg.block_n, interpret, SELECT_NAME)[(-(-R // cfg.block_rows),)](
            scores.contiguous(), out, R, N, BLOCK_R=cfg.block_rows, BLOCK=cfg.block_select,
            num_warps=cfg.num_warps, **COMPILE_OPTIONS)
    return out


def reference(q, w, pool, pages, positions, allowed, spec: IndexerSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own step: the pages' rows decoded, `index_scores`, the candidate mask, `select_topk`."""
    keys = spec.codec().decode(pool[pages].flatten(1, 2), q.dtype)  # [R, N, d]
    visible = visible_entries(positions, keys.shape[1], spec.ratio)
    scores = index_scores(q[None], w[None], keys[None], visible[None])
    if allowed is not None:
        scores = scores.masked_fill(~allowed[None], float("-inf"))
    return select_topk(scores, spec.topk)[0], scores[0]
