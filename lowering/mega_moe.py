"""Mega-MoE: the routed experts of an MoE layer (dispatch, two grouped GEMMs, combine) in generated Triton.

For N tokens u [N, D], their k routing weights w [N, k] (fp32) and expert ids [N, k], with the
experts' weights w13 [E, 2F, D] ([w1 | w3] rows) and w2 [E, D, F]:

    gate_up[s] = w13[ids[s]] @ u[s // k]                            slot s = (token s // k, choice s % k)
    act[s]     = silu(min(g, limit)) * clamp(v, -limit, limit) * w[s]    [g | v] = gate_up[s]
    act[s]     = mxfp8(act[s])                                      (quant="ref": blocks of 32 along F)
    down[s]    = w2[ids[s]] @ act[s]
    out[n]     = sum over j < k of down[n * k + j]                  rounded to out_dtype

This is `model.moe.Experts` after its input rounding (`weight_at="before"`, the model's math):
`reference` calls the model's own `Experts._grouped` (bf16 weights, `torch._grouped_mm`) or
`Experts._gathered` (fp32 weights, bmm over gathered weights) and `sum_slots`, so the formula exists
once. HF's DeepseekV4 experts weight the slot AFTER the down projection (`weight_at="after"`):

    act[s]     = silu(min(g, limit)) * clamp(v, -limit, limit)       (swiglu_dtype="bfloat16": HF's
                 _apply_gate on a bf16 GEMM output, min(g, L), silu, clamp(v) and the product each rounded)
    down[s]    = w2[ids[s]] @ act[s]                                 rounded as the GEMM writes it
    slot[s]    = down[s] * w[s]                                      rounded to weighted_dtype
    out[n]     = sum over j < k of slot[n * k + j] (fp32 accumulate) rounded to out_dtype

whose reference is `_reference_plain` below, written once in plain torch (it also serves the
model's placement with a bf16 SwiGLU, a spec the model does not write).

Kernels (one generated module, four launches in stream order, no host synchronisation)
------------------------------------------------------------------------------------
1. `_count_kernel` (one program): expert-sorted rows without a sort. A one-hot [BLOCK_S, E_PAD]
   of each chunk of slots gives the per-expert counts; their prefix sums give each expert's first
   row (`offsets`); a second sweep gives each slot its row, offsets[e] + the number of earlier
   slots of expert e (a stable counting sort: slots keep their order within an expert), and the
   inverse map (row -> slot). It also writes the tile table the GEMMs read: each expert's rows cut
   into tiles of BLOCK_M rows (tile -> expert, first row), and the number of tiles. Every tile
   holds rows of one expert only, so a GEMM program reads one expert's weights.
2. `mega_moe_kernel`, the gate-up GEMM (the main kernel: the one tools build for Hopper), grid
   (tiles bound, F / BLOCK_N): rows of one expert gathered from u, times that expert's w1 and w3
   rows (two accumulators, tl.dot), then the epilogue in registers: the rounding the chain's GEMM
   output has, the clamped SwiGLU, the slot weight, MXFP8 (BLOCK_N is a multiple of 32 and tiles
   start on multiples of it, so every block of 32 lies in one program), and the store of act in the
   down GEMM's input dtype. The grid is an upper bound on the tiles (ceil(S / BLOCK_M) + min(E, S));
   programs past the count the first kernel wrote return at once. Only routed experts' weights are
   read: an expert with no rows has no tile.
3. `_down_kernel`, grid (tiles bound, D / BLOCK_N): act rows of one expert times its w2 rows,
   rounded as the chain's GEMM output is, stored fp32 in expert order.
4. `_combine_kernel`, grid (N / BLOCK_T, D / BLOCK_N): out[n] = the sum of its k rows, in slot
   order (deterministic: no atomics), rounded to out_dtype.

Numerics: the bf16 form rounds where the chain does: u to bf16 (the `.to(bf16)` of the dispatch),
gate_up and down to bf16 (what `_grouped_mm` writes), act to bf16 after MXFP8 (the cast before the
down GEMM); bf16 x bf16 dots accumulate in fp32, as `_grouped_mm` does. The fp32 form computes in
fp32 with `tl.dot(input_precision=spec.precision)` ("tf32x3": fp32-level accuracy on tensor cores).
Roundings to bf16 and e4m3 are integer / fp32 arithmetic (snippets), identical on CPU and GPU. The
kernel sums its dots in another order than the chain, so a value can differ in its last fp32 bit,
and a bf16 or e4m3 rounding of it can then land one step away where the chain's value sits on a
tie: equal within the format's rounding, not bit for bit.

Ids must lie in [0, E) (the chain's scatter_add would fail otherwise); the launcher cannot check
values without a synchronisation, so an out-of-range id is outside the contract.
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

from megafuse.model.moe import Experts, sum_slots
from megafuse.model.quant import fake_quant_mxfp8

from . import kernel_cache, snippets
from .launch import COMPILE_OPTIONS, empty, require_one_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PRECISIONS = ("ieee", "tf32x3", "tf32")
MXFP8_BLOCK = 32
MAX_EXPERTS = 1024  # the counting kernel holds one E-wide row of counts in registers
# the kernel op (passes/ops.py) that runs the four launches, and the name of the main one among them
KERNEL_NAME = "mega_moe_kernel"
KERNEL_NAMES = ("_count_kernel", KERNEL_NAME, "_down_kernel", "_combine_kernel")


@dataclass(frozen=True)
class MoeSpec:
    """Everything the generator specialises on: shapes, dtypes and scalars of the math.
    weight_dtype picks the form: bfloat16 is `_grouped` (bf16 GEMMs, rounded outputs), float32 is
    `_gathered` (fp32 throughout). `mxfp8`: the activation goes through MXFP8 before the down GEMM.
    weight_at, weighted_dtype, swiglu_dtype: where the slot weight applies and the SwiGLU's roundings
    (module doc)."""
    n_experts: int
    k: int
    hidden: int  # D
    expert_dim: int  # F
    weight_dtype: str
    input_dtype: str
    swiglu_limit: float
    mxfp8: bool
    out_dtype: str
    precision: str = "tf32x3"
    weight_at: str = "before"  # "before": act * w enters w2 (the model); "after": w2's output * w (HF)
    weighted_dtype: str = "float32"  # weight_at="after": the dtype the product down * w is rounded to
    swiglu_dtype: str = "float32"  # "bfloat16": each SwiGLU op's result rounded (HF's _apply_gate on bf16)

    @functools.cache
    def key(self) -> str:
        """Short stable hash of the spec and of the generator (file names, memo keys)."""
        fields = dataclasses.asdict(self) | {"swiglu_limit": float(self.swiglu_limit).hex()}
        return hashlib.sha1((json.dumps(fields, sort_keys=True) + _GENERATOR_FINGERPRINT).encode()).hexdigest()[:12]

    def describe(self) -> dict:
        return dataclasses.asdict(self) | {"key": self.key(), "unsupported": unsupported_reason(self)}


def unsupported_reason(spec: MoeSpec) -> str | None:
    """None if the generator handles `spec`, else a sentence saying why not (for the pass report)."""
    for what, dtype in (("weight", spec.weight_dtype), ("input", spec.input_dtype), ("output", spec.out_dtype)):
        if dtype not in DTYPES:
            return f"{what} dtype {dtype!r} is not supported (float32 or bfloat16 only)"
    if spec.precision not in PRECISIONS:
        return f"GEMM precision {spec.precision!r} is not one of {', '.join(PRECISIONS)}"
    if not 1 <= spec.n_experts <= MAX_EXPERTS:
        return f"{spec.n_experts} experts is outside 1..{MAX_EXPERTS} (the counts of all experts sit in registers)"
    if not 1 <= spec.k <= spec.n_experts:
        return f"top-{spec.k} of {spec.n_experts} experts is not a valid routing"
    if spec.hidden < 1 or spec.expert_dim < 1:
        return f"hidden {spec.hidden} and expert width {spec.expert_dim} must be positive"
    if spec.mxfp8 and spec.expert_dim % MXFP8_BLOCK:
        return f"MXFP8 blocks of {MXFP8_BLOCK} must tile the expert width {spec.expert_dim}"
    if not 0.0 < spec.swiglu_limit < float("inf"):
        return f"SwiGLU limit {spec.swiglu_limit!r} must be a positive finite number"
    if spec.weight_at not in ("before", "after"):
        return f"weight_at {spec.weight_at!r} is neither 'before' nor 'after' the down projection"
    if spec.weighted_dtype not in DTYPES or spec.swiglu_dtype not in DTYPES:
        return f"rounding dtypes {spec.weighted_dtype!r} / {spec.swiglu_dtype!r} are not float32 or bfloat16"
    if spec.weight_at == "before" and spec.weighted_dtype != "float32":
        return "weighted_dtype rounds the product down * w, which only weight_at='after' has"
    if spec.swiglu_dtype == "bfloat16" and spec.weight_dtype != "bfloat16":
        return "a bf16 SwiGLU reads a bf16 GEMM output: it needs bf16 weights"
    if spec.swiglu_dtype == "bfloat16" and spec.mxfp8:
        return "MXFP8 of a SwiGLU computed in bf16 is not a form the kernel reproduces (no client writes it)"
    if spec.weight_at == "after" and spec.weighted_dtype == "bfloat16" and spec.weight_dtype != "bfloat16":
        return "a bf16 product down * w needs the bf16 down projection"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# The generated module
# ----------------------------------------------------------------------------------------------

_TEMPLATE = string.Template('''"""Mega-MoE kernels for spec $KEY, generated by megafuse.lowering.mega_moe. Do not edit.

spec: $SPEC_LINE
"""
import triton
import triton.language as tl

N_EXPERTS = tl.constexpr($E)
E_PAD = tl.constexpr($E_PAD)
TOP_K = tl.constexpr($K)
HIDDEN = tl.constexpr($D)
FF = tl.constexpr($F)  # expert width F: w13 holds w1 in rows [0, F), w3 in rows [F, 2F)
LIMIT = tl.constexpr($LIMIT)

$COMBINERS

$ROUND_16BIT

$MXFP8


@triton.jit
def _dot(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b^T (b holds rows of an [out, in] weight)."""
$DOT_BODY


@triton.jit
def _count_kernel(ids_ptr, offsets_ptr, row_of_slot_ptr, slot_of_row_ptr, tile_expert_ptr, tile_row_ptr,
                  n_tiles_ptr, S, MAX_TILES, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr):
    """Counting sort of the S slots by expert, and the GEMMs' tile table (one program)."""
    experts = tl.arange(0, E_PAD)
    counts = tl.full([E_PAD], 0, dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(ids_ptr + slots, mask=slots < S, other=-1)
        counts += tl.reduce((ids[:, None] == experts[None, :]).to(tl.int32), 0, _add)
    ends = tl.associative_scan(counts, 0, _add)
    starts = ends - counts  # each expert's first row in expert order
    tl.store(offsets_ptr + experts, starts, mask=experts < N_EXPERTS)
    tl.store(offsets_ptr + N_EXPERTS + experts * 0, S + experts * 0, mask=experts == 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M  # an expert without rows has no tile
    tile_ends = tl.associative_scan(tiles, 0, _add)
    tile_starts = tile_ends - tiles
    n_tiles = tl.reduce(tiles, 0, _add)
    tl.store(n_tiles_ptr + experts * 0, n_tiles + experts * 0, mask=experts == 0)
    # each slot's row: its expert's first row + the slots of that expert before it (stable)
    taken = starts
    for s0 in range(0, S, BLOCK_S):
        slots = s0 + tl.arange(0, BLOCK_S)
        ok = slots < S
        ids = tl.load(ids_ptr + slots, mask=ok, other=-1)
        hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.associative_scan(hot, 0, _add) - hot  # earlier slots of the chunk, per expert
        row = tl.reduce(hot * (before + taken[None, :]), 1, _add)
        tl.store(row_of_slot_ptr + slots, row, mask=ok)
        tl.store(slot_of_row_ptr + row, slots, mask=ok)
        taken += tl.reduce(hot, 0, _add)
    # the tile table: tile t belongs to the expert whose tile range holds t
    for t0 in range(0, MAX_TILES, BLOCK_S):
        t = t0 + tl.arange(0, BLOCK_S)
        mine = (tile_starts[None, :] <= t[:, None]) & (t[:, None] < tile_ends[None, :])
        expert = tl.reduce(tl.where(mine, experts[None, :], 0), 1, _add)
        first = tl.reduce(tl.where(mine, starts[None, :] + (t[:, None] - tile_starts[None, :]) * BLOCK_M, 0), 1, _add)
        tl.store(tile_expert_ptr + t, expert, mask=t < n_tiles)
        tl.store(tile_row_ptr + t, first, mask=t < n_tiles)


@triton.jit
def mega_moe_kernel(u_ptr, w13_ptr, slot_w_ptr, slot_of_row_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                    n_tiles_ptr, act_ptr, stride_u, stride_we, stride_wr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """act rows of one expert tile, BLOCK_N columns of F: both GEMMs of w13, then the epilogue."""
    tile = tl.program_id(0)
    if tile < tl.load(n_tiles_ptr):
        expert = tl.load(tile_expert_ptr + tile)
        rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(offsets_ptr + expert + 1)  # the tile's rows stop at the expert's last
        slots = tl.load(slot_of_row_ptr + rows, mask=row_ok, other=0)
        tokens = slots // TOP_K
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < FF
        u_ptrs = u_ptr + tokens[:, None].to(tl.int64) * stride_u + tl.arange(0, BLOCK_K)[None, :]
        w_ptrs = w13_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wr + tl.arange(0, BLOCK_K)[None, :]
        g = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        v = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        for d0 in range(0, HIDDEN, BLOCK_K):
            d_ok = (d0 + tl.arange(0, BLOCK_K)) < HIDDEN
            x = tl.load(u_ptrs + d0, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
$TOKEN_LINES
            w1 = tl.load(w_ptrs + d0, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            w3 = tl.load(w_ptrs + FF * stride_wr + d0, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            g = _dot(x, w1, g, INTERPRETED)
            v = _dot(x, w3, v, INTERPRETED)
$GATE_UP_LINES
$SWIGLU_LINES
$WEIGHT_BEFORE_LINES
$ACT_LINES
        out = act_ptr + rows[:, None].to(tl.int64) * FF + cols[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, slot_w_ptr, slot_of_row_ptr, offsets_ptr, tile_expert_ptr, tile_row_ptr,
                 n_tiles_ptr, down_ptr, stride_we, stride_wr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """down rows of one expert tile, BLOCK_N columns of D, in expert order (fp32); weight_at="after":
    times each row's slot weight in the epilogue."""
    tile = tl.program_id(0)
    if tile < tl.load(n_tiles_ptr):
        expert = tl.load(tile_expert_ptr + tile)
        rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(offsets_ptr + expert + 1)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < HIDDEN
        a_ptrs = act_ptr + rows[:, None].to(tl.int64) * FF + tl.arange(0, BLOCK_K)[None, :]
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + cols[:, None] * stride_wr + tl.arange(0, BLOCK_K)[None, :]
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
        for f0 in range(0, FF, BLOCK_K):
            f_ok = (f0 + tl.arange(0, BLOCK_K)) < FF
            a = tl.load(a_ptrs + f0, mask=row_ok[:, None] & f_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + f0, mask=col_ok[:, None] & f_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, INTERPRETED)
$DOWN_LINES
$WEIGHT_AFTER_LINES
        out = down_ptr + rows[:, None].to(tl.int64) * HIDDEN + cols[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(down_ptr, row_of_slot_ptr, out_ptr, N, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = the sum of token n's k slot rows, in slot order, rounded to out_dtype."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < N
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = token_ok[:, None] & (cols < HIDDEN)[None, :]
    total = tl.full([BLOCK_T, BLOCK_N], 0.0, dtype=tl.float32)
    for j in range(TOP_K):
        row = tl.load(row_of_slot_ptr + tokens * TOP_K + j, mask=token_ok, other=0)
        total += tl.load(down_ptr + row[:, None].to(tl.int64) * HIDDEN + cols[None, :], mask=ok, other=0.0)
$OUT_LINES
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * HIDDEN + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=ok)
''')

_DOT_16BIT = '''\
    if INTERPRETED:  # numpy cannot dot bf16; bf16 products are exact in fp32
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(b), acc)  # bf16 on tensor cores, fp32 accumulate'''

# Any edit of this module or of the shared snippets changes every spec's key.
_GENERATOR_FINGERPRINT = hashlib.sha1(Path(__file__).read_bytes() + snippets.SOURCE).hexdigest()


def generate_source(spec: MoeSpec) -> str:
    """The Triton module of `spec` (raises ValueError for an unsupported spec)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_moe cannot generate this spec: {reason}")
    grouped = spec.weight_dtype == "bfloat16"
    token_lines = gate_up_lines = act_lines = down_lines = out_lines = before_lines = after_lines = ""
    if spec.swiglu_dtype == "bfloat16":  # HF's _apply_gate on bf16: each op's result rounded
        swiglu_lines = ("        g = _round_bfloat16(tl.minimum(g, LIMIT))\n"
                        "        act = _round_bfloat16(_round_bfloat16(g / (1.0 + tl.exp(-g)))\n"
                        "                              * _round_bfloat16(tl.minimum(tl.maximum(v, -LIMIT), LIMIT)))")
    else:
        swiglu_lines = ("        g = tl.minimum(g, LIMIT)\n"
                        "        act = g / (1.0 + tl.exp(-g)) * tl.minimum(tl.maximum(v, -LIMIT), LIMIT)  # clamped SwiGLU")
    if spec.weight_at == "before":
        before_lines = ("        act = act * tl.load(slot_w_ptr + slots, mask=row_ok, other=0.0)[:, None]"
                        "  # the weight enters before w2")
    else:
        after_lines = ("        slots = tl.load(slot_of_row_ptr + rows, mask=row_ok, other=0)\n"
                       "        acc = acc * tl.load(slot_w_ptr + slots, mask=row_ok, other=0.0)[:, None]"
                       "  # the weight after w2, in its epilogue")
        if spec.weighted_dtype == "bfloat16":
            after_lines += "\n        acc = _round_bfloat16(acc)  # the chain's bf16 product down * w"
    if grouped:
        dot_body = _DOT_16BIT
        if spec.input_dtype == "float32":  # the dispatch's u.to(bf16)
            token_lines = "            x = _round_bfloat16(x).to(tl.bfloat16)  # the chain's tokens.to(bfloat16)"
        gate_up_lines = ("        g = _round_bfloat16(g)  # _grouped_mm writes gate_up in bf16\n"
                         "        v = _round_bfloat16(v)")
        down_lines = "        acc = _round_bfloat16(acc)  # _grouped_mm writes down in bf16"
    else:
        dot_body = f'    return tl.dot(a.to(tl.float32), tl.trans(b), acc, input_precision="{spec.precision}")'
    if spec.mxfp8:
        act_lines = "        act = _mxfp8(act, BLOCK_M, BLOCK_N)  # quant=\"ref\": the down GEMM reads MXFP8"
    if grouped:  # the cast before the down GEMM, in registers: the interpreter's cast truncates
        act_lines += "\n        act = _round_bfloat16(act)"
    if spec.out_dtype == "bfloat16":
        out_lines = "    total = _round_bfloat16(total)  # sum_slots(..., bfloat16)"
    spec_line = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(spec).items())
    return _TEMPLATE.substitute(
        KEY=spec.key(), SPEC_LINE=spec_line, E=spec.n_experts, E_PAD=_next_pow2(spec.n_experts), K=spec.k,
        D=spec.hidden, F=spec.expert_dim, LIMIT=repr(float(spec.swiglu_limit)), COMBINERS=snippets.COMBINERS,
        ROUND_16BIT=snippets.ROUND_16BIT, MXFP8=snippets.MXFP8, DOT_BODY=dot_body, TOKEN_LINES=token_lines,
        GATE_UP_LINES=gate_up_lines, ACT_LINES=act_lines, DOWN_LINES=down_lines, OUT_LINES=out_lines,
        SWIGLU_LINES=swiglu_lines, WEIGHT_BEFORE_LINES=before_lines, WEIGHT_AFTER_LINES=after_lines)


def kernel_name(spec: MoeSpec) -> str:
    """The cache file stem: content-addressed by the spec and the generator."""
    return f"mega_moe_{spec.key()}"


def source_path(spec: MoeSpec):
    """Write (if needed) and return the cached source file of `spec`."""
    return kernel_cache.write_source(kernel_name(spec), generate_source(spec))


def load(spec: MoeSpec, interpret: bool, attr: str):
    """The jitted kernel `attr` (one of KERNEL_NAMES) of `spec`'s module for one mode."""
    return kernel_cache.load_generated(kernel_name(spec), lambda: generate_source(spec), attr, interpret)


# ----------------------------------------------------------------------------------------------
# Launch configuration, launcher and reference
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchConfig:
    """Rows of one expert per GEMM tile (BLOCK_M), output columns per program (BLOCK_N, a multiple of
    32 for MXFP8), the K step (BLOCK_K), slots per counting chunk and tokens per combine program."""
    block_m: int
    block_n: int
    block_k: int
    block_s: int = 64
    block_t: int = 16
    num_warps: int = 4
    num_stages: int = 3


def choose_config(spec: MoeSpec, n_tokens: int, *, device: torch.device | str = "cuda") -> LaunchConfig:
    """The launch for `n_tokens` tokens (the same tiles at every count for now; the signature is
    every op's, so tools size any op's launch alike).
    Hopper: 64-row tiles (wgmma's M), 64 columns (two accumulators in gate_up), K steps of 64, 8 warps;
    fp32 weights take K steps of 32 (tf32x3 splits each operand tile in two: with 64 the gate-up
    kernel spills, `megafuse inspect` shows it).
    The interpreter runs programs one after the other, each op at about the same cost whatever its
    size: tl.dot's minimum of 16 rows, and columns covering as much of F and D as fits."""
    if torch.device(device).type == "cuda":
        block_k = 32 if spec.weight_dtype == "float32" else 64
        return LaunchConfig(block_m=64, block_n=64, block_k=block_k, block_s=256, block_t=32, num_warps=8)
    return LaunchConfig(block_m=16, block_n=max(32, min(128, _next_pow2(max(spec.expert_dim, spec.hidden)))),
                        block_k=max(16, min(128, _next_pow2(spec.hidden))), block_s=64, block_t=16)


def validate(u, weights, ids, w13, w2, spec: MoeSpec) -> None:
    """Raise ValueError if the launcher must refuse these inputs; shapes, dtypes and devices only
    (a pass runs it on a match's fake tensors: an unfused chain, never a run-time error)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_moe: unsupported spec: {reason}")
    E, k, D, F = spec.n_experts, spec.k, spec.hidden, spec.expert_dim
    if u.dim() != 2 or u.shape[1] != D or u.dtype != DTYPES[spec.input_dtype]:
        raise ValueError(f"mega_moe: u must be {spec.input_dtype} [N, {D}], got {u.dtype} {list(u.shape)}")
    N = u.shape[0]
    if tuple(weights.shape) != (N, k) or weights.dtype != torch.float32:
        raise ValueError(f"mega_moe: weights must be float32 [{N}, {k}], got {weights.dtype} {list(weights.shape)}")
    if tuple(ids.shape) != (N, k) or ids.dtype != torch.int64:
        raise ValueError(f"mega_moe: ids must be int64 [{N}, {k}], got {ids.dtype} {list(ids.shape)}")
    for name, t, shape in (("w13", w13, (E, 2 * F, D)), ("w2", w2, (E, D, F))):
        if tuple(t.shape) != shape or t.dtype != DTYPES[spec.weight_dtype]:
            raise ValueError(f"mega_moe: {name} must be {spec.weight_dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    require_one_device("mega_moe", u, weights, ids, w13, w2)


def mega_moe(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             spec: MoeSpec, config: LaunchConfig | None = None) -> torch.Tensor:
    """out [N, D] in out_dtype: the routed experts' sum for N tokens (module doc), in four launches."""
    validate(u, weights, ids, w13, w2, spec)
    N, device = u.shape[0], u.device
    out = empty((N, spec.hidden), DTYPES[spec.out_dtype], device)
    if N == 0:
        return out
    cfg = config or choose_config(spec, N, device=device)
    if spec.mxfp8 and cfg.block_n % MXFP8_BLOCK:
        raise ValueError(f"mega_moe: BLOCK_N {cfg.block_n} must be a multiple of {MXFP8_BLOCK} for MXFP8")
    u = u if u.stride(1) == 1 else u.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    weights, ids = weights.reshape(-1).contiguous(), ids.reshape(-1).contiguous()
    S, E, F, D = N * spec.k, spec.n_experts, spec.expert_dim, spec.hidden
    max_tiles = -(-S // cfg.block_m) + min(E, S)  # sum over experts of ceil(rows / BLOCK_M)
    index = torch.int32
    offsets, row_of_slot, slot_of_row = empty((E + 1,), index, device), empty((S,), index, device), empty((S,), index, device)
    tile_expert, tile_row, n_tiles = empty((max_tiles,), index, device), empty((max_tiles,), index, device), empty((1,), index, device)
    act = empty((S, F), torch.bfloat16 if spec.weight_dtype == "bfloat16" else torch.float32, device)
    down = empty((S, D), torch.float32, device)
    interpret = device.type != "cuda"
    options = dict(num_warps=cfg.num_warps, **COMPILE_OPTIONS)
    gemm = dict(BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, INTERPRETED=interpret, num_stages=cfg.num_stages, **options)
    count, gate_up, down_proj, combine = (load(spec, interpret, name) for name in KERNEL_NAMES)
    with contextlib.nullcontext() if interpret else torch.cuda.device(device):
        count[(1,)](ids, offsets, row_of_slot, slot_of_row, tile_expert, tile_row, n_tiles, S, max_tiles,
                    BLOCK_S=cfg.block_s, BLOCK_M=cfg.block_m, **options)
        gate_up[(max_tiles, -(-F // cfg.block_n))](
            u, w13, weights, slot_of_row, offsets, tile_expert, tile_row, n_tiles, act, u.stride(0),
            w13.stride(0), w13.stride(1), BLOCK_N=cfg.block_n, **gemm)
        down_proj[(max_tiles, -(-D // cfg.block_n))](
            act, w2, weights, slot_of_row, offsets, tile_expert, tile_row, n_tiles, down, w2.stride(0), w2.stride(1),
            BLOCK_N=cfg.block_n, **gemm)
        combine[(-(-N // cfg.block_t), -(-D // cfg.block_n))](
            down, row_of_slot, out, N, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, **options)
    return out


def reference(u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              spec: MoeSpec) -> torch.Tensor:
    """The fused op in plain torch: the model's own `Experts` dispatch (after its input rounding,
    which stays outside the chain) and `sum_slots`; `_reference_plain` for the specs the model does
    not write (the weight after the down projection, a bf16 SwiGLU)."""
    if spec.weight_at != "before" or spec.swiglu_dtype != "float32":
        return _reference_plain(u, weights, ids, w13, w2, spec)
    experts = Experts.holding(w13, w2, spec.swiglu_limit, mxfp8_inputs=spec.mxfp8)
    form = experts._grouped if w13.dtype == torch.bfloat16 else experts._gathered
    out = form(u, weights.reshape(-1), ids.reshape(-1), spec.k)
    return sum_slots(out, ids.shape, DTYPES[spec.out_dtype])


def _reference_plain(u, weights, ids, w13, w2, spec: MoeSpec) -> torch.Tensor:
    """Every slot through its expert, gathered per slot, with the chain's rounding points spelled out:
    each GEMM is an fp32 dot of its operands (bf16 products are exact in fp32) rounded to the
    weights' dtype, as `_grouped_mm` / bmm write their output."""
    N, k, F = u.shape[0], spec.k, spec.expert_dim
    wd, w = w13.dtype, weights.reshape(-1, 1).float()
    slot_ids = ids.reshape(-1)

    def gemm(weight, x):  # [S, out, in] @ [S, in] -> [S, out], rounded to the weights' dtype
        return torch.bmm(weight.float(), x.to(wd).float()[..., None]).squeeze(-1).to(wd).float()

    def r(t):  # swiglu_dtype="bfloat16": this op's result rounded
        return t.to(torch.bfloat16).float() if spec.swiglu_dtype == "bfloat16" else t

    g, v = gemm(w13[slot_ids], u.repeat_interleave(k, dim=0)).split(F, dim=-1)
    g = r(g.clamp(max=spec.swiglu_limit))
    act = r(r(g / (1.0 + torch.exp(-g))) * r(v.clamp(-spec.swiglu_limit, spec.swiglu_limit)))
    if spec.weight_at == "before":
        act = act * w
    if spec.mxfp8:
        act = fake_quant_mxfp8(act)
    down = gemm(w2[slot_ids], act)
    if spec.weight_at == "after":
        down = (down * w).to(DTYPES[spec.weighted_dtype]).float()
    return down.view(N, k, -1).sum(dim=1).to(DTYPES[spec.out_dtype])
