"""Mega-Gate: the MoE router chain in one generated Triton launch.

    logits = u @ W^T                 [T, E], fp32 accumulate (rounded to logits_dtype)
    score  = score_func(logits)      sqrtsoftplus | sigmoid | softmax (over the E real experts),
                                     each op's result rounded to score_dtype
    choice = score (+ bias)          the bias steers the selection only (rounded to choice_dtype)
    ids    = top-k of choice         descending; ties resolve to the lowest expert index
    w      = score[ids] (/ (sum + eps)) (* scale)

The pass in `passes/` binds a `GateSpec` from a match, asks `unsupported_reason(spec)`, and calls
`mega_gate(u, weight, bias, spec)`; `reference` is the same maths as plain torch (it calls
`model.moe.route`, so the formula exists once). `generate_source(spec)` renders the kernel from the
template below, specialised for the spec (constants, scoring code, bias, renorm, scale, dtypes);
the launcher writes it to the kernel cache (`kernel_cache.py`) and loads it for the tensors'
device: compiled Triton for CUDA tensors, the Triton interpreter for CPU tensors, same source.

Kernel design (H200; docs/mega_gate.md, "The kernel")
---------------------------------------------
One launch, a 1-D grid of *jobs*:

* GEMM jobs, one per (token tile of BLOCK_T, expert chunk of BLOCK_E, slice of D_PER_SPLIT columns
  of D): a [BLOCK_T, BLOCK_E] tile of logits over its D slice with `tl.dot`, added into an fp32
  workspace [T, E_PAD] with fp32 atomics (`split` variant) or stored plainly when one job covers
  all of D (`tiled` variant); then a release increment of its token tile's arrival counter.
* Epilogue jobs, one per EPI_ROWS tokens: spin (acquire) until every GEMM job of the token tile has
  arrived, then score, add the bias, select k by k rounds of arg-max over a packed (choice, lowest
  index) int64 key, gather the unbiased scores, renormalise, scale, store, and re-zero the
  workspace rows consumed. The last epilogue job re-zeroes the counters: every launch leaves the
  sync state as it found it, so no memset launch is needed.

Why split D: W is E*D*4 = 7.9 MB at E=384, D=5120. One program per token tile would stream all of
it through one SM; cutting D (and E) into slices gives every SM a share of W at small T and,
at large T, a GEMM tile shape that fills the GPU (a [128, 64] tile over half of D beat a [64, 64]
tile over all of D by 10% at T=4096). The partial sums meet in the workspace through atomics
(T*E*4 bytes per slice).

Why epilogue jobs rather than "the last GEMM job of a tile selects": selection costs ~8*E*k
instructions per token and is compute-bound inside one CTA; measured, the last-arriver scheme was
1.3x slower at T=1 and 3x at T=64. Separate jobs spread selection over the whole GPU.

Launch configurations per T band: `choose_config` (tuned with `tools/bench_gate.py --sweep`).

Forward progress: an epilogue job spins on GEMM jobs. When the grid may exceed the SM count, jobs
are numbered by an atomic counter taken at program start, GEMM jobs first, so once any program
holds an epilogue job every GEMM job belongs to a *running* program that waits on nothing: no
deadlock, whatever the dispatch order or occupancy (the argument of decoupled look-back scans).
A grid no larger than the SM count is resident all at once (any launchable kernel fits one CTA
per SM), so there the program id is the job number and the claim atomic is skipped.

Numerics: fp32 x fp32 runs `tl.dot(input_precision=spec.precision)` ("tf32x3" by default: fp32-level
accuracy on tensor cores; "ieee" exact fp32 FMA; "tf32" only by explicit choice); bf16 x bf16 and
fp16 x fp16 are a 16-bit dot with fp32 accumulate; mixed dtypes upcast to fp32 (exactly). Everything
after the GEMM runs in fp32, rounded where a chain written in a 16-bit dtype rounds: the logits
to `logits_dtype` (the GEMM's output), each scoring op's result to `score_dtype` (torch computes a
bf16 sigmoid in fp32 and rounds its result once; a bf16 sqrt(softplus) rounds twice), the biased
choice to `choice_dtype`. Rounding the same fp32 values the same way selects the same experts
as the chain; renormalisation and scale stay fp32 (the pass casts the weights to the chain's
dtype at the end). With D in more than 2 slices the fp32
atomic sums arrive in a run-dependent order, so logits may differ in the last bit between runs
(two slices commute exactly: 0 + a + b == 0 + b + a). Ties in the *computed* choice always resolve
to the lowest expert index.

Sync state and CUDA graphs: per device, a persistent int32 sync buffer (job counter, epilogue
counter, one arrival counter per token tile) and a persistent fp32 workspace (T*E_PAD floats at
the largest T seen), both all-zero between launches (the kernel restores that itself). They are
allocated on the first call on a device, and grow eagerly when T does; call `reserve_workspace`
or run once eagerly at the largest T before capturing a CUDA graph (an allocation during capture
raises). Outgrown buffers are kept alive, since a captured graph may still use them. A captured
launch is replay-safe. Launches on two streams of one device must not run concurrently (they share
the sync state); stream-ordered use, as Inductor emits, is fine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import string
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import triton.language  # noqa: F401  (import Triton before any kernel module: see kernel_cache)

from megafuse.model.moe import route

from . import kernel_cache, snippets
from .launch import COMPILE_OPTIONS, PreparedLaunches, device_key, empty, layout_key

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TL_DTYPES = {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}
PRECISIONS = ("ieee", "tf32x3", "tf32")
MAX_K = 16
MAX_EXPERTS = 1024
KERNEL_NAME = "mega_gate_kernel"


# ----------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GateSpec:
    """Everything the generator specialises on. `renorm_eps=0.0` renormalises without an eps;
    `scale=1.0` is "no scale"; `renorm_eps` is ignored when `renorm` is False."""
    n_experts: int
    hidden: int
    k: int
    score_func: str
    has_bias: bool
    renorm: bool
    renorm_eps: float
    scale: float
    input_dtype: str
    weight_dtype: str
    precision: str = "tf32x3"
    # Where the chain rounds (see Numerics): the kernel must round the same way to select the same
    # experts. logits_dtype: what the chain's GEMM wrote its logits in (a bf16 GEMM rounds them);
    # score_dtype: what each scoring op rounds its result to; choice_dtype: what score + bias (or
    # the score alone) is rounded to before the top-k; bias_dtype: the bias tensor's dtype.
    logits_dtype: str = "float32"
    bias_dtype: str = "float32"
    score_dtype: str = "float32"
    choice_dtype: str = "float32"

    @functools.cache  # the launch path asks for it on every call: hash the JSON once per spec
    def key(self) -> str:
        """Short stable hash of the spec and of the generator's template (file names, memo keys)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("renorm_eps", "scale"):
            fields[name] = float(fields[name]).hex()  # exact, platform-independent float text
        text = json.dumps(fields, sort_keys=True) + _GENERATOR_FINGERPRINT
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def describe(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(key=self.key(), e_pad=_next_pow2(self.n_experts), k_pad=_next_pow2(self.k),
                 dot=self._dot_kind(), unsupported=unsupported_reason(self))
        return d

    def _dot_kind(self) -> str:
        if _half_dot(self):
            return f"{self.input_dtype} x {self.weight_dtype} -> fp32 accumulate"
        return f"fp32 x fp32 ({self.precision}) -> fp32 accumulate"


def _half_dot(spec: GateSpec) -> bool:
    """Both GEMM operands in one 16-bit dtype: a 16-bit dot (products exact in fp32)."""
    return spec.input_dtype == spec.weight_dtype and spec.input_dtype in _TL_DTYPES


def unsupported_reason(spec: GateSpec) -> str | None:
    """None if the generator handles `spec`, else a sentence saying why not (for the pass report)."""
    if spec.score_func not in SCORE_FUNCS:
        return f"score function {spec.score_func!r} is not one of {', '.join(SCORE_FUNCS)}"
    for what, dtype in (("input", spec.input_dtype), ("weight", spec.weight_dtype), ("logits", spec.logits_dtype),
                        ("bias", spec.bias_dtype), ("score", spec.score_dtype), ("choice", spec.choice_dtype)):
        if dtype not in DTYPES:
            return f"{what} dtype {dtype!r} is not supported (float32, bfloat16 or float16 only)"
    if spec.precision not in PRECISIONS:
        return f"GEMM precision {spec.precision!r} is not one of {', '.join(PRECISIONS)}"
    if not 1 <= spec.n_experts <= MAX_EXPERTS:
        return f"{spec.n_experts} experts is outside 1..{MAX_EXPERTS} (one expert row must fit in registers)"
    if spec.hidden < 1:
        return f"hidden size {spec.hidden} must be positive"
    if not 1 <= spec.k <= spec.n_experts:
        return f"top-k of {spec.k} out of {spec.n_experts} experts is not a valid selection"
    if spec.k > MAX_K:
        return f"top-k of {spec.k} > {MAX_K}: k rounds of arg-max in registers only pay for small k"
    if spec.renorm and not (spec.renorm_eps >= 0.0 and spec.renorm_eps != float("inf")):
        return f"renormalisation eps {spec.renorm_eps!r} must be a finite number >= 0"
    if not (abs(spec.scale) < float("inf")):
        return f"route scale {spec.scale!r} must be finite"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ----------------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------------

# The kernel template. `$NAME` placeholders are filled by `generate_source`; everything else is
# literal Triton. Read a generated file (kernel cache) to see one specialisation in full.
_TEMPLATE = string.Template('''\
"""Mega-Gate kernel for spec $KEY, generated by megafuse.lowering.mega_gate. Do not edit.

spec: $SPEC_LINE

For each token t of u [T, $D]:
    logits = u[t] @ W^T             $DOT_DOC
    score  = $SCORE_DOC
    choice = $CHOICE_DOC
    ids    = the $K largest choices, descending; ties -> the lowest expert index
    w      = $WEIGHT_DOC

Jobs (one 1-D grid, claimed in start order through sync[0]; see mega_gate_kernel):
    GEMM jobs      (token tile, expert chunk, D slice) -> partial logits into the fp32 workspace
    epilogue jobs  EPI_ROWS tokens: wait for their token tile, then score, select, store
"""
import triton
import triton.language as tl

N_EXPERTS = tl.constexpr($E)   # real experts
E_PAD = tl.constexpr($E_PAD)   # power of two >= N_EXPERTS: the workspace row and epilogue width
HIDDEN = tl.constexpr($D)
TOP_K = tl.constexpr($K)
K_PAD = tl.constexpr($K_PAD)   # power of two >= TOP_K: the output tile width
KEY_MIN = tl.constexpr(-(2 ** 63))  # below every real selection key (padding, already chosen)

# sync buffer layout (int32, all zero between launches; the kernel restores that itself)
JOB_COUNTER = tl.constexpr(0)    # next job number
EPI_COUNTER = tl.constexpr(1)    # finished epilogue jobs
TILE_ARRIVALS = tl.constexpr(2)  # [n_t_tiles] GEMM jobs arrived per token tile

$COMBINERS

$ROUND_16BIT

@triton.jit
def _round_score(x):
    """A scoring op's fp32 result, rounded as the chain rounds it (spec score_dtype)."""
    return $ROUND_SCORE


@triton.jit
def _score(logits$SCORE_ARGS):
    """$SCORE_DOC, elementwise on fp32 logits."""
$SCORE_BODY


@triton.jit
def _gemm_job(u_ptr, w_ptr, ws_ptr, sync_ptr, T, stride_u, stride_w, t_tile, e_chunk, d_split,
              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
              D_PER_SPLIT: tl.constexpr, N_D_SPLITS: tl.constexpr, MASK_D: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """Partial logits of BLOCK_T tokens x BLOCK_E experts over D[d_split*D_PER_SPLIT :+ D_PER_SPLIT]."""
    rows = t_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = e_chunk * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < T            # tokens past T read zeros and are never written
    expert_ok = experts < N_EXPERTS  # so do padding experts
    d_offs = d_split * D_PER_SPLIT + tl.arange(0, BLOCK_D)
    u_ptrs = u_ptr + rows[:, None].to(tl.int64) * stride_u + d_offs[None, :]
    w_ptrs = w_ptr + experts[:, None].to(tl.int64) * stride_w + d_offs[None, :]
    acc = tl.full([BLOCK_T, BLOCK_E], 0.0, dtype=tl.float32)
    # K loop over this job's D slice; both operands are K-contiguous rows ([T, D] and [E, D])
    for d0 in range(0, D_PER_SPLIT, BLOCK_D):
        if MASK_D:  # only when D is not a multiple of the slice: the last slice runs past D
            d_ok = (d_offs + d0) < HIDDEN
            a = tl.load(u_ptrs + d0, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            b = tl.load(w_ptrs + d0, mask=expert_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            a = tl.load(u_ptrs + d0, mask=row_ok[:, None], other=0.0)
            b = tl.load(w_ptrs + d0, mask=expert_ok[:, None], other=0.0)
$DOT_LINES
    ws_tile = ws_ptr + rows[:, None] * E_PAD + experts[None, :]
    tile_ok = row_ok[:, None] & expert_ok[None, :]
    if N_D_SPLITS > 1:
        # D is split: slices meet here. Relaxed is enough: the release below publishes them.
        tl.atomic_add(ws_tile, acc, mask=tile_ok, sem="relaxed")
    else:
        tl.store(ws_tile, acc, mask=tile_ok)
    # Every thread's writes must precede the arrival: CTA barrier, then one release at GPU scope
    # (release is cumulative over what the barrier ordered before it).
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + TILE_ARRIVALS + t_tile, 1, sem="release")


@triton.jit
def _epilogue_job(bias_ptr, out_w_ptr, out_id_ptr, ws_ptr, sync_ptr, T, epi,
                  BLOCK_T: tl.constexpr, EPI_ROWS: tl.constexpr, JOBS_PER_TILE: tl.constexpr,
                  N_D_SPLITS: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Selection for tokens [epi*EPI_ROWS, +EPI_ROWS) once their token tile's logits are complete."""
    row0 = epi * EPI_ROWS
    t_tile = row0 // BLOCK_T
    # Wait (acquire) for every GEMM job of this token tile. They were all claimed before this job
    # (job numbers are handed out in start order, GEMM jobs first), so they are running: no deadlock.
    # MAX_SPINS only guards against a corrupted sync state (an aborted launch): it ends in NaN
    # weights and -1 ids, never in a hang or a plausible wrong answer.
    arrived = tl.atomic_add(sync_ptr + TILE_ARRIVALS + t_tile, 0, sem="acquire")
    spins = 0
    while (arrived < JOBS_PER_TILE) & (spins < MAX_SPINS):
        arrived = tl.atomic_add(sync_ptr + TILE_ARRIVALS + t_tile, 0, sem="acquire")
        spins += 1
    timed_out = arrived < JOBS_PER_TILE
    _select_rows(bias_ptr, out_w_ptr, out_id_ptr, ws_ptr, T, row0, timed_out, EPI_ROWS, N_D_SPLITS)


@triton.jit
def _select_rows(bias_ptr, out_w_ptr, out_id_ptr, ws_ptr, T, row0, failed,
                 EPI_ROWS: tl.constexpr, N_D_SPLITS: tl.constexpr):
    """Score, select, gather, renormalise, scale and store tokens [row0, row0 + EPI_ROWS)."""
    rows = row0 + tl.arange(0, EPI_ROWS)
    row_ok = rows < T
    cols = tl.arange(0, E_PAD)
    col_ok = cols < N_EXPERTS
    ws_rows = ws_ptr + rows[:, None] * E_PAD
    live = row_ok[:, None] & col_ok[None, :]
    # .cg: read at L2, where the other SMs' atomics and stores landed (never a stale L1 line)
    logits = tl.load(ws_rows + cols[None, :], mask=live, other=0.0, cache_modifier=".cg")
$ROUND_LOGITS$SCORE_LINES
$CHOICE_LINES
    # Selection key: the choice's bits made order-preserving as an int32 (negative floats flip
    # their magnitude bits), in the high word; the expert index reversed, (E_PAD - 1) - expert =
    # expert ^ (E_PAD - 1), in the low word. One int64 max then yields the largest choice and,
    # among equal choices, the LOWEST expert index.
    choice = choice + 0.0  # -0.0 -> +0.0, so equal floats get equal keys
    bits = choice.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) + (cols ^ (E_PAD - 1))[None, :].to(tl.int64)
    key = tl.where(col_ok[None, :], key, KEY_MIN)  # padding experts are never chosen
    # k rounds of arg-max. Keys are unique (they hold the index), so round r's winner is the
    # largest key below round r-1's: no write-back of a mask needed.
    kcols = tl.arange(0, K_PAD)
    best = tl.reduce(key, 1, _maximum)
    ids = tl.where(kcols[None, :] == 0, ((best & (E_PAD - 1)) ^ (E_PAD - 1))[:, None], 0)
    for r in tl.static_range(1, TOP_K):
        best = tl.reduce(tl.where(key < best[:, None], key, KEY_MIN), 1, _maximum)
        ids = tl.where(kcols[None, :] == r, ((best & (E_PAD - 1)) ^ (E_PAD - 1))[:, None], ids)
    # Gather the UNBIASED scores of the chosen experts: reload their logits (k per row, from L2)
    # and rescore them with the same function, instead of k more reductions over the whole row.
    sel_ok = row_ok[:, None] & (kcols[None, :] < TOP_K)
    ids = tl.where(sel_ok, ids, 0)
    sel_logits = tl.load(ws_rows + ids, mask=sel_ok, other=0.0, cache_modifier=".cg")
$ROUND_SEL_LOGITS$GATHER_LINES
    weights = tl.where(sel_ok, weights, 0.0)
$RENORM_LINES$SCALE_LINES
    out_offs = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    if failed:
        weights = tl.full([EPI_ROWS, K_PAD], float("nan"), dtype=tl.float32)
        ids = tl.full([EPI_ROWS, K_PAD], -1, dtype=tl.int64)
    tl.store(out_w_ptr + out_offs, weights, mask=sel_ok)
    tl.store(out_id_ptr + out_offs, ids.to(tl.int64), mask=sel_ok)
    if N_D_SPLITS > 1:
        # Atomics accumulate into the workspace: leave these rows zero for the next launch.
        tl.debug_barrier()  # every thread's reads of these rows come first
        tl.store(ws_rows + cols[None, :], tl.full([EPI_ROWS, E_PAD], 0.0, dtype=tl.float32), mask=live)


@triton.jit(do_not_specialize=["T", "n_t_tiles", "n_epi_jobs"])  # one binary for every T
def mega_gate_kernel(u_ptr, w_ptr, bias_ptr, out_w_ptr, out_id_ptr, ws_ptr, sync_ptr,
                     T, stride_u, stride_w, n_t_tiles, n_epi_jobs,
                     BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                     D_PER_SPLIT: tl.constexpr, N_E_CHUNKS: tl.constexpr, N_D_SPLITS: tl.constexpr,
                     MASK_D: tl.constexpr, EPI_ROWS: tl.constexpr, CLAIM_JOBS: tl.constexpr,
                     INTERPRETED: tl.constexpr, MAX_SPINS: tl.constexpr):
    """Grid (1-D): n_t_tiles * N_E_CHUNKS * N_D_SPLITS GEMM jobs, then n_epi_jobs epilogue jobs.

    CLAIM_JOBS: number jobs by an atomic counter in start order (needed when the grid may not be
    resident all at once). The launcher turns it off when the grid is no larger than the number
    of SMs: then every program gets an SM, nobody can wait on a program that never starts, and
    the program id serves as the job number (one atomic round trip less at tiny T).
    """
    if CLAIM_JOBS:
        job = tl.atomic_add(sync_ptr + JOB_COUNTER, 1, sem="relaxed")
    else:
        job = tl.program_id(0)
    n_gemm_jobs = n_t_tiles * (N_E_CHUNKS * N_D_SPLITS)
    if job < n_gemm_jobs:
        # token-tile-major: a tile's jobs are claimed together, so early tiles complete early and
        # their epilogues overlap later tiles' GEMM; W (E*D) stays resident in L2 meanwhile
        t_tile = job // (N_E_CHUNKS * N_D_SPLITS)
        e_chunk = (job % (N_E_CHUNKS * N_D_SPLITS)) // N_D_SPLITS
        d_split = job % N_D_SPLITS
        _gemm_job(u_ptr, w_ptr, ws_ptr, sync_ptr, T, stride_u, stride_w, t_tile, e_chunk, d_split,
                  BLOCK_T, BLOCK_E, BLOCK_D, D_PER_SPLIT, N_D_SPLITS, MASK_D, INTERPRETED)
    elif job < n_gemm_jobs + n_epi_jobs:  # (never false unless the sync state was corrupted)
        _epilogue_job(bias_ptr, out_w_ptr, out_id_ptr, ws_ptr, sync_ptr, T, job - n_gemm_jobs,
                      BLOCK_T, EPI_ROWS, N_E_CHUNKS * N_D_SPLITS, N_D_SPLITS, MAX_SPINS)
        # The last epilogue job to finish restores the all-zero sync state. Every job number has
        # been taken (the epilogue jobs are the highest) and every tile's arrivals were consumed.
        tl.debug_barrier()
        finished = tl.atomic_add(sync_ptr + EPI_COUNTER, 1, sem="acq_rel")
        if finished == n_epi_jobs - 1:
            for i in range(0, n_t_tiles, 1024):
                offs = i + tl.arange(0, 1024)
                tl.store(sync_ptr + TILE_ARRIVALS + offs, tl.full([1024], 0, dtype=tl.int32),
                         mask=offs < n_t_tiles)
            tl.atomic_xchg(sync_ptr + JOB_COUNTER, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + EPI_COUNTER, 0, sem="relaxed")
''')

# Scoring snippets: (kernel body of `_score`, extra args, doc).
_SCORES = {
    "sqrtsoftplus": (
        "    # torch's softplus: l for l > 20, else log1p(exp(l)); log1p(e) = log(1+e) * e / ((1+e) - 1)\n"
        "    # keeps log1p's accuracy for tiny e without libdevice (the interpreter has none)\n"
        "    e = tl.exp(logits)\n"
        "    one_plus = 1.0 + e\n"
        "    log1p_e = tl.where(one_plus == 1.0, e, tl.log(one_plus) * (e / (one_plus - 1.0)))\n"
        "    softplus = ROUND(tl.where(logits > 20.0, logits, log1p_e))  # two ops: two roundings\n"
        "    return ROUND(tl.sqrt_rn(softplus))",
        "", "sqrt(softplus(logits))"),
    "sigmoid": (
        "    return ROUND(1.0 / (1.0 + tl.exp(-logits)))",
        "", "sigmoid(logits)"),
    "softmax": (
        "    # softmax over the real experts, from the row's max and sum of exp (computed by the caller)\n"
        "    return ROUND(tl.exp(logits - row_max) / row_sum)",
        ", row_max, row_sum", "softmax(logits) over the real experts"),
}

# Any edit of this module (template, snippets, generator code) or of the shared snippets changes every spec's key.
_GENERATOR_FINGERPRINT = hashlib.sha1(Path(__file__).read_bytes() + snippets.SOURCE).hexdigest()


def _fmt_float(x: float) -> str:
    """A Python literal that round-trips to the same float (repr is exact for Python floats)."""
    return repr(float(x))


def generate_source(spec: GateSpec) -> str:
    """The Triton module for `spec` (raises ValueError for an unsupported spec)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_gate cannot generate this spec: {reason}")
    body, score_args, score_doc = _SCORES[spec.score_func]
    body = body.replace("ROUND(", "_round_score(")  # a no-op unless the chain scores in a 16-bit dtype

    # GEMM: dtype handling and dot precision
    half_dot = _half_dot(spec)
    casts = []
    if not half_dot:
        for name, dtype in (("a", spec.input_dtype), ("b", spec.weight_dtype)):
            if dtype != "float32":
                casts.append(f"        {name} = {name}.to(tl.float32)  # mixed dtypes: upcast (exact), fp32 GEMM")
    if half_dot:
        casts = ["        if INTERPRETED:  # numpy cannot dot bf16 (nor accumulate fp16 in fp32); 16-bit products are exact in fp32",
                 "            a = a.to(tl.float32)",
                 "            b = b.to(tl.float32)"]
        dot = f"        acc = tl.dot(a, tl.trans(b), acc)  # {spec.input_dtype} on tensor cores, fp32 accumulate"
        dot_doc = f"{spec.input_dtype} x {spec.weight_dtype}, fp32 accumulate"
    else:
        note = {"tf32x3": "3xTF32: fp32-level accuracy on tensor cores",
                "ieee": "exact fp32 FMA", "tf32": "plain TF32 (explicit opt-in)"}[spec.precision]
        dot = f'        acc = tl.dot(a, tl.trans(b), acc, input_precision="{spec.precision}")  # {note}'
        dot_doc = f"fp32, input_precision={spec.precision}"
    dot_lines = "\n".join(casts + [dot])

    # Epilogue: scoring, bias, gather, renorm, scale
    if spec.score_func == "softmax":
        score_lines = (
            "    masked = tl.where(live, logits, float(\"-inf\"))\n"
            "    row_max = tl.reduce(masked, 1, _maximum)\n"
            "    row_max = tl.where(row_ok, row_max, 0.0)  # rows past T: keep the arithmetic finite\n"
            "    row_sum = tl.reduce(tl.exp(masked - row_max[:, None]), 1, _add)\n"
            "    row_sum = tl.where(row_ok, row_sum, 1.0)\n"
            "    score = _score(logits, row_max[:, None], row_sum[:, None])")
        gather = "    weights = _score(sel_logits, row_max[:, None], row_sum[:, None])"
    else:
        score_lines = "    score = _score(logits)"
        gather = "    weights = _score(sel_logits)"
    if spec.has_bias:
        upcast = ".to(tl.float32)" if spec.bias_dtype != "float32" else ""
        choice_lines = (f"    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0){upcast}\n"
                        "    choice = score + bias[None, :]  # the bias steers the selection only")
        choice_doc = "score + bias"
    else:
        choice_lines = "    choice = score"
        choice_doc = "score"
    if spec.choice_dtype != "float32":
        choice_lines += f"\n    choice = {_rounded('choice', spec.choice_dtype)}  # the chain's choice is {spec.choice_dtype}"
        choice_doc += f", rounded to {spec.choice_dtype}"
    if spec.score_dtype != "float32":
        score_doc += f", each op rounded to {spec.score_dtype}"
    weight_doc = "score[ids]"
    renorm_lines = ""
    if spec.renorm:
        if spec.renorm_eps == 0.0:
            renorm_lines = ("    total = tl.where(row_ok, tl.reduce(weights, 1, _add), 1.0)  # rows past T: no 0/0\n"
                            "    weights = weights / total[:, None]  # renormalise, no eps\n")
            weight_doc = "score[ids] / sum"
        else:
            eps = _fmt_float(spec.renorm_eps)
            renorm_lines = f"    weights = weights / (tl.reduce(weights, 1, _add)[:, None] + {eps})  # renormalise\n"
            weight_doc = f"score[ids] / (sum + {eps})"
    scale_lines = ""
    if spec.scale != 1.0:
        scale_lines = f"    weights = weights * {_fmt_float(spec.scale)}  # route scale\n"
        weight_doc += f" * {_fmt_float(spec.scale)}"

    round_logits = round_sel = ""
    if spec.logits_dtype != "float32":
        round_logits = (f"    logits = {_rounded('logits', spec.logits_dtype)}  "
                        f"# the chain's GEMM wrote {spec.logits_dtype} logits\n")
        round_sel = f"    sel_logits = {_rounded('sel_logits', spec.logits_dtype)}\n"

    spec_line = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(spec).items())
    return _TEMPLATE.substitute(
        COMBINERS=snippets.COMBINERS, ROUND_16BIT=snippets.ROUND_16BIT,
        KEY=spec.key(), SPEC_LINE=spec_line, E=spec.n_experts, E_PAD=_next_pow2(spec.n_experts),
        D=spec.hidden, K=spec.k, K_PAD=_next_pow2(spec.k),
        SCORE_ARGS=score_args, SCORE_BODY=body, SCORE_DOC=score_doc, DOT_DOC=dot_doc,
        CHOICE_DOC=choice_doc, WEIGHT_DOC=weight_doc, DOT_LINES=dot_lines,
        SCORE_LINES=score_lines, CHOICE_LINES=choice_lines, GATHER_LINES=gather,
        RENORM_LINES=renorm_lines, SCALE_LINES=scale_lines, ROUND_LOGITS=round_logits,
        ROUND_SEL_LOGITS=round_sel, ROUND_SCORE=_rounded("x", spec.score_dtype))


def _rounded(expr: str, dtype: str) -> str:
    """Triton for `expr` (fp32) rounded to `dtype` and back: where a chain in that dtype rounds."""
    return expr if dtype == "float32" else f"_round_{dtype}({expr})"


def kernel_name(spec: GateSpec) -> str:
    """The cache file stem: content-addressed by the spec and the generator's template."""
    return f"mega_gate_{spec.key()}"


def source_path(spec: GateSpec):
    """Write (if needed) and return the cached source file of `spec`."""
    return kernel_cache.write_source(kernel_name(spec), generate_source(spec))


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchConfig:
    """Tiling of one launch. `d_per_split >= hidden` is the tiled variant (D not split)."""
    block_t: int
    block_e: int
    block_d: int
    d_per_split: int
    epi_rows: int
    num_warps: int = 4
    num_stages: int = 3

    def variant(self, hidden: int) -> str:
        return "tiled" if self.d_per_split >= hidden else "split"


def choose_config(spec: GateSpec, n_tokens: int, *, device: torch.device | str = "cuda",
                  variant: str | None = None) -> LaunchConfig:
    """The launch configuration for `n_tokens` tokens (split unless `variant="tiled"` is forced).

    CUDA, tuned on one H200 at D=5120, E=384 with `tools/bench_gate.py --sweep` (results file):
      T <= 16     BLOCK_T 16,  BLOCK_E 128, D in 128-wide slices (121 programs at E=384: no job
                  claiming needed, see mega_gate_kernel), 1-row epilogue jobs
      T <= 128    BLOCK_T 32,  BLOCK_E 64,  ~240 GEMM jobs, 1-row epilogue jobs
      T <= 2048   BLOCK_T 128, BLOCK_E 128, 8 warps (two wgmma warpgroups), ~120 GEMM jobs,
                  4-row epilogue jobs
      T > 2048    BLOCK_T 128, BLOCK_E 64,  8 warps, D in 2 slices (2 slices sum in either order
                  to the same bits), 8-row epilogue jobs
    Slice widths are powers of two below 2048 tokens, so a handful of binaries covers every T (the
    width is a constexpr). Measured alternatives (results/mega_gate/bench.json): the tiled variant
    (whole D per job, plain stores) is 10% slower than 2 slices at T=4096 and 7x slower at T=512
    (too few jobs); "the last GEMM job of a tile selects" is 1.3x slower at T=1 and 3x at T=64
    (selection is compute-bound in one CTA), hence the separate epilogue jobs.
    CPU (the interpreter): few, large programs, since each interpreted op costs about the same.
    """
    if variant not in (None, "split", "tiled"):
        raise ValueError(f"variant must be 'split', 'tiled' or None, not {variant!r}")
    device = torch.device(device)
    D, e_pad = spec.hidden, _next_pow2(spec.n_experts)
    if device.type != "cuda":
        block_e = max(16, e_pad)
        block_d = min(64, max(16, _next_pow2(D) // 2))
        if variant == "tiled":
            return LaunchConfig(16, block_e, block_d, _round_up(D, block_d), epi_rows=8)
        d_per_split = _round_up(-(-D // 2), block_d)
        if d_per_split >= D:  # too small to halve at this block size: one block per slice
            block_d = d_per_split = 16
        return LaunchConfig(16, block_e, block_d, d_per_split, epi_rows=8)
    if variant == "tiled":
        block_e = min(64, max(16, e_pad))
        return LaunchConfig(64, block_e, 32, _round_up(D, 32), epi_rows=8)
    if n_tokens <= 16:
        block_t, block_e, block_d, warps, epi_rows, target_jobs = 16, 128, 64, 4, 1, 120
    elif n_tokens <= 128:
        block_t, block_e, block_d, warps, epi_rows, target_jobs = 32, 64, 64, 4, 1, 240
    elif n_tokens <= 2048:
        block_t, block_e, block_d, warps, epi_rows, target_jobs = 128, 128, 32, 8, 4, 120
    else:
        block_e = min(64, max(16, e_pad))
        d_per_split = _round_up(-(-D // 2), 32)
        if d_per_split >= D:
            d_per_split = 16
        return LaunchConfig(128, block_e, min(32, d_per_split), d_per_split, 8, num_warps=8)
    block_e = min(block_e, max(16, e_pad))
    n_jobs_per_slice = -(-n_tokens // block_t) * -(-spec.n_experts // block_e)
    n_slices = max(2, min(-(-D // block_d), round(target_jobs / n_jobs_per_slice)))
    # a power of two slice width: a handful of compiled kernels covers every T (it is constexpr)
    d_per_split = max(block_d, 1 << (-(-D // n_slices)).bit_length() - 1)
    if d_per_split >= D:  # a small D: still split it, so the variant is what was asked for
        block_d = max(16, min(block_d, _next_pow2(D) // 2))
        d_per_split = block_d
    return LaunchConfig(block_t, block_e, block_d, d_per_split, epi_rows, num_warps=warps)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


_sm_counts: dict[str, int] = {}


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 for the interpreter (it always claims jobs)."""
    if device.type != "cuda":
        return 1
    key = device_key(device)
    if key not in _sm_counts:
        _sm_counts[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[key]


# ----------------------------------------------------------------------------------------------
# Persistent sync state (per device)
# ----------------------------------------------------------------------------------------------

class _DeviceState:
    """The int32 sync buffer and the split variant's fp32 workspace of one device, kept all-zero
    between launches by the kernel itself. Buffers only grow; an outgrown buffer is kept alive
    (`retired`) because a captured CUDA graph may still point at it."""

    def __init__(self):
        self.sync = None
        self.workspace = None
        self.retired = []


_states: dict[str, _DeviceState] = {}
_state_lock = threading.Lock()


def _state_buffers(device: torch.device, n_tiles: int, ws_elems: int):
    with _state_lock:
        st = _states.setdefault(device_key(device), _DeviceState())
        need_sync = 2 + max(n_tiles, 1)
        if st.sync is None or st.sync.numel() < need_sync:
            _check_not_capturing(device, "sync buffer")
            if st.sync is not None:
                st.retired.append(st.sync)
            st.sync = torch.zeros(max(need_sync, 2 + 4096), dtype=torch.int32, device=device)
        if ws_elems and (st.workspace is None or st.workspace.numel() < ws_elems):
            _check_not_capturing(device, "workspace")
            if st.workspace is not None:
                st.retired.append(st.workspace)
            st.workspace = torch.zeros(max(ws_elems, 1 << 20), dtype=torch.float32, device=device)
        return st.sync, st.workspace


def _check_not_capturing(device: torch.device, what: str) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"mega_gate needs to allocate its persistent {what} during CUDA graph capture; run "
            "mega_gate once eagerly at the largest token count (or call reserve_workspace) first")


def reserve_workspace(spec: GateSpec, max_tokens: int, device: torch.device | str = "cuda") -> None:
    """Allocate the persistent buffers a launch of up to `max_tokens` needs (call before capture)."""
    device = torch.device(device)
    # the smallest token tile any configuration uses is 16 rows
    _state_buffers(device, -(-max_tokens // 16), max_tokens * _next_pow2(spec.n_experts))


def reset_workspace(device: torch.device | str = "cuda") -> None:
    """Zero the sync state again (only needed after a launch was aborted mid-way)."""
    st = _states.get(device_key(torch.device(device)))
    if st is not None:
        for buf in (st.sync, st.workspace):
            if buf is not None:
                buf.zero_()


def sync_state_is_clear(device: torch.device | str = "cuda") -> bool:
    """Whether the device's persistent sync buffer and workspace are all zero, as every completed
    launch leaves them (synchronise first: a launch in flight has them in use)."""
    st = _states.get(device_key(torch.device(device)))
    return st is None or not any(bool(buf.any()) for buf in (st.sync, st.workspace) if buf is not None)


# ----------------------------------------------------------------------------------------------
# Launch and reference
# ----------------------------------------------------------------------------------------------

def load(spec: GateSpec, interpret: bool):
    """The jitted kernel of `spec` for one mode (writes the source to the cache on first use)."""
    return kernel_cache.load_generated(kernel_name(spec), lambda: generate_source(spec), KERNEL_NAME, interpret)


def validate(u, weight, bias, spec: GateSpec) -> None:
    """Raise ValueError if the launcher must refuse these inputs; shapes, dtypes and devices only,
    so the pass runs it on a match's fake tensors (an unfused chain, never a run-time error)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_gate: unsupported spec: {reason}")
    if u.dim() != 2 or u.shape[1] != spec.hidden:
        raise ValueError(f"mega_gate: u must be [T, {spec.hidden}], got {list(u.shape)}")
    if tuple(weight.shape) != (spec.n_experts, spec.hidden):
        raise ValueError(f"mega_gate: weight must be [{spec.n_experts}, {spec.hidden}], got {list(weight.shape)}")
    if u.dtype != DTYPES[spec.input_dtype]:
        raise ValueError(f"mega_gate: u dtype {u.dtype} does not match spec input_dtype {spec.input_dtype}")
    if weight.dtype != DTYPES[spec.weight_dtype]:
        raise ValueError(f"mega_gate: weight dtype {weight.dtype} does not match spec weight_dtype {spec.weight_dtype}")
    if spec.has_bias:
        if bias is None:
            raise ValueError("mega_gate: spec has_bias=True but bias is None")
        if tuple(bias.shape) != (spec.n_experts,) or bias.dtype != DTYPES[spec.bias_dtype]:
            raise ValueError(f"mega_gate: bias must be {spec.bias_dtype} [{spec.n_experts}], "
                             f"got {bias.dtype} {list(bias.shape)}")
        if bias.device != u.device:
            raise ValueError(f"mega_gate: bias is on {bias.device}, u on {u.device}")
    elif bias is not None:
        raise ValueError("mega_gate: spec has_bias=False but a bias was given")
    if weight.device != u.device:
        raise ValueError(f"mega_gate: weight is on {weight.device}, u on {u.device}")


def mega_gate(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: GateSpec, *,
              variant: str | None = None, config: LaunchConfig | None = None):
    """(weights [T, k] fp32, ids [T, k] int64) of the gate chain, in one kernel launch.

    `variant` forces "split" or "tiled" (default: chosen from T); `config` overrides the tiling
    entirely (benchmark sweeps). Fresh outputs; the inputs are not modified.
    """
    # a repeat of an earlier call's layout (every layer, every step) launches with that call's
    # decisions (lowering.launch); forced variants and configs always take the whole path
    kept_key = None
    if u.is_cuda and variant is None and config is None:
        kept_key = (spec, layout_key(u, weight, bias))
        kept = _kept.get(kept_key)
        if kept is not None:
            weights, ids = _gate_outputs(spec, u.shape[0], u.device)
            if u.shape[0]:
                if not kept.decisions["row_major"]:  # (the key holds the strides: the same copies again)
                    u, weight, bias = _row_major(u, weight, bias)
                kept(*_kernel_args(u, weight, bias, weights, ids, spec, kept.decisions["cfg"]))
            return weights, ids
    validate(u, weight, bias, spec)
    T, device = u.shape[0], u.device
    weights, ids = _gate_outputs(spec, T, device)
    if T == 0:
        return weights, ids
    given = (u, weight, bias)
    u, weight, bias = _row_major(u, weight, bias)
    row_major = all(a is b for a, b in zip(given, (u, weight, bias)))
    cfg = config or choose_config(spec, T, device=device, variant=variant)
    if cfg.d_per_split % cfg.block_d or cfg.block_t % cfg.epi_rows:
        raise ValueError(f"mega_gate: inconsistent launch config {cfg}")
    args = _kernel_args(u, weight, bias, weights, ids, spec, cfg)
    interpret = device.type != "cuda"
    sync, n_t_tiles, n_epi_jobs = args[6], args[-2], args[-1]
    if interpret and bool(sync.any()):  # host memory: checking costs nothing (see reset_workspace)
        warnings.warn("mega_gate: sync state was left dirty by an aborted launch; resetting it")
        reset_workspace(device)
    n_e_chunks = -(-spec.n_experts // cfg.block_e)
    n_d_splits = -(-spec.hidden // cfg.d_per_split)
    grid = (n_t_tiles * n_e_chunks * n_d_splits + n_epi_jobs,)
    options = dict(
        BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_D=cfg.block_d, D_PER_SPLIT=cfg.d_per_split,
        N_E_CHUNKS=n_e_chunks, N_D_SPLITS=n_d_splits, MASK_D=spec.hidden % cfg.d_per_split != 0,
        EPI_ROWS=cfg.epi_rows, CLAIM_JOBS=grid[0] > _num_sms(device), INTERPRETED=interpret,
        MAX_SPINS=1 << 10 if interpret else 1 << 22,  # only a corrupted sync state spins that long
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **COMPILE_OPTIONS)
    kernel = load(spec, interpret=interpret)
    on_device = contextlib.nullcontext() if interpret else torch.cuda.device(device)
    with on_device:  # Triton launches on the current device
        compiled = kernel[grid](*args, **options)
    if kept_key is not None:
        _kept.keep(kept_key, compiled, grid, kernel, options, device, cfg=cfg, row_major=row_major)
    return weights, ids


_kept = PreparedLaunches()


def forget_kept_launches() -> None:
    """The next call of every layout takes the whole path again: validation, configuration and
    Triton's JIT (lowering.launch)."""
    _kept.clear()


def _gate_outputs(spec: GateSpec, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return empty((T, spec.k), torch.float32, device), empty((T, spec.k), torch.int64, device)


def _row_major(u, weight, bias):
    """The inputs with unit-stride rows, as the kernel indexes them."""
    return (u if u.stride(1) == 1 else u.contiguous(), weight if weight.stride(1) == 1 else weight.contiguous(),
            None if bias is None else bias.contiguous())


def _kernel_args(u, weight, bias, weights, ids, spec: GateSpec, cfg: LaunchConfig) -> tuple:
    """The kernel's runtime arguments in its signature's order, with this launch's workspace: the
    split variant accumulates into the persistent all-zero one; the tiled variant stores every
    workspace element it reads, so a fresh (uninitialised) buffer will do."""
    T, device = u.shape[0], u.device
    e_pad = _next_pow2(spec.n_experts)
    n_t_tiles = -(-T // cfg.block_t)
    split = spec.hidden > cfg.d_per_split
    sync, persistent_ws = _state_buffers(device, n_t_tiles, T * e_pad if split else 0)
    ws = persistent_ws if split else empty((T * e_pad,), torch.float32, device)
    return (u, weight, bias if bias is not None else weight, weights, ids, ws, sync,
            T, u.stride(0), weight.stride(0), n_t_tiles, -(-T // cfg.epi_rows))


def reference(u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: GateSpec):
    """The torch reference of the fused op: `model.moe.route` with the spec's scalars."""
    return route(u, weight, bias, score_func=spec.score_func, k=spec.k, renorm=spec.renorm,
                 scale=spec.scale, renorm_eps=spec.renorm_eps, logits_dtype=DTYPES[spec.logits_dtype],
                 score_dtype=DTYPES[spec.score_dtype], choice_dtype=DTYPES[spec.choice_dtype])
