"""Mega-mHC: the mHC seam between two sublayers in one generated Triton launch.

    X'   = hc_post(y, X, post, comb)          if has_post, else X         [T, n, D], stream dtype
    pre', post', comb' = mhc_coefficients(X')  if has_coefficients         fp32 [T,n], [T,n], [T,n,n]
    c    = hc_pre(X', p)                       p = carried pre, or pre' ("fresh")     [T, D]
    u    = (rms_normalize(c, norm_eps) * norm_weight).to(stream dtype)             [T, D]

(MODEL.md section 3; KERNELS.md "Mega-mHC".) Rounding follows the reference exactly: X' is rounded
to the stream dtype before anything reads it, c is rounded before its RMS statistic, and every
statistic is fp32. Forms the pass binds:

    form                         has_post  has_coefficients  pre
    delayed seam (V4.1)          yes       yes               carried
    first seam (one-hot pre)     no        yes               carried
    Engram seam (after inject)   no        yes               carried
    final collapse + last norm   yes       no                carried
    V4 non-delayed               either    yes               fresh

`mega_mhc(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec)` returns
`(X' or None, u, pre' or None, post' or None, comb' or None)`; `reference` is the same maths as
plain torch (it calls `model.mhc` and `model.layers.rms_normalize`, so the formulas exist once).
`generate_source(spec)` renders the kernel from the template below; the launcher writes it to the
kernel cache (`kernel_cache.py`) and loads it compiled for CUDA tensors and interpreted for CPU
tensors: one source for both.

Kernel design (H200; memory-bound)
----------------------------------
Traffic per token in bf16: read y (2D) and X (8D), write X' (8D) and u (2D), plus fn
((2+n)n x nD fp32 = 1.97 MB at n=4, D=5120) once per launch. FLOPs are negligible, so the kernel is
organised around moving those bytes once:

* Stage A: a token tile of TILE_T tokens sweeps (a slice of) D in BLOCK_D-column chunks. Every
  stream is its own [TILE_T, BLOCK_D] register tile (the generator unrolls the n streams, so the
  post + comb mix, the statistics and the collapse are elementwise in one layout). Per chunk: form
  X' (post + comb mix) in fp32, round and store it, add its squares to the coefficient statistic,
  collapse it with the carried pre, round the collapse and *park* it in u, add its squares to the
  norm statistic, then add X''s projection onto fn (per stream a `tl.dot` of [TILE_T, BLOCK_D] x
  [BLOCK_D, SLOT], fn's (2+n)n rows padded to SLOT). The next chunk's inputs (y, X, fn's block)
  are loaded before the current one is computed (register double-buffering). fn's block is read
  once per token tile, not per token; with `LaunchConfig.sub_tiles` = 2 a tile of 2 x 16 tokens
  is swept as two 16-token register tiles that share each block of fn (T >= 1024: half of fn's
  traffic from L2, which at T=4096 with 16-token tiles exceeded the launch's HBM traffic).
  `LaunchConfig.pipeline_stages` instead leaves the loads in a `tl.range` loop that Triton
  pipelines through shared memory, so more chunks are in flight and fewer registers are used
  (T >= 64). fn is fp32 and X' bf16, so the dot runs on fn's two bf16 pieces (hi + lo): each
  tile splits its block of fn, or, with `LaunchConfig.presplit_fn`, a
  first small launch splits fn once and the tiles load the pieces (~28% fewer instructions per
  chunk on sm_90; no tuned row uses it since the paired conversions of _round / _widen: the
  second launch costs about what it saves). Values are rounded and widened in pairs (_round,
  _widen): ~10-14% fewer instructions per chunk than Triton's one-at-a-time conversions.
* The coefficients need the whole row: the tile's partial sums ((2+n)n projections, sum X'^2,
  sum c^2) meet in one fp32 accumulator row per token (kept column by column in a [SLOT, TILE_T]
  block per tile: _acc_block; plain stores when one job covers D, fp32 atomics when D is split,
  spread over `LaunchConfig.acc_copies` copies of the block that the merge sums).
  The program that completes the tile reads them (one [TILE_T, SLOT] block load a copy, split
  into [TILE_T] column vectors in registers) and
  runs r = rsqrt(mean(X'^2) + eps), the sigmoid gates, softmax and exactly the reference's Sinkhorn
  truncation on n*n vectors (row and column sums are plain additions; the rounds in a loop of
  SINKHORN_UNROLL rounds a trip), and stores pre', post', comb'. It loads the whole row before
  its first store; with a fresh pre it publishes pre' before Sinkhorn, which then overlaps the
  collapse jobs' work.
* The norm's statistic needs the whole row too, so a second, short sweep rescales the parked
  collapse in place: u = c * rsqrt(mean(c^2) + eps) * w (reads and writes 2D bytes per token:
  from L2 at small T; at T=4096 much of the parked 42 MB has left L2, and the rescale is the
  launch's last ~10%, with its loads pipelined: `LaunchConfig.rescale_stages`), in
  [TILE_T, 8192 / TILE_T] blocks (a rescale job's whole part in one block where it fits,
  `LaunchConfig.rescale_at_once`: its loads then share one round trip with sum(c^2)'s).
* "fresh" pre: the collapse needs pre', known only after the whole row, so it is a second sweep
  over X' (re-reading 8D per token: the documented cost of V4's non-delayed form), then the rescale.

Variants (one kernel, constexpr switches; `choose_config` picks one per T):

* tiled (`split_cols >= D`): one program per token tile does everything inline; no shared state.
  The CPU's (interpreter's) choice; on CUDA only when forced (no tuned row uses it: split jobs
  with sub-tiles beat it at T=4096, 150.5 against ~172 us).
* split (`split_cols < D`): at small T one program per token tile cannot pull fn (2 MB) and the
  row through one SM fast enough (T=1 with one program is ~20x slower than the floor): D is split
  into slices, (token tile, slice) stage-A jobs add their partial sums into the tile's accumulator
  row (atomics) and arrive on the tile's counter; the last arrival computes the coefficients. The
  rescale (and the fresh collapse) is then done either by that last arrival for the whole tile
  (`r_splits == 0`) or by `r_splits` epilogue jobs per tile that wait for the tile (spreads it over
  the GPU: measured faster at every T tried, see `choose_config`). With the carried pre the
  rescale jobs wait for the tile's stage-A arrivals, not for its merge: sum(c^2) is complete then,
  and each reads it from the accumulator row, so the merge (Sinkhorn) runs beside the rescale.

Forward progress in the split variant with epilogue jobs: jobs are numbered stage-A jobs first,
then fresh-collapse jobs, then rescale jobs, and a job only ever waits on jobs of earlier stages.
Three ways to number them, one argument each:
* co-resident (`LaunchConfig.co_resident`, where the device holds the whole grid at once: the
  compiled kernel's occupancy, `_fits_at_once`): the grid is launched cooperatively, which CUDA
  runs only with every program resident at once (it refuses a grid that cannot be, with an error,
  never a hang), and job = program id. Every job a waiting job waits on is running. T = 1 and 64
  on the H200 (170 and 128 programs).
* otherwise jobs are claimed from an atomic counter at program start. When a program holds a
  waiting job, every job it waits on has already been claimed by a running program that itself
  waits only on earlier ones: no deadlock whatever the dispatch order or occupancy (the argument
  of decoupled look-back scans; lowering/mega_gate.py uses it too). The claims of a launch
  serialise on the counter (the last one at T=64 came 0.45 us after the first start).
* handoff (`LaunchConfig.handoff`; carried pre, where only rescale jobs wait): job = program id,
  with neither. Stage-A jobs never wait. A rescale job waits at most MAX_SPINS for its tile's
  arrivals, then adds its part's bit to the tile's arrival word: one atomic, whose old value also
  says whether the tile's last arrival has come meanwhile (then the job does its blocks itself).
  The last arrival's ticket, the same word, carries every bit added before it, and that program
  does those parts after its merge. So no wait is unbounded and every part is done exactly once,
  whatever the dispatch order and however few programs are resident; the cost of an unlucky
  order is time (the handed parts run on one program), never a deadlock.
The interpreter runs programs one at a time in program-id order, which is the claim order, so
there job = program id holds without a cooperative launch. Otherwise a wait is bounded
(MAX_SPINS) only against a corrupted sync state: it then ends in NaN output, never a hang or a
plausible wrong answer. With handoff a bounded wait is part of the protocol, so there a corrupted
state (no last arrival ever) can leave a handed part's blocks unnormalised.

Numerics: every statistic is fp32 over the rounded values, as in the reference. Projection: with
bf16 streams X' is exactly bf16, so fn is split into two bf16 pieces (hi + lo: 16 of fp32's 24
mantissa bits) and two bf16 tensor-core dots accumulate in fp32; measured against the fp32 GEMM
the coefficients differ by ~1e-7..2e-6 (relative L2, H200), the size of fp32 summation noise. With
fp32 streams the dot runs 3xTF32 (`input_precision="tf32x3"`); so it does with fp16 streams, on X''s
widened (exact) fp32 copy (fp16 values are not bf16's), X' and c rounded to fp16 by `.to()`, to
nearest even on the GPU and in the interpreter alike (fp16 is not tuned: no config is specific to it). Sinkhorn and the sigmoid gates
multiply by a reciprocal (`rcp.approx` on the GPU: within an ulp of the division), and the merge's
exp is `ex2.approx.ftz` (subnormal results flush to zero; every one then meets an eps >= 1e-20
or a 1 +); other divisions are Triton's fp32 `/`. With LaunchConfig.sinkhorn_factors the rounds
update row and column factors of the softmax cells (the same maths, other roundings: within 1e-6
of the cell rounds on the CPU).
With D split in more than two slices the fp32 atomics meet in a run-dependent order, so the
coefficients and u may differ in the last bits between runs (the tiled variant is deterministic).
The interpreter upcasts bf16 dot operands (numpy has no bf16 matmul) and rounds fp32 -> bf16 to
nearest even with integer operations (its own cast truncates).

Persistent state and CUDA graphs: the split variant uses, per device, an int32 sync buffer and an
fp32 accumulator, all zero between launches (the kernel restores that itself), and, for launches
that run MONOTONIC (co-resident epilogue jobs with the carried pre, the tuned T <= 128 rows), int64
token-tile counters per (stage-A jobs, rescale jobs) a tile, which only grow: each launch adds the
same amounts to every tile it covers, so its rescale jobs can tell their own launch's arrivals
from earlier ones, and no job ends in the launch-wide count that restores a zero state (see the
kernel's docstring). All are allocated on the first split launch on a device (run once eagerly at
the largest T, or call `reserve_sync`, before capturing a CUDA graph: allocating during a capture
raises); `reset_sync` zeroes them all after an aborted launch (the interpreter checks the state
before each launch and resets it with a warning). On CUDA devices from sm_90 on, the seam is a
programmatic dependent launch (`LaunchConfig.pdl`): it waits for its predecessor's writes before
touching memory, so only launch latency and the programs' set-up (job numbers and addresses, where
jobs are not claimed) overlap. Per-call buffers come from
torch.empty (every element read is written first), so under capture they come from the graph's
pool. A captured launch is replay-safe (tools/bench_mhc.py checks replays on new inputs). Split
launches on two streams of one device must not run concurrently (they share the persistent
state); stream-ordered use, as Inductor emits, is fine.

Measured (H200, results/bench_mhc.json, stop 22's run): CUDA-graph replay 4.67 / 7.85 / 23.7 /
144 us at T = 1 / 64 / 512 / 4096 (with fn's pieces given: 4.7 / 7.6 / 23.2 / 146) against 61 / 93
/ 300 / 1783 us for the same chain under torch.compile (stop 21's run: 4.7 / 8.1 / 24.0 / 147; its
code measured T=64 7.88-8.45 in ten timings); in one process stage A's vector atomics (_add_partials)
took T=64 from 8.45 to 7.90 us and T=512 from 24.0 to 23.5 (stop22_experiments.json, call 5), and
the late PDL wait (_begin) took T=64 from 8.37 to 7.96 us and T=1 from 4.94 to 4.67
(stop20_experiments.json, call 5). Instances differ
(the stop-11 kernel measured 10.4 us at T=64 on one, 12.0 on another), and so do the persistent
buffers' addresses: the T=64 launch measured 8.15-8.48 us over six placements in one process
(stop19_experiments.json). Where the time goes (tools/bench_mhc.py --trace: %globaltimer per
program, after the first start; stop 19's run, bench_mhc_runs/stop19_bench.log): at T=1 (hand-off,
no claim) stage A done 1.6-2.1 us, arrived 2.4-2.9 (the release fence waits for the partial-sum
atomics), rescale done 3.4-3.7, coefficients + Sinkhorn done 4.7 (the last program); at T=64
(co-resident, MONOTONIC) stage A takes 4.45 us (median, 4.74 max; three [16, 64] chunks: one warp's
instruction latency, one program per SM: a stage-A job that shared an SM took 7.2-7.7), the arrival
~1.0 us more (with the partial sums in 4 accumulator copies; 1.9 with one; 0.8 with stop 22's
vector atomics, whose release fence waits ~0.4 us), then the merge 1.8 us
after the last arrival (one round trip for its block and bias loads, gates and softmax, Sinkhorn's
rounds ~0.7 us on factors, ~49 instructions a round of the merge's ~1270 a warp: bound by issue
and latency, since moving Sinkhorn's reciprocals from MUFU to the FMA pipe made it slower,
stop21_experiments.json; two merges on one SM take 2.4-2.7 us each: stop20_experiments.json, call
3), the rescale jobs ending beside it (two [16, 512] blocks loaded with sum(c^2) in one round trip:
rescale_at_once; the merges end at 7.4 us, the rescale jobs at 7.1 median, 7.3 max); the launch
itself ~0.8 us more with PDL (an
empty kernel of 128 programs: 0.59 us in graph replay, 1.16 launched cooperatively,
stop16_experiments.json); at T=4096 the stage-A jobs end at 121-127 us, the merges at 126-130 and
the rescale jobs at 136-143 (the parked collapse is re-read, much of it from HBM). Within stage A
(tools/bench_mhc.py --leave-out, which times the launch with each of LEAVE_OUT_PARTS compiled out;
measured before the paired conversions and sub-tiles): the projection dots cost the most at every T
(3.1 of 6.1 us at T=64, 9.4 of 21.8 at T=512, 24 of 145 at T=4096), then fn's loads.
Launching outside a CUDA graph costs 0.1-0.3 ms of host time per call on that machine (Triton's
launcher with ~30 arguments plus this wrapper): use it under CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import string
import threading
import warnings
from dataclasses import dataclass

import torch
import triton.language  # noqa: F401  (import Triton before any kernel module: see kernel_cache)

from . import kernel_cache, occupancy
from .launch import PreparedLaunches, empty, layout_key

# Stream dtypes (X', the collapse and u are rounded to it; every statistic is fp32). fp16 streams
# take the fp32 projection (their widened X' against fp32 fn: fp16 values are not bf16's).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRE_MODES = ("carried", "fresh")
_keys: dict = {}  # spec -> key(), memoised (the launch path asks for it on every call)
KERNEL_NAME = "mega_mhc_kernel"
SPLIT_FN_KERNEL = "mega_mhc_split_fn"  # bf16 streams: fn into its bf16 pieces, for presplit_fn launches
SPLIT_FN_BLOCK = 1024
SYNC_PER_TILE = 4  # arrive A, ready A, arrive C, ready C
# Sync words count in their low HANDOFF_SHIFT bits (so a tile has fewer stage-A jobs than 2 **
# HANDOFF_SHIFT); with LaunchConfig.handoff a tile's ARRIVE_A word also holds one bit per rescale
# part above the count (bits up to 30 of the int32: MAX_HANDOFF_PARTS).
HANDOFF_SHIFT = 16
MAX_HANDOFF_PARTS = 31 - HANDOFF_SHIFT
# LaunchConfig.rescale_at_once: the largest part (elements) a rescale job holds in registers at once
RESCALE_AT_ONCE_ELEMS = 16384
# Stage A may sweep a token tile as sub-tiles (LaunchConfig.sub_tiles); the generated code names
# sub-tile s's values with SUB_SUFFIX[s] and has code for at most MAX_SUB_TILES of them.
SUB_SUFFIX = ("", "_s1")
MAX_SUB_TILES = len(SUB_SUFFIX)
# A traced launch (`mega_mhc(..., trace=...)`, CUDA only) records one int64 row per program: the
# GPU's %globaltimer (ns) at each of these events (0 where the program never reached it), then
# its job number, role and the SM it ran on (%smid: which programs shared an SM). tools/bench_mhc.py
# --trace turns them into a launch's timeline.
TRACE_TIMES = ("start", "claimed", "ready", "work", "arrived", "finished", "end")
TRACE_EVENTS = TRACE_TIMES + ("job", "role", "sm")
TRACE_ROLES = ("tiled", "stage A", "collapse", "rescale")
# A timing diagnostic (`mega_mhc(..., leave_out=...)`, tools/bench_mhc.py --leave-out): stage A with
# one of its parts compiled out, to place its time by difference (the outputs are then wrong by
# design: never for use). Part -> bit of the kernel's LEAVE_OUT constexpr.
LEAVE_OUT_PARTS = {
    "fn_loads": 1,  # fn's blocks are zeros: no fn reads (nor, without presplit_fn, its split)
    "dots": 2,  # no projection dots (and so no fn reads either): the coefficients see m = 0
    "stream_stores": 4,  # X' is computed but not stored
    "parked_store": 8,  # the collapse is not parked: the rescale reads whatever u held
}


# ----------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MhcSpec:
    """Everything the generator specialises on (what a pass binds from one matched seam)."""
    n: int
    dim: int
    sinkhorn_iters: int
    hc_eps: float
    stat_eps: float
    norm_eps: float
    has_post: bool
    has_coefficients: bool
    pre: str
    stream_dtype: str

    def key(self) -> str:
        """Short stable hash of the spec and of the generator's template (file names, memo keys)."""
        key = _keys.get(self)
        if key is None:
            fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            for name in ("hc_eps", "stat_eps", "norm_eps"):
                fields[name] = float(fields[name]).hex()  # exact, platform-independent float text
            text = json.dumps(fields, sort_keys=True) + _GENERATOR_FINGERPRINT
            key = _keys[self] = hashlib.sha1(text.encode()).hexdigest()[:12]
        return key

    def width(self) -> int:
        """Rows of fn: [pre n | post n | comb n*n]."""
        return (2 + self.n) * self.n

    def describe(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(key=self.key(), form=self.form(), width=self.width(), slot=_slot_width(self.n),
                 outputs=self.outputs(), unsupported=unsupported_reason(self))
        return d

    def form(self) -> str:
        if self.pre == "fresh":
            return "V4 non-delayed (fresh pre)" + ("" if self.has_post else ", no post")
        if not self.has_coefficients:
            return "final collapse" if self.has_post else "collapse + norm only"
        return "delayed seam" if self.has_post else "first / Engram seam (no post)"

    def outputs(self) -> list[str]:
        """Names of the non-None entries of mega_mhc's result tuple."""
        out = (["streams"] if self.has_post else []) + ["u"]
        return out + (["pre", "post", "comb"] if self.has_coefficients else [])


def unsupported_reason(spec: MhcSpec) -> str | None:
    """None if the generator handles `spec`, else a sentence saying why not (for the pass report)."""
    if not isinstance(spec.n, int) or spec.n not in (2, 4, 8):
        return (f"{spec.n} residual streams: the kernel holds the [n, n] Sinkhorn block and the n "
                "streams as register tiles, which needs n in 2, 4, 8")
    if not isinstance(spec.dim, int) or spec.dim < 1:
        return f"hidden size {spec.dim!r} must be a positive integer"
    if spec.stream_dtype not in DTYPES:
        return f"stream dtype {spec.stream_dtype!r} is not supported (one of {', '.join(DTYPES)})"
    if spec.pre not in PRE_MODES:
        return f"pre mode {spec.pre!r} is not one of {', '.join(PRE_MODES)}"
    if spec.pre == "fresh" and not spec.has_coefficients:
        return "a fresh pre needs the coefficients of this site (has_coefficients=False)"
    if spec.has_coefficients and (not isinstance(spec.sinkhorn_iters, int) or not 1 <= spec.sinkhorn_iters <= 1000):
        return f"{spec.sinkhorn_iters!r} Sinkhorn iterations is outside 1..1000"
    for name in ("hc_eps", "stat_eps", "norm_eps"):
        value = getattr(spec, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
            return f"{name} {value!r} must be a finite number >= 0"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _slot_width(n: int) -> int:
    """A workspace partial-sums row: (2+n)n projections, sum X'^2, sum c^2; a power of two >= 16
    (it is also the N of the projection dot)."""
    return max(16, _next_pow2((2 + n) * n + 2))


# ----------------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------------

# The kernel template. `$NAME` placeholders are filled by `generate_source`; everything else is
# literal Triton. Read a generated file (kernel cache) to see one specialisation in full.
_TEMPLATE = string.Template('''\
"""Mega-mHC kernel for spec $KEY, generated by megafuse.lowering.mega_mhc. Do not edit.

spec: $SPEC_LINE
form: $FORM

For each token t (n = $N streams of D = $D, stream dtype $DTYPE_NAME):
$MATH_DOC

Jobs (see mega_mhc_kernel):
    tiled  (N_SPLITS == 1)   one program per token tile does everything inline
    split  (N_SPLITS > 1)    stage A per (token tile, D slice), partial sums added (atomics) into
                             the tile's row of the accumulator; the last arrival of a tile reads
                             them (coefficients, norm statistic); the rescale (and a fresh
                             collapse) by that last arrival (R_SPLITS == 0) or by epilogue jobs
                             that wait for the tile (R_SPLITS > 0)
"""
import os

import triton
import triton.language as tl

$CONSTANTS

# sync buffer (int32, all zero between launches; the split variant restores that itself)
JOB_COUNTER = tl.constexpr(0)         # next job number (epilogue-job mode)
DONE_COUNTER = tl.constexpr(1)        # finished jobs (epilogue-job mode)
TILE_SYNC = tl.constexpr(2)           # then 4 per token tile:
ARRIVE_A = tl.constexpr(0)            #   stage-A jobs arrived (low bits; HANDOFF: high bits below)
READY_A = tl.constexpr(1)             #   (fresh) tile published: pre' stored
ARRIVE_C = tl.constexpr(2)            #   fresh-collapse jobs arrived
READY_C = tl.constexpr(3)             #   (fresh) 1/rms published
TILE_ARRIVE = tl.constexpr(0)         # MONOTONIC: a token tile's int64 counters (tiles_ptr): arrivals,
TILE_RESCALE = tl.constexpr(1)        #   rescale jobs' tickets
COUNT_MASK = tl.constexpr($COUNT_MASK)  # a sync word's count; HANDOFF: in ARRIVE_A above the count,
HANDOFF_SHIFT = tl.constexpr($HANDOFF_SHIFT)  # bit HANDOFF_SHIFT + p: the tile's rescale part p handed off
# stage A's accumulator atomics are masked per ATOMIC_QUAD consecutive tokens (a thread's run of a
# column in the layout Triton gives them), so that each run goes as one vector atomic (_add_partials)
ATOMIC_QUAD = tl.constexpr(4)

# LEAVE_OUT bits (timing diagnostic only: see LEAVE_OUT_PARTS in megafuse.lowering.mega_mhc)
$LEAVE_CONSTANTS

# trace rows (TRACE only): per program, %globaltimer ns at these events, plus its job, role and SM
TRACE_EVENTS = tl.constexpr($TRACE_EVENTS)
$TRACE_CONSTANTS

# Reductions go through tl.reduce with these combiners, and tl.full stands in for tl.zeros:
# tl.sum / tl.max / tl.zeros / tl.sigmoid are @triton.jit library functions whose mode
# (interpreter or compiler) was fixed when Triton was first imported, while this module is loaded
# once per mode (see megafuse.lowering.kernel_cache). Builtins work in both.


@triton.jit
def _add(a, b):
    return a + b


# The interpreter reduces with numpy only for Triton's own combiners (by identity) and calls any
# other combiner once per element; this module is imported once per mode, so pick per import.
if os.environ.get("TRITON_INTERPRET") == "1" and hasattr(tl.standard, "_sum_combine"):
    _add = tl.standard._sum_combine


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    """e^x for the merge's gates and softmax: on the GPU one ex2.approx.ftz after the scaling by
    log2(e) (tl.exp's ex2.approx keeps subnormal results, which costs a range test and two
    multiplications per value; here they flush to zero, below every eps the results meet). The
    merge is one dependent chain per token, so its instruction count is its latency: with _sigmoid
    below, T=64 measured 9.07 against 9.47 us (results/bench_mhc_runs/stop15_experiments.json)."""
    if INTERPRETED:
        e = tl.exp(x)
    else:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $$0, $$1;", "=f,f", [x * 1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
    return e


@triton.jit
def _reciprocal(x, INTERPRETED: tl.constexpr):
    """1 / x for Sinkhorn's normalisations and the gates: on the GPU one MUFU.RCP (rcp.approx.ftz,
    within an ulp; x >= eps > 0, never subnormal), where `/` also range-checks: Sinkhorn's rounds
    are one thread's dependent chain per token, so each instruction in it is latency."""
    if INTERPRETED:
        r = 1.0 / x
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $$0, $$1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    return r


@triton.jit
def _sigmoid(z, INTERPRETED: tl.constexpr):
    """1 / (1 + e^-z) with _exp and _reciprocal (1 + e^-z >= 1: no subnormals; an ulp from `/`)."""
    return _reciprocal(1.0 + _exp(-z, INTERPRETED), INTERPRETED)


@triton.jit
def _round(x, INTERPRETED: tl.constexpr):
    """fp32 -> the stream dtype, rounding to nearest even like torch's .to(). The interpreter's own
    fp32 -> bf16 cast truncates, so there the rounding is spelled out in integer operations."""
    if IS_BF16:
        if INTERPRETED:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # RNE onto the top 16 bits
            rounded = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact now
        else:
            # two elements per cvt.rn.bf16x2 (the first in the low half, as Triton packs them),
            # where .to() converts one at a time and then packs the pair again for the store
            rounded = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $$0, $$2, $$1;", "=r,r,r", [x],
                                                dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        rounded = $ROUND_OTHER
    return rounded


@triton.jit
def _widen(x, INTERPRETED: tl.constexpr):
    """x (bf16 or fp32) as fp32. On the GPU a bf16 pair in one register widens in two
    instructions (the low half shifted up, the high half masked), where .to() first moves the
    high half down and then shifts it back up. With _round's paired conversion: 58-125 fewer
    instructions per stage-A chunk (886 -> 761 at T=64, 905 -> 786 at T=512, 630 -> 572 at
    T=4096) and 36-56 fewer registers in the tuned sm_90 builds (tools.hopper_builds)."""
    if x.dtype == tl.bfloat16 and not INTERPRETED:
        wide = tl.inline_asm_elementwise("{ shl.b32 $$0, $$2, 16; and.b32 $$1, $$2, 0xFFFF0000; }",
                                         "=r,=r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    else:
        wide = x.to(tl.float32)
    return wide


@triton.jit
def _opaque(x, INTERPRETED: tl.constexpr):
    """x itself, through an opaque (impure) register move. Without it the compiler recomputes the
    whole X' chain (loads, post + comb mix) a second time in the dot's operand layout, which
    doubles the registers and spills; with it X' is computed once and converted once."""
    if INTERPRETED:
        y = x
    else:
        if IS_BF16:
            y = tl.inline_asm_elementwise("mov.b32 $$0, $$1;", "=r,r", [x], dtype=tl.bfloat16,
                                          is_pure=False, pack=2)
        else:
            y = tl.inline_asm_elementwise("mov.b32 $$0, $$1;", "=r,r", [x], dtype=tl.float32,
                                          is_pure=False, pack=1)
    return y


$PROJECT_FUNCTIONS


@triton.jit
def _load_streams(x_ptr, y_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end,
                  BLOCK_D: tl.constexpr):
    """One chunk of D of the token rows `rows64` ($STREAM_LOAD_DOC); masked past the job's last
    chunk (chunk >= c_end): nothing is read."""
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    live = (d * 0 + chunk) < c_end  # [BLOCK_D], all equal (a tensor in both Triton modes)
    ok = row_ok[:, None] & ((d < D) & live)[None, :]
    x_ptrs = x_ptr + rows64[:, None] * stride_xt + d[None, :]
$STREAM_LOAD_LINES


@triton.jit
def _load_chunk(x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end,
                BLOCK_D: tl.constexpr, PRESPLIT: tl.constexpr, LEAVE_OUT: tl.constexpr):
    """The raw inputs of one chunk of D ($LOAD_DOC).
    Past the job's last chunk (chunk >= c_end) everything is masked: nothing is read."""
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    live = (d * 0 + chunk) < c_end  # [BLOCK_D], all equal (a tensor in both Triton modes)
$LOAD_LINES


@triton.jit
def _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr, csq_slot,
             T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
             tile, c_begin, c_end, acc_copy, TILE_T: tl.constexpr, SUB_TILES: tl.constexpr,
             BLOCK_D: tl.constexpr, ACC_COPIES: tl.constexpr, ATOMIC: tl.constexpr,
             PIPELINE_STAGES: tl.constexpr, PRESPLIT: tl.constexpr, LEAVE_OUT: tl.constexpr,
             CSQ_SLOT: tl.constexpr, WAIT: tl.constexpr, trace_ptr, TRACE: tl.constexpr,
             INTERPRETED: tl.constexpr):
    """Stage A for token tile `tile` over chunks [c_begin, c_end) of D: store X' (and the parked,
    unnormalised carried collapse), and add the partial sums into copy `acc_copy` of the tile's
    accumulator block (_acc_block): the (2+n)n projections, sum X'^2 (SUMSQ_COL), sum c^2
    (CSQ_COL; with CSQ_SLOT, this job's own slot `csq_slot` of the tile's sum(c^2) slots instead,
    see MONOTONIC); with atomics when D is split (ATOMIC), else with plain stores.

    Every stream is its own [SUB_T, BLOCK_D] tile (the generator unrolls the n streams), so all
    the arithmetic is elementwise in one register layout. SUB_TILES = 2 (pipelined loop only)
    sweeps the tile as two sub-tiles of SUB_T = TILE_T / 2 tokens, one after the other within each
    chunk: fn's block is loaded (and split) once for both, so fn is read once per TILE_T tokens
    while the register tiles stay SUB_T tall. The next chunk's inputs are loaded before this
    chunk is computed (register double-buffering: the loads' latency overlaps the arithmetic and
    the stores). Loops run over chunk numbers: every chunk starts at a known multiple of BLOCK_D
    (aligned, vectorised accesses), and the only partial chunk is D's last (masks against
    constexpr D). WAIT (PDL, job = program id): the first memory access of the program is here,
    after the set-up that needs none (_begin)."""
    SUB_T: tl.constexpr = TILE_T // SUB_TILES
$SUB_ROWS
    _begin(WAIT, trace_ptr, TRACE)
$SUB_SETUP
    if PIPELINE_STAGES > 0:
        # loads inside the loop; Triton's pipeliner keeps PIPELINE_STAGES - 1 chunks in flight
        # through shared memory (cp.async), not in registers
        for chunk in tl.range(c_begin, c_end, num_stages=PIPELINE_STAGES):
            $CUR_NAMES = _load_chunk(
                x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end,
                BLOCK_D, PRESPLIT, LEAVE_OUT)
            if SUB_TILES > 1:
                $CUR_NAMES_S1 = _load_streams(
                    x_ptr, y_ptr, rows64_s1, row_ok_s1, stride_xt, stride_xk, stride_yt, chunk, c_end, BLOCK_D)
$PIPELINED_BODY
    else:
        tl.static_assert(SUB_TILES == 1, "sub-tiles need the pipelined loop (PIPELINE_STAGES >= 2)")
        # register double-buffering: the next chunk's loads are issued before this one is computed
        $NEXT_NAMES = _load_chunk(
            x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, c_begin, c_end,
            BLOCK_D, PRESPLIT, LEAVE_OUT)
        for chunk in range(c_begin, c_end):
            $CUR_NAMES = $NEXT_NAMES
            $NEXT_NAMES = _load_chunk(
                x_ptr, y_ptr, fn_ptr, fns_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk + 1, c_end,
                BLOCK_D, PRESPLIT, LEAVE_OUT)
$BUFFERED_BODY
$SUB_FINISH


@triton.jit
def _add_partials(acc_ptr, csq_slot, T, tile, acc_copy, rows64, row_ok, acc, sumsq, csq, TILE_T: tl.constexpr,
                  ACC_COPIES: tl.constexpr, ATOMIC: tl.constexpr, CSQ_SLOT: tl.constexpr):
    """Add one sub-tile's partial sums into its tokens of copy `acc_copy` of the tile's accumulator
    block (_acc_block): [SUB_T, SLOT] of the projections, with sum X'^2 and sum c^2 in their columns.
    CSQ_SLOT: sum c^2 is stored into this job's slot `csq_slot` [TILE_T] instead (MONOTONIC)."""
    cols = tl.arange(0, SLOT)[None, :]
    part = tl.where(cols == SUMSQ_COL, sumsq[:, None], tl.where(cols == CSQ_COL, csq[:, None], acc))
    offs = cols * TILE_T + (rows64 - tile * TILE_T)[:, None]  # (token within the tile, column)
    acc_ptr = _in_copy(_acc_block(acc_ptr, tile, TILE_T, ACC_COPIES), acc_copy, TILE_T)
    if CSQ_SLOT:
        # plain stores, published by the arrival (a release) like the atomics
        tl.store(csq_slot + (rows64 - tile * TILE_T), csq, mask=row_ok)
    if ATOMIC:
        # relaxed: the tile's arrival (a release) publishes them. Masked by quads of tokens
        # (ATOMIC_QUAD), not tokens: a mask constant over each thread's four consecutive tokens
        # of a column lets them go as one vector atomic (sm_90 red.global.add.v4.f32: a quarter
        # of the atomics the L2 serves; with every token unmasked, the same atomics where T fills
        # its tiles, T=64 7.90 against 8.45 us and T=512 23.5 against 24.0 in one instance,
        # results/bench_mhc_runs/stop22_experiments.json). The padding tokens a quad adds are
        # zeros (stage A's loads mask them) and the merge clears the whole block; masking whole
        # quads past T keeps T=1's atomics as few as before (all 16 tokens: 5.17 against 4.73)
        quad_ok = (rows64 // ATOMIC_QUAD) * ATOMIC_QUAD < T
        added = CSQ_COL - 1 if CSQ_SLOT else CSQ_COL  # (CSQ_COL is the last column of partial sums)
        tl.atomic_add(acc_ptr + offs, part, mask=quad_ok[:, None] & (cols <= added), sem="relaxed")
    else:
        tl.store(acc_ptr + offs, part, mask=row_ok[:, None])


@triton.jit
def _acc_block(acc_ptr, tile, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """Token tile `tile`'s block of the accumulator: ACC_COPIES copies of [SLOT, TILE_T], one
    after the other, each column by column, so that one column of the tile's tokens is one 64-byte
    run and the merge's per-column loads touch a line each, not one per token (its (2+n)n + 1 loads
    of 16 tokens were 416 lines per warp, and every warp of the program issues them; on the H200
    T=1 6.34 -> 5.93 us, T=64 12.39 -> 12.10, T=512 25.49 -> 25.28, T=4096 152.1 -> 146.0).
    Stage-A job `part` of a tile adds into copy part % ACC_COPIES (LaunchConfig.acc_copies): the
    tile's atomics are spread over that many addresses, and the merge sums the copies."""
    return acc_ptr + tile.to(tl.int64) * (ACC_COPIES * SLOT * TILE_T)


@triton.jit
def _in_copy(ptrs, k, TILE_T: tl.constexpr):
    """`ptrs` into copy 0 of a tile's accumulator block, moved to the same places in copy k."""
    return ptrs + k * (SLOT * TILE_T)


@triton.jit
def _tile_column(acc_ptr, tile, col, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """Pointers to column `col` of copy 0 of the tile's accumulator block, one per token of the
    tile (other copies: _in_copy)."""
    return _acc_block(acc_ptr, tile, TILE_T, ACC_COPIES) + col * TILE_T + tl.arange(0, TILE_T)


@triton.jit
def _column_sum(column, row_ok, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """One column of a tile's partial sums, [TILE_T]: the sum of its copies (`column`: copy 0's
    pointers, _tile_column); plain loads, after the acquire that made the sums complete (_wait)."""
    total = tl.load(column, mask=row_ok, other=0.0)
    for k in tl.static_range(1, ACC_COPIES):
        total += tl.load(_in_copy(column, k, TILE_T), mask=row_ok, other=0.0)
    return total


@triton.jit
def _clear_copies(ptrs, mask, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """Zero these partial sums in every copy (for the next launch); `ptrs`: copy 0's, of one tile
    or several, any shape."""
    for k in tl.static_range(ACC_COPIES):
        tl.store(_in_copy(ptrs, k, TILE_T), tl.where(mask, 0.0, 0.0), mask=mask)


@triton.jit
def _tile_csq(acc_ptr, T, tile, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr):
    """The tile's sum(c^2) per token, from its accumulator block's CSQ_COL."""
    i = tl.arange(0, TILE_T)
    return _column_sum(_tile_column(acc_ptr, tile, CSQ_COL, TILE_T, ACC_COPIES), tile * TILE_T + i < T, TILE_T,
                       ACC_COPIES)


@triton.jit
def _csq_slot(csq_ptr, tile, part, TILE_T: tl.constexpr, CSQ_SLOTS: tl.constexpr):
    """Stage-A job `part`'s slot [TILE_T] of token tile `tile`'s sum(c^2) slots (MONOTONIC):
    csq_ptr is [n_tiles, CSQ_SLOTS, TILE_T], written by the launch's stage-A jobs before they
    arrive, read by its rescale jobs after; every slot read is written first."""
    return csq_ptr + (tile.to(tl.int64) * CSQ_SLOTS + part) * TILE_T


@triton.jit
def _slot_csq(csq_ptr, T, tile, TILE_T: tl.constexpr, CSQ_SLOTS: tl.constexpr, N_SPLITS: tl.constexpr):
    """The tile's sum(c^2) per token from its N_SPLITS stage-A jobs' slots (_csq_slot)."""
    i = tl.arange(0, TILE_T)
    part = tl.arange(0, CSQ_SLOTS)
    ok = (part < N_SPLITS)[:, None] & (tile * TILE_T + i < T)[None, :]
    return tl.reduce(tl.load(_csq_slot(csq_ptr, tile, part[:, None], TILE_T, CSQ_SLOTS) + i[None, :], mask=ok,
                             other=0.0), 0, _add)


@triton.jit
def _inv_rms(csq):
    """rms_normalize's 1/rms of the collapse, from its sum of squares over D."""
    return tl.rsqrt(csq / D + NORM_EPS)


@triton.jit
def _finish_tile(acc_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr, combo_ptr, ready_ptr, trace_ptr,
                 T, tile, TILE_T: tl.constexpr, ACC_COPIES: tl.constexpr, CLEAR: tl.constexpr,
                 KEEP_CSQ: tl.constexpr, PUBLISH: tl.constexpr, SINKHORN_FACTORS: tl.constexpr,
                 TRACE: tl.constexpr, INTERPRETED: tl.constexpr):
    """From the tile's full-row sums (its accumulator row): compute and store the coefficients,
    one [TILE_T] vector per coefficient (the generator unrolls n, n and n*n of them; Sinkhorn's
    row and column sums are then plain additions). CLEAR: zero the row again for the next launch,
    except sum(c^2) with KEEP_CSQ (epilogue jobs, carried pre: the rescale jobs read it, and the
    launch's last job zeroes it). PUBLISH (epilogue jobs, fresh pre): as soon as pre' is stored,
    set the tile's ready flag, so that the fresh collapse overlaps Sinkhorn (the merge's longest
    part) instead of following it. Returns 1/rms of the carried collapse [TILE_T] (zeros with
    KEEP_CSQ: the rescale jobs compute it, and sum(c^2) is not read here). SINKHORN_FACTORS: the
    rounds update row and column factors of the fixed softmax cells (LaunchConfig.sinkhorn_factors)."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    # column c of the tile's accumulator block at sums + c * TILE_T (copy 0; _column_sum adds the
    # copies)
    sums = _tile_column(acc_ptr, tile, 0, TILE_T, ACC_COPIES)
    if KEEP_CSQ:
        inv_c = tl.full([TILE_T], 0.0, dtype=tl.float32)
    else:
        inv_c = _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES))  # the carried collapse's
    if HAS_COEFFS:
        s_pre = tl.load(scale_ptr)
        s_post = tl.load(scale_ptr + 1)
        s_comb = tl.load(scale_ptr + 2)
$GATE_LINES
    if CLEAR:  # before any release: a fresh collapse's jobs add their sum(c^2) into this row
        tl.debug_barrier()  # every thread's reads of the row come first
        cols = tl.arange(0, SLOT)[None, :]
        kept = CSQ_COL if KEEP_CSQ else SLOT  # (no column is SLOT)
        # the whole block, padding tokens too (zero already: stage A masks them): a mask that is
        # constant along the tokens leaves the stores vectorised along them, as the merge's loads
        # are. Masked per token they were scalar stores, one 64-byte run per lane, issued by
        # every warp before Sinkhorn: each accumulator copy added ~0.17 us to the T=64 merge.
        _clear_copies(sums[:, None] + cols * TILE_T, tl.broadcast_to(cols != kept, [TILE_T, SLOT]), TILE_T,
                      ACC_COPIES)
    if PUBLISH:
        tl.debug_barrier()
        tl.atomic_xchg(ready_ptr, 1, sem="release")
        _stamp(trace_ptr, EV_READY, TRACE)
    if HAS_COEFFS:
$COMB_LINES
    return inv_c


@triton.jit
def _collapse(x_ptr, xo_ptr, u_ptr, pre_ptr, T, stride_xt, stride_xk, tile, c_begin, c_end,
              TILE_T: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr):
    """Fresh pre: c = hc_pre(X', pre') over chunks [c_begin, c_end), rounded and parked in u (a
    second sweep over X', which this launch wrote). Returns sum(c^2) over those columns."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    # pre' (stored by this tile's merge) as [TILE_T] columns
$FRESH_PRE_LINES
    csq = tl.full([TILE_T], 0.0, dtype=tl.float32)
    for chunk in range(c_begin, c_end):
        d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (d < D)[None, :]
        if HAS_POST:
            x_ptrs = xo_ptr + rows64[:, None] * ND + d[None, :]
$FRESH_XO_LINES
        else:
            x_ptrs = x_ptr + rows64[:, None] * stride_xt + d[None, :]
$FRESH_X_LINES
$F32_LINES
        collapsed = _round($COLLAPSE_EXPR, INTERPRETED)
        tl.store(u_ptr + rows64[:, None] * D + d[None, :], collapsed, mask=ok)
        cf = _widen(collapsed, INTERPRETED)
        csq += tl.reduce(cf * cf, 1, _add)
    return csq


@triton.jit
def _parked_block(u_ptr, w_ptr, rows64, row_ok, b, b_end, R_BLOCK: tl.constexpr):
    """Column block b of the parked collapse (stream dtype: half the registers of fp32 in flight)
    and of the norm weight; all masked past b_end."""
    d = b * R_BLOCK + tl.arange(0, R_BLOCK)
    d_ok = (d < D) & ((d * 0 + b) < b_end)
    collapsed = tl.load(u_ptr + rows64[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return collapsed, tl.load(w_ptr + d, mask=d_ok, other=0.0)


@triton.jit
def _rescale_part(u_ptr, w_ptr, T, tile, inv_c, part, R_PER_JOB: tl.constexpr, TILE_T: tl.constexpr,
                  R_BLOCK: tl.constexpr, RESCALE_STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    """_rescale over rescale part `part` of the tile: its R_PER_JOB blocks (fewer in D's last part)."""
    b_begin = part * R_PER_JOB
    _rescale(u_ptr, w_ptr, T, tile, inv_c, b_begin, tl.minimum(b_begin + R_PER_JOB, (D + R_BLOCK - 1) // R_BLOCK),
             TILE_T, R_BLOCK, RESCALE_STAGES, INTERPRETED)


@triton.jit
def _rescale(u_ptr, w_ptr, T, tile, inv_c, b_begin, b_end, TILE_T: tl.constexpr,
             R_BLOCK: tl.constexpr, RESCALE_STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    """u = (c * 1/rms) * norm_weight, in place on the parked collapse, over column blocks
    [b_begin, b_end) of R_BLOCK (wider than the sweep's chunks: this loop only streams).
    RESCALE_STAGES == 0: the next block is loaded before this one is stored (a load placed after a
    store waits for it, so without the prefetch the blocks' round trips follow one another): two
    blocks in flight. RESCALE_STAGES = k >= 2: the loads sit in a `tl.range` loop that Triton
    pipelines through shared memory (cp.async), k - 1 blocks ahead; the blocks never overlap, so
    issuing later blocks' loads before this block's store is safe."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    if RESCALE_STAGES > 0:
        for b in tl.range(b_begin, b_end, num_stages=RESCALE_STAGES):
            collapsed, w = _parked_block(u_ptr, w_ptr, rows64, row_ok, b, b_end, R_BLOCK)
            _store_rescaled(u_ptr, collapsed, w, inv_c, rows64, row_ok, b, R_BLOCK, INTERPRETED)
    else:
        next_c, next_w = _parked_block(u_ptr, w_ptr, rows64, row_ok, b_begin, b_end, R_BLOCK)
        for b in range(b_begin, b_end):
            collapsed, w = next_c, next_w
            next_c, next_w = _parked_block(u_ptr, w_ptr, rows64, row_ok, b + 1, b_end, R_BLOCK)
            _store_rescaled(u_ptr, collapsed, w, inv_c, rows64, row_ok, b, R_BLOCK, INTERPRETED)


@triton.jit
def _store_rescaled(u_ptr, collapsed, w, inv_c, rows64, row_ok, b, R_BLOCK: tl.constexpr,
                    INTERPRETED: tl.constexpr):
    """Column block b of u = (c * 1/rms) * norm_weight, rounded, over the parked collapse."""
    d = b * R_BLOCK + tl.arange(0, R_BLOCK)
    tl.store(u_ptr + rows64[:, None] * D + d[None, :], _rescaled(collapsed, w, inv_c, INTERPRETED),
             mask=row_ok[:, None] & (d < D)[None, :])


@triton.jit
def _rescaled(collapsed, w, inv_c, INTERPRETED: tl.constexpr):
    """u = (c * 1/rms) * norm_weight, rounded: `collapsed` [tokens, columns] (stream dtype), `w`
    [columns], `inv_c` [tokens]."""
    return _round(_widen(collapsed, INTERPRETED) * inv_c[:, None] * w[None, :], INTERPRETED)


@triton.jit
def _rescale_at_once(u_ptr, w_ptr, acc_ptr, csq_ptr, T, tile, part, failed, TILE_T: tl.constexpr,
                     PART_COLS: tl.constexpr, ACC_COPIES: tl.constexpr, CSQ_SLOTS: tl.constexpr,
                     N_SPLITS: tl.constexpr, INTERPRETED: tl.constexpr):
    """A rescale job's part (its R_PER_JOB blocks of R_BLOCK columns: PART_COLS, a power of two)
    as one [TILE_T, PART_COLS] block (LaunchConfig.rescale_at_once): the parked collapse and the
    norm weight are loaded before the tile's sum(c^2), so the three loads share one round trip
    (_rescale_part loads its first block only once 1/rms is known: two). NaN where `failed` (a
    corrupted sync state). sum(c^2) from the accumulator, or (CSQ_SLOTS > 0) the tile's slots."""
    rows = tile * TILE_T + tl.arange(0, TILE_T)
    row_ok = rows < T
    d = part * PART_COLS + tl.arange(0, PART_COLS)
    d_ok = d < D
    ok = row_ok[:, None] & d_ok[None, :]
    ptrs = u_ptr + rows.to(tl.int64)[:, None] * D + d[None, :]
    collapsed = tl.load(ptrs, mask=ok, other=0.0)
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0)
    if CSQ_SLOTS > 0:
        csq = _slot_csq(csq_ptr, T, tile, TILE_T, CSQ_SLOTS, N_SPLITS)
    else:
        csq = _tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES)
    inv_c = tl.where(failed, float("nan"), _inv_rms(csq))
    tl.store(ptrs, _rescaled(collapsed, w, inv_c, INTERPRETED), mask=ok)


@triton.jit
def _finish_inline(acc_ptr, x_ptr, xo_ptr, u_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr,
                   combo_ptr, T, stride_xt, stride_xk, tile, TILE_T: tl.constexpr,
                   BLOCK_D: tl.constexpr, N_CHUNKS: tl.constexpr, R_BLOCK: tl.constexpr,
                   RESCALE_STAGES: tl.constexpr, ACC_COPIES: tl.constexpr, CLEAR: tl.constexpr,
                   SINKHORN_FACTORS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Everything after stage A for one whole token tile, by one program."""
    tl.debug_barrier()  # this program's accumulator stores before its reloads
    inv_c = _finish_tile(acc_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr, combo_ptr, acc_ptr, acc_ptr,
                         T, tile, TILE_T, ACC_COPIES, CLEAR, False, False, SINKHORN_FACTORS, False, INTERPRETED)
    if FRESH:
        tl.debug_barrier()  # pre' (and this tile's X') before the collapse reads them
        csq = _collapse(x_ptr, xo_ptr, u_ptr, pre_ptr, T, stride_xt, stride_xk, tile, 0, N_CHUNKS,
                        TILE_T, BLOCK_D, INTERPRETED)
        inv_c = _inv_rms(csq)
    tl.debug_barrier()  # the parked collapse (stored by every thread) before its reloads
    _rescale(u_ptr, w_ptr, T, tile, inv_c, 0, (D + R_BLOCK - 1) // R_BLOCK, TILE_T, R_BLOCK, RESCALE_STAGES,
             INTERPRETED)


@triton.jit
def _arrive(counter_ptr):
    """Publish this program's writes (CTA barrier, then one acq_rel atomic at GPU scope, which is
    cumulative over what the barrier ordered) and return the arrival ticket. Acquire too: the last
    arrival goes on to read everyone's partial sums."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel")


@triton.jit
def _wait(counter_ptr, target, MAX_SPINS: tl.constexpr, MASK: tl.constexpr):
    """Spin (acquire) until the counter reaches target; True if it never does (corrupted sync
    state). What the releases published is then read with plain loads (by every thread: Triton's
    scalar atomic is one thread's, followed by a CTA barrier, the cooperative-groups grid-sync
    pattern; on sm_90 the acquire also invalidates the SM's L1, CCTL.IVALL). .cg loads, which
    sm_90 issues as strong GPU-scope loads (LDG.E.STRONG.GPU), measured slower on the H200
    (results/bench_mhc_runs/stop14_experiments.json). _arrive's acquire serves its merge alike.
    MASK: the count's bits of the counter (a sync word's low bits; -1 for a tile counter)."""
    value = tl.atomic_add(counter_ptr, 0, sem="acquire") & MASK
    spins = 0
    while (value < target) & (spins < MAX_SPINS):
        value = tl.atomic_add(counter_ptr, 0, sem="acquire") & MASK
        spins += 1
    return value < target


@triton.jit
def _await_predecessor():
    """PDL: wait until the stream's previous kernel's writes are visible (griddepcontrol.wait),
    then let the next kernel be scheduled in turn."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _begin(WAIT: tl.constexpr, trace_ptr, TRACE: tl.constexpr):
    """WAIT (a PDL launch whose jobs need no memory to be known): this program's first memory
    access comes next, so wait for the previous kernel's writes (griddepcontrol.wait), let the next
    kernel be scheduled, and stamp the start (and the job, known by now). Everything before it is
    arithmetic on program ids and arguments, which overlaps the previous kernel's end (T=64, sm_90:
    ~45 instructions of the stage-A jobs' set-up moved ahead of the wait)."""
    if WAIT:
        _await_predecessor()
        _stamp(trace_ptr, EV_START, TRACE)
        _stamp(trace_ptr, EV_CLAIMED, TRACE)


@triton.jit
def _stamp(trace_ptr, event, TRACE: tl.constexpr):
    """TRACE: record the GPU's %globaltimer (ns) as `event` of this program's trace row (what
    tools/bench_mhc.py --trace reads: where a launch's time goes). Compiled out otherwise."""
    if TRACE:
        now = tl.inline_asm_elementwise("mov.u64 $$0, %globaltimer;", "=l,r", [tl.program_id(0)],
                                        dtype=tl.int64, is_pure=False, pack=1)
        tl.store(trace_ptr + tl.program_id(0) * TRACE_EVENTS + event, now)


@triton.jit
def _note_job(trace_ptr, job, role, TRACE: tl.constexpr):
    """TRACE: record which job this program ran, its role (ROLE_*) and its SM."""
    if TRACE:
        row = trace_ptr + tl.program_id(0) * TRACE_EVENTS
        tl.store(row + EV_JOB, job.to(tl.int64))
        tl.store(row + EV_ROLE, role)
        sm = tl.inline_asm_elementwise("mov.u32 $$0, %smid;", "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(row + EV_SM, sm.to(tl.int64))


@triton.jit
def _epilogue_job(job, n_a, n_c, n_jobs, N_SPLITS: tl.constexpr, R_SPLITS: tl.constexpr):
    """(role, token tile, part) of epilogue-mode job `job`, in claim order: every stage-A job, then
    (fresh pre) every collapse job, then every rescale job; part is the D slice of a stage-A or
    collapse job, the block group of a rescale job. Every job a job waits for has a smaller
    number (see "forward progress"). Past the last job (only with a corrupted sync state) the
    role is -1: no work. n_a, n_c, n_jobs: the stage-A, collapse and all jobs of the launch."""
    role = tl.where(job < n_a, ROLE_STAGE_A, tl.where(job < n_a + n_c, ROLE_COLLAPSE, ROLE_RESCALE))
    role = tl.where(job < n_jobs, role, -1)
    q = tl.where(job < n_a, job, tl.where(job < n_a + n_c, job - n_a, job - n_a - n_c))
    per_tile = tl.where(role == ROLE_RESCALE, R_SPLITS, N_SPLITS)
    return role, q // per_tile, q % per_tile


@triton.jit(do_not_specialize=["T", "n_tiles"])  # one binary for every T
def mega_mhc_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, base_ptr, scale_ptr, w_ptr,
                    xo_ptr, u_ptr, pre_ptr, posto_ptr, combo_ptr, acc_ptr, ws_ptr, sync_ptr, tiles_ptr, csq_ptr,
                    trace_ptr, T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre, n_tiles,
                    TILE_T: tl.constexpr, SUB_TILES: tl.constexpr, BLOCK_D: tl.constexpr, N_CHUNKS: tl.constexpr,
                    SPLIT_CHUNKS: tl.constexpr, N_SPLITS: tl.constexpr, R_BLOCK: tl.constexpr,
                    R_PER_JOB: tl.constexpr, R_SPLITS: tl.constexpr, PIPELINE_STAGES: tl.constexpr,
                    RESCALE_STAGES: tl.constexpr, ACC_COPIES: tl.constexpr, PRESPLIT: tl.constexpr,
                    CO_RESIDENT: tl.constexpr, HANDOFF: tl.constexpr, JOB_ROTATE: tl.constexpr,
                    SINKHORN_FACTORS: tl.constexpr, RESCALE_AT_ONCE: tl.constexpr, PART_COLS: tl.constexpr,
                    CSQ_SLOTS: tl.constexpr, INTERPRETED: tl.constexpr, MAX_SPINS: tl.constexpr,
                    TRACE: tl.constexpr, LEAVE_OUT: tl.constexpr, PDL: tl.constexpr):
    """Grid (1-D); D is N_CHUNKS chunks of BLOCK_D, a stage-A job takes SPLIT_CHUNKS of them.

    tiled        (N_SPLITS == 1)                 n_tiles programs, job = program id
    last arrival (N_SPLITS > 1, R_SPLITS == 0)   n_tiles * N_SPLITS programs, job = program id
    epilogue jobs (N_SPLITS > 1, R_SPLITS > 0)   n_tiles * N_SPLITS stage-A jobs, (fresh)
        n_tiles * N_SPLITS collapse jobs, n_tiles * R_SPLITS rescale jobs of R_PER_JOB blocks of
        R_BLOCK columns, claimed in start order, or with CO_RESIDENT (every program resident at once:
        a cooperative launch) or HANDOFF (carried pre: a rescale job that waits MAX_SPINS hands its
        blocks to the tile's last arrival) job = (program id + JOB_ROTATE) % jobs (see "forward
        progress" in megafuse.lowering.mega_mhc; JOB_ROTATE, HANDOFF only, tests that order)

    fns_ptr: with PRESPLIT, fn already split into bf16 pieces by mega_mhc_split_fn (else unused).
    acc_ptr: [n_tiles, ACC_COPIES, SLOT, TILE_T] partial sums (_acc_block; split: persistent, all
    zero between launches; stage-A job `part` of a tile adds into copy part % ACC_COPIES);
    ws_ptr: 1/rms per token [n_tiles * TILE_T] (epilogue-job mode).
    trace_ptr: [programs, TRACE_EVENTS] int64 when TRACE (else unused): EV_* timestamps per program.
    LEAVE_OUT: 0, or a timing diagnostic's LEAVE_* bits (stage A parts compiled out; wrong outputs).
    PDL: launched as a programmatic dependent launch (LaunchConfig.pdl): no memory access before
    griddepcontrol.wait, which comes first where jobs are claimed and otherwise just before each
    program's first access (_begin).
    CSQ_SLOTS > 0: MONOTONIC (epilogue jobs, carried pre, every program resident at once, no
    handoff): nothing is reset at the launch's end. Each token tile's two int64 counters in
    tiles_ptr only grow: ARRIVE (stage-A arrivals, N_SPLITS a launch) and RESCALE (rescale jobs'
    tickets, R_SPLITS a launch). A rescale job's ticket gives its launch's number L (ticket //
    R_SPLITS: every earlier launch took exactly R_SPLITS of them), so it waits for ARRIVE to
    reach (L + 1) * N_SPLITS, and a stage-A arrival is the tile's last when its ticket is
    N_SPLITS - 1 mod N_SPLITS. sum(c^2) goes to per-job slots (csq_ptr [n_tiles, CSQ_SLOTS,
    TILE_T], a launch's own buffer), not into the accumulator, which the merge clears as always.
    So no job ends in the launch-wide end count's round trip (~0.5 us after a rescale job's
    stores at T=64); int64 counters cannot wrap (N_SPLITS per launch).
    """
    # PDL: scheduled while the stream's previous kernel may still run, so nothing may touch memory
    # (every input, and the sync state the previous seam launch left zeroed) before the wait for
    # its writes. Where a job is known without memory (LATE: job = program id), each program
    # computes its job and its addresses first and waits just before its first access (_begin),
    # so that set-up overlaps the predecessor's end; a claimed job waits before its claim.
    CLAIMED: tl.constexpr = N_SPLITS > 1 and R_SPLITS > 0 and not HANDOFF and not CO_RESIDENT
    LATE: tl.constexpr = PDL and not CLAIMED
    if not LATE:
        if PDL:
            _await_predecessor()
        _stamp(trace_ptr, EV_START, TRACE)
    if N_SPLITS == 1:
        # tiled: one program per token tile, nothing shared
        tile = tl.program_id(0)
        _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr, csq_ptr,
                 T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
                 tile, 0, N_CHUNKS, 0, TILE_T, SUB_TILES, BLOCK_D, ACC_COPIES, False, PIPELINE_STAGES,
                 PRESPLIT, LEAVE_OUT, False, LATE, trace_ptr, TRACE, INTERPRETED)
        _note_job(trace_ptr, tile, ROLE_TILED, TRACE)
        _stamp(trace_ptr, EV_WORK, TRACE)
        _finish_inline(acc_ptr, x_ptr, xo_ptr, u_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr,
                       combo_ptr, T, stride_xt, stride_xk, tile, TILE_T, BLOCK_D, N_CHUNKS, R_BLOCK,
                       RESCALE_STAGES, ACC_COPIES, False, SINKHORN_FACTORS, INTERPRETED)
        _stamp(trace_ptr, EV_FINISHED, TRACE)
    elif R_SPLITS == 0:
        # split, the last arrival finishes the tile: nothing ever waits, so program ids are job ids
        job = tl.program_id(0)
        tile = job // N_SPLITS
        part = job % N_SPLITS
        c_begin = part * SPLIT_CHUNKS
        _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr, csq_ptr,
                 T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
                 tile, c_begin, tl.minimum(c_begin + SPLIT_CHUNKS, N_CHUNKS), part % ACC_COPIES, TILE_T, SUB_TILES,
                 BLOCK_D, ACC_COPIES, True, PIPELINE_STAGES, PRESPLIT, LEAVE_OUT, False, LATE, trace_ptr, TRACE,
                 INTERPRETED)
        _note_job(trace_ptr, job, ROLE_STAGE_A, TRACE)
        _stamp(trace_ptr, EV_WORK, TRACE)
        arrive_a = sync_ptr + TILE_SYNC + tile * 4 + ARRIVE_A
        ticket = _arrive(arrive_a)
        _stamp(trace_ptr, EV_ARRIVED, TRACE)
        if ticket == N_SPLITS - 1:
            _finish_inline(acc_ptr, x_ptr, xo_ptr, u_ptr, w_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr,
                           combo_ptr, T, stride_xt, stride_xk, tile, TILE_T, BLOCK_D, N_CHUNKS, R_BLOCK,
                           RESCALE_STAGES, ACC_COPIES, True, SINKHORN_FACTORS, INTERPRETED)
            tl.atomic_xchg(arrive_a, 0, sem="relaxed")  # every arrival of this tile is in
            _stamp(trace_ptr, EV_FINISHED, TRACE)
    else:
        # split with epilogue jobs (see "forward progress"): job = program id (handoff, or every
        # program resident at once), or jobs claimed in start order
        n_a = n_tiles * N_SPLITS
        n_c = n_a if FRESH else 0
        n_jobs = n_a + n_c + n_tiles * R_SPLITS
        if HANDOFF:
            job = (tl.program_id(0) + JOB_ROTATE) % n_jobs
        elif CO_RESIDENT:
            job = tl.program_id(0)
        else:
            job = tl.atomic_add(sync_ptr + JOB_COUNTER, 1, sem="relaxed")
        if not LATE:  # (LATE: _begin stamps it)
            _stamp(trace_ptr, EV_CLAIMED, TRACE)
        inv_ws = ws_ptr
        role, tile, part = _epilogue_job(job, n_a, n_c, n_jobs, N_SPLITS, R_SPLITS)
        MONOTONIC: tl.constexpr = CSQ_SLOTS > 0
        done = tl.full([], 1, tl.int32)  # this program's part of the end-of-launch count (below)
        if role == ROLE_STAGE_A:
            sync = sync_ptr + TILE_SYNC + tile * 4
            c_begin = part * SPLIT_CHUNKS
            _sweep_a(x_ptr, y_ptr, post_ptr, comb_ptr, cpre_ptr, fn_ptr, fns_ptr, xo_ptr, u_ptr, acc_ptr,
                     _csq_slot(csq_ptr, tile, part, TILE_T, CSQ_SLOTS),
                     T, stride_xt, stride_xk, stride_yt, stride_post, stride_comb, stride_cpre,
                     tile, c_begin, tl.minimum(c_begin + SPLIT_CHUNKS, N_CHUNKS), part % ACC_COPIES, TILE_T,
                     SUB_TILES, BLOCK_D, ACC_COPIES, True, PIPELINE_STAGES, PRESPLIT, LEAVE_OUT, MONOTONIC,
                     LATE, trace_ptr, TRACE, INTERPRETED)
            _note_job(trace_ptr, job, ROLE_STAGE_A, TRACE)
            _stamp(trace_ptr, EV_WORK, TRACE)
            if MONOTONIC:
                ticket = _arrive(tiles_ptr + tile * 2 + TILE_ARRIVE) % N_SPLITS
            else:
                ticket = _arrive(sync + ARRIVE_A)
            _stamp(trace_ptr, EV_ARRIVED, TRACE)
            if (ticket & COUNT_MASK) == N_SPLITS - 1:
                # carried pre: nothing waits for this merge (the rescale jobs wait for the tile's
                # arrivals and read sum(c^2) themselves); fresh: the collapse jobs wait for pre'
                _finish_tile(acc_ptr, base_ptr, scale_ptr, pre_ptr, posto_ptr, combo_ptr, sync + READY_A,
                             trace_ptr, T, tile, TILE_T, ACC_COPIES, True, not FRESH, FRESH, SINKHORN_FACTORS,
                             TRACE, INTERPRETED)
                done = tl.full([], 0, tl.int32)
                if HANDOFF:
                    # the rescale parts whose jobs stopped waiting before this arrival (their bits
                    # came with the ticket): this program does them, and counts them as done
                    handed = ticket >> HANDOFF_SHIFT
                    if handed != 0:
                        inv_c = _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES))
                        for p in range(R_SPLITS):
                            if ((handed >> p) & 1) != 0:
                                _rescale_part(u_ptr, w_ptr, T, tile, inv_c, p, R_PER_JOB, TILE_T, R_BLOCK,
                                              RESCALE_STAGES, INTERPRETED)
                                done += 1
                _stamp(trace_ptr, EV_FINISHED, TRACE)
        elif role == ROLE_COLLAPSE:
            # fresh: collapse this slice with pre' (stored by the tile's merge); sum(c^2) by atomics
            _begin(LATE, trace_ptr, TRACE)
            _note_job(trace_ptr, job, ROLE_COLLAPSE, TRACE)
            sync = sync_ptr + TILE_SYNC + tile * 4
            failed = _wait(sync + READY_A, 1, MAX_SPINS, COUNT_MASK)
            _stamp(trace_ptr, EV_READY, TRACE)
            c_begin = part * SPLIT_CHUNKS
            csq = _collapse(x_ptr, xo_ptr, u_ptr, pre_ptr, T, stride_xt, stride_xk, tile, c_begin,
                            tl.minimum(c_begin + SPLIT_CHUNKS, N_CHUNKS), TILE_T, BLOCK_D, INTERPRETED)
            csq = tl.where(failed, float("nan"), csq)
            rows = tile * TILE_T + tl.arange(0, TILE_T)
            csq_ptrs = _tile_column(acc_ptr, tile, CSQ_COL, TILE_T, ACC_COPIES)
            tl.atomic_add(_in_copy(csq_ptrs, part % ACC_COPIES, TILE_T), csq, mask=rows < T, sem="relaxed")
            _stamp(trace_ptr, EV_WORK, TRACE)
            ticket = _arrive(sync + ARRIVE_C)
            _stamp(trace_ptr, EV_ARRIVED, TRACE)
            if ticket == N_SPLITS - 1:
                tl.store(inv_ws + tile * TILE_T + tl.arange(0, TILE_T),
                         _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES)))
                tl.debug_barrier()
                _clear_copies(csq_ptrs, rows < T, TILE_T, ACC_COPIES)  # for the next launch
                tl.atomic_xchg(sync + READY_C, 1, sem="release")
                _stamp(trace_ptr, EV_FINISHED, TRACE)
        elif role == ROLE_RESCALE:  # (else no job: only if the sync state was corrupted)
            _begin(LATE, trace_ptr, TRACE)
            _note_job(trace_ptr, job, ROLE_RESCALE, TRACE)
            sync = sync_ptr + TILE_SYNC + tile * 4
            if FRESH:
                failed = _wait(sync + READY_C, 1, MAX_SPINS, COUNT_MASK)
                _stamp(trace_ptr, EV_READY, TRACE)
                inv_c = tl.load(inv_ws + tile * TILE_T + tl.arange(0, TILE_T))
            else:
                # every stage-A job of the tile has arrived (each a release): sum(c^2) is complete,
                # so the rescale need not wait for the tile's merge (coefficients, Sinkhorn)
                if MONOTONIC:
                    tile_ctr = tiles_ptr + tile * 2
                    launch = tl.atomic_add(tile_ctr + TILE_RESCALE, 1, sem="relaxed") // R_SPLITS
                    failed = _wait(tile_ctr + TILE_ARRIVE, (launch + 1) * N_SPLITS, MAX_SPINS, -1)
                else:
                    failed = _wait(sync + ARRIVE_A, N_SPLITS, MAX_SPINS, COUNT_MASK)
                if HANDOFF:
                    if failed:
                        # hand this part to the tile's last arrival, unless that has come meanwhile
                        # (its ticket, the same atomic word, then carried no bit: do it here)
                        bit = tl.full([], 1, tl.int32) << (HANDOFF_SHIFT + part)
                        failed = (tl.atomic_add(sync + ARRIVE_A, bit, sem="acq_rel") & COUNT_MASK) < N_SPLITS
                        done = tl.where(failed, 0, 1)
                _stamp(trace_ptr, EV_READY, TRACE)
                if not RESCALE_AT_ONCE:
                    if MONOTONIC:
                        inv_c = _inv_rms(_slot_csq(csq_ptr, T, tile, TILE_T, CSQ_SLOTS, N_SPLITS))
                    else:
                        inv_c = _inv_rms(_tile_csq(acc_ptr, T, tile, TILE_T, ACC_COPIES))
            if RESCALE_AT_ONCE:  # (carried pre only)
                if done != 0:  # (HANDOFF: 0 where the part was handed off)
                    _rescale_at_once(u_ptr, w_ptr, acc_ptr, csq_ptr, T, tile, part, failed & (not HANDOFF), TILE_T,
                                     PART_COLS, ACC_COPIES, CSQ_SLOTS, N_SPLITS, INTERPRETED)
            else:
                if not HANDOFF:
                    inv_c = tl.where(failed, float("nan"), inv_c)
                if done != 0:  # (HANDOFF: 0 where the part was handed off)
                    _rescale_part(u_ptr, w_ptr, T, tile, inv_c, part, R_PER_JOB, TILE_T, R_BLOCK, RESCALE_STAGES,
                                  INTERPRETED)
            _stamp(trace_ptr, EV_WORK, TRACE)
        else:  # no job: a claim past the last, only with a corrupted sync state; it still counts below
            _begin(LATE, trace_ptr, TRACE)
        # The last job to finish restores the all-zero state: every job number has been claimed
        # and every wait of this launch is over. Relaxed: nothing is published through this
        # counter (every thread's waits are over at the barrier, and the next launch is
        # stream-ordered after this one), so it skips the release fence, ~0.3 us at the launch's end.
        # The tiles' last stage-A arrivals count nothing: once a tile's arrivals are in, its merge
        # reads and writes nothing another job or this reset touches (its accumulator row apart
        # from sum(c^2), which it clears itself; its own outputs), and the reset needs every
        # other job of the tile done (the rescale jobs, after the arrivals; fresh: the collapse
        # jobs, after the merge's publish): so the merge's Sinkhorn does not end in an atomic's
        # round trip. Carried pre: the rescale jobs read sum(c^2), so this reset zeroes it.
        # HANDOFF: a rescale job handed to the last arrival is counted by that program, after it
        # (it reads sum(c^2) too), not by the job's own.
        if done != 0 and not MONOTONIC:  # (MONOTONIC: nothing to restore)
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + DONE_COUNTER, done, sem="relaxed") + done == n_jobs - n_tiles:
                for i in range(0, n_tiles * 4, 1024):
                    offs = i + tl.arange(0, 1024)
                    tl.store(sync_ptr + TILE_SYNC + offs, tl.full([1024], 0, dtype=tl.int32),
                             mask=offs < n_tiles * 4)
                if not FRESH:
                    for i in range(0, n_tiles * TILE_T, 1024):
                        offs = i + tl.arange(0, 1024)
                        _clear_copies(_acc_block(acc_ptr, offs // TILE_T, TILE_T, ACC_COPIES) + CSQ_COL * TILE_T
                                      + offs % TILE_T, offs < n_tiles * TILE_T, TILE_T, ACC_COPIES)
                tl.atomic_xchg(sync_ptr + JOB_COUNTER, 0, sem="relaxed")
                tl.atomic_xchg(sync_ptr + DONE_COUNTER, 0, sem="relaxed")
    _stamp(trace_ptr, EV_END, TRACE)
''')

# The body of stage A's loop over chunks (indented for a loop body at 8 spaces); the template
# places it in both loop forms (register double-buffering and Triton-pipelined).
_CHUNK_BODY = string.Template('''\
d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
$SUB_BODY
if SUB_TILES > 1:
$SUB_BODY_S1
if HAS_COEFFS:
    if (LEAVE_DOTS & LEAVE_OUT) == 0:
$PROJECT_LINES
''')

# One sub-tile's share of a chunk (names suffixed per sub-tile by the generator; fn's block and d
# are shared).
_SUB_BODY = string.Template('''\
ok$S = row_ok$S[:, None] & (d < D)[None, :]  # [SUB_T, BLOCK_D]
if HAS_POST:
$POST_LINES
# every later step reads the rounded X', like the reference
$F32_LINES
if HAS_COEFFS:
    sumsq$S += tl.reduce($SUMSQ_EXPR, 1, _add)
if not FRESH:
    # hc_pre with the carried pre, rounded like the reference; parked in u until the
    # norm's statistic (the whole row) is known
    collapsed = _round($COLLAPSE_EXPR, INTERPRETED)
    # evict_last: the rescale reads it back at the tile's end; the streams (loads and X')
    # are evict_first, so at large T the parked collapse is what stays in L2
    if (LEAVE_PARKED_STORE & LEAVE_OUT) == 0:
        tl.store(u_ptr + rows64$S[:, None] * D + d[None, :], collapsed, mask=ok$S, eviction_policy="evict_last")
    cf = _widen(collapsed, INTERPRETED)
    csq$S += tl.reduce(cf * cf, 1, _add)
''')

# The projection, per stream dtype: the helpers stage A's loads and dots use, and (bf16) the
# kernel that splits fn once per launch.
_PROJECT_BF16 = '''\
@triton.jit
def _split(w, INTERPRETED: tl.constexpr):
    """fp32 -> two bf16 pieces, hi + lo = w to 16 of fp32's 24 mantissa bits (per-element
    relative error <= 2^-16; the residual w - hi is exact in fp32 before it is rounded). Both are
    rounded to nearest even in both modes (_round), so the interpreter's pieces are the GPU's."""
    hi = _round(w, INTERPRETED)
    lo = _round(w - _widen(hi, INTERPRETED), INTERPRETED)
    return hi, lo


@triton.jit
def _project(acc, xs, fa, fb, PRESPLIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc [TILE_T, SLOT] += xs [TILE_T, BLOCK_D] @ fn^T's block [BLOCK_D, SLOT] for one stream's
    chunk, as two bf16 tensor-core dots (hi, lo pieces; see _split) with fp32 accumulation (X' is
    exactly bf16). The block as _load_chunk loaded it: (hi, lo) with PRESPLIT, else (the fp32
    block, the same again), split here, next to its use (splitting at load time instead keeps
    both pieces of the prefetched chunk live: 255 registers and spills at 16x64 on sm_90). The
    coefficients differ from an fp32 GEMM by ~1e-7 (fp32 summation noise); a third piece would
    make fn exact but costs registers the sweep needs."""
    if PRESPLIT:
        hi, lo = fa, fb
    else:
        hi, lo = _split(fa, INTERPRETED)
    if INTERPRETED:  # numpy cannot multiply bf16; bf16 values are exact in fp32
        xs32 = xs.to(tl.float32)
        acc = tl.dot(xs32, hi.to(tl.float32), acc)
        acc = tl.dot(xs32, lo.to(tl.float32), acc)
    else:
        acc = tl.dot(xs, hi, acc)
        acc = tl.dot(xs, lo, acc)
    return acc


@triton.jit
def mega_mhc_split_fn(fn_ptr, fns_ptr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    """fn [WIDTH, ND] fp32 -> fns [2, SLOT, ND] bf16: hi pieces, then lo pieces (_split); rows past
    WIDTH are neither written nor read. Grid (cdiv(ND, BLOCK), WIDTH). Launched before a PRESPLIT
    seam launch, so that its token tiles load fn's pieces instead of each splitting fn again (at
    T=4096, 256 times)."""
    row = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < ND
    w = tl.load(fn_ptr + row * ND + cols, mask=ok, other=0.0)
    hi, lo = _split(w, INTERPRETED)
    tl.store(fns_ptr + row * ND + cols, hi, mask=ok)
    tl.store(fns_ptr + (SLOT + row) * ND + cols, lo, mask=ok)
'''

_PROJECT_FP32 = '''\
@triton.jit
def _project(acc, xs, w, INTERPRETED: tl.constexpr):
    """acc [TILE_T, SLOT] += xs [TILE_T, BLOCK_D] @ w [BLOCK_D, SLOT]: one stream's chunk against
    the matching block of fn^T, fp32 x fp32 on tensor cores with 3xTF32 (big*big + big*small +
    small*big): fp32-level accuracy.$PROJECT_FP16_NOTE"""
    acc = tl.dot(xs, w, acc, input_precision="tf32x3")
    return acc
'''

_GENERATOR_FINGERPRINT = hashlib.sha1(
    (_TEMPLATE.template + _CHUNK_BODY.template + _SUB_BODY.template + _PROJECT_BF16 + _PROJECT_FP32
     + "gen-v9").encode()).hexdigest()


def _fmt_float(x: float) -> str:
    """A Python literal that round-trips to the same float (repr is exact for Python floats)."""
    return repr(float(x))


def _constants(spec: MhcSpec) -> str:
    width = spec.width()
    rows = [
        ("N", spec.n, "residual streams"),
        ("D", spec.dim, "hidden size"),
        ("ND", spec.n * spec.dim, "n*D: the width of the coefficient statistic and of fn's rows"),
        ("WIDTH", width, "(2+n)n rows of fn: [pre n | post n | comb n*n]"),
        ("SLOT", _slot_width(spec.n), "accumulator row / projection width: power of two >= WIDTH + 2"),
        ("SUMSQ_COL", width, "accumulator column: sum of X'^2 (all streams)"),
        ("CSQ_COL", width + 1, "accumulator column: sum of c^2"),
        ("SINKHORN_ITERS", spec.sinkhorn_iters, ""),
        ("HC_EPS", _fmt_float(spec.hc_eps), ""),
        ("STAT_EPS", _fmt_float(spec.stat_eps), "eps of the coefficient statistic mean(X'^2)"),
        ("NORM_EPS", _fmt_float(spec.norm_eps), "eps of the sublayer RMSNorm"),
        ("HAS_POST", spec.has_post, "apply the previous sublayer's post (else X' = X)"),
        ("HAS_COEFFS", spec.has_coefficients, "compute pre', post', comb' of the next site"),
        ("FRESH", spec.pre == "fresh", "collapse with pre' (V4) instead of the carried pre (V4.1)"),
        ("IS_BF16", spec.stream_dtype == "bfloat16",
         "stream dtype bf16 (else fp16)" if spec.stream_dtype == "float16" else "stream dtype bf16 (else fp32)"),
    ]
    lines = []
    for name, value, comment in rows:
        code = f"{name} = tl.constexpr({value})"
        lines.append(f"{code:<36}# {comment}" if comment else code)
    return "\n".join(lines)


def _gate_lines(spec: MhcSpec) -> list[str]:
    """The merge's loads and pre' (inside `if HAS_COEFFS:` of _finish_tile, before the tile is
    published: a fresh collapse needs pre'). The accumulator's columns become [TILE_T] vectors
    m_0 .. m_WIDTH (the projections, then sum X'^2)."""
    width = spec.width()
    slot = _slot_width(spec.n)
    bits = (slot - 1).bit_length()
    out = ["# every load first: a load placed after a store waits for that store to issue (the",
           "# compiler cannot tell the two do not alias), so loads interleaved with the stores below",
           "# made this merge a chain of L2 round trips (~4.5 us of a 10 us launch on the H200)",
           "if ACC_COPIES > 1:",
           "    # the gates' biases before the block: loaded after it, they were issued only after the",
           "    # block's transpose (its shared-memory barrier), a second round trip (T=64 8.98 against",
           "    # 9.21 us; at T=1, one copy, this order measured ~0.15 us slower: there they stay last)"]
    biases = [f"b_{c} = tl.load(base_ptr + {c})" for c in range(width)]
    out += ["    " + line for line in biases]
    out += ["    # the tile's block, one [TILE_T, SLOT] load a copy, summed, then split into its columns in",
            "    # registers (tl.split halves the last dimension: even and odd columns). Per-column [TILE_T]",
            "    # loads are issued by every warp of the program alike (each thread holds every token's",
            "    # value): 4x the loads, and T=64 measured 9.74 against 9.56 us with them (stop15_",
            "    # experiments.json). With one copy they stay: at T=1 most of the block is padding tokens",
            "    # that the masked column loads skip (5.84 against 5.94 us).",
            "    blk_offs = sums[:, None] + tl.arange(0, SLOT)[None, :] * TILE_T",
            "    blk = tl.load(blk_offs)",
            "    for k in tl.static_range(1, ACC_COPIES):",
            "        blk += tl.load(_in_copy(blk_offs, k, TILE_T))"]
    # blk_<b0 b1 ...>: the columns whose low bits are b0, b1, ... (the last level is [TILE_T]);
    # halves no column 0..WIDTH lies in are not split
    paths = {c: "".join(str((c >> b) & 1) for b in range(bits)) for c in range(width + 1)}
    level = [("blk", "")]
    for depth in range(bits):
        cols_left = slot >> (depth + 1)
        halves = []
        for name, path in level:
            shaped = name if cols_left == 1 else f"tl.reshape({name}, [TILE_T, {cols_left}, 2])"
            out.append(f"    blk_{path}0, blk_{path}1 = tl.split({shaped})")
            halves += [(f"blk_{path}{b}", path + b) for b in "01"
                       if any(p.startswith(path + b) for p in paths.values())]
        level = halves
    out += [f"    m_{c} = blk_{path}" for c, path in paths.items()]
    out.append("else:")
    out += [f"    m_{c} = _column_sum(sums + {c} * TILE_T, row_ok, TILE_T, ACC_COPIES)" for c in range(width + 1)]
    out += ["    " + line for line in biases]
    out.append("# r scales the projection instead of the input: one scalar per token, over all n*D values")
    out.append(f"r = tl.rsqrt(m_{width} / ND + STAT_EPS)  # (column {width}: sum X'^2)")
    out.append("# pre' = sigmoid(m * r * scale0 + base) + eps")
    out += [f"tl.store(pre_ptr + rows64 * N + {k}, _sigmoid(m_{k} * r * s_pre + b_{k}, INTERPRETED) + HC_EPS, "
            "mask=row_ok)" for k in range(spec.n)]
    return out


# Sinkhorn's rounds after the first run in a loop of SINKHORN_UNROLL rounds a trip (unrolled in the
# loop body), the remainder unrolled after it: on the H200 at T=64 9.41 against 9.56 us for a loop of
# one round a trip (results/bench_mhc_runs/stop15_experiments.json). Unrolling all of them measured
# faster still but made each build ~10x slower (Triton's coalescing pass: stop14_experiments.json);
# four rounds a trip build in ~2x the time. With the rounds on factors (the T=1 and T=64 rows) more
# unrolling gained nothing: T=64 8.37 us with 4 or 8 rounds a trip and 8.60 with all 19 (each with
# the eps-first chain of _factor_rounds' docstring), and the sm_90 build of all 19 takes 27 s
# against 7 (stop19_experiments.json).
SINKHORN_UNROLL = 4


def _comb_lines(spec: MhcSpec) -> list[str]:
    """post' and comb' (inside the second `if HAS_COEFFS:` of _finish_tile, after the tile is
    published): Sinkhorn unrolled on [TILE_T] vectors."""
    n = spec.n
    ks = range(n)
    out = ["# post' = 2 sigmoid(m * r * scale1 + base)"]
    out += [f"tl.store(posto_ptr + rows64 * N + {k}, 2.0 * _sigmoid(m_{n + k} * r * s_post + b_{n + k}, "
            "INTERPRETED), mask=row_ok)" for k in ks]
    out.append("# comb logits c_i_j, then Sinkhorn exactly as the reference truncates it: softmax over j")
    out.append("# (+eps), divide by column sums (+eps), then SINKHORN_ITERS-1 rounds of (rows, columns)")
    for i in ks:
        for j in ks:
            c = 2 * n + i * n + j
            out.append(f"c_{i}_{j} = m_{c} * r * s_comb + b_{c}")
    for i in ks:
        row = [f"c_{i}_{j}" for j in ks]
        out.append(f"mx = {_max_expr(row)}")
        for j in ks:
            out.append(f"c_{i}_{j} = _exp(c_{i}_{j} - mx, INTERPRETED)")
        out.append(f"inv = _reciprocal({_tree_sum(row)}, INTERPRETED)")
        for j in ks:
            out.append(f"c_{i}_{j} = c_{i}_{j} * inv + HC_EPS")
    out.append("if SINKHORN_FACTORS:")
    out += ["    " + line for line in _factor_rounds(n)]
    out.append("else:")
    out += _normalise_lines(n, "col", 4)
    out.append(f"    for _ in range((SINKHORN_ITERS - 1) // {SINKHORN_UNROLL}):")
    out.append(f"        for _ in tl.static_range({SINKHORN_UNROLL}):")
    out += _normalise_lines(n, "row", 12)
    out += _normalise_lines(n, "col", 12)
    out.append(f"    for _ in tl.static_range((SINKHORN_ITERS - 1) % {SINKHORN_UNROLL}):")
    out += _normalise_lines(n, "row", 8)
    out += _normalise_lines(n, "col", 8)
    for i in ks:
        for j in ks:
            out.append(f"tl.store(combo_ptr + rows64 * (N * N) + {i * n + j}, c_{i}_{j}, mask=row_ok)")
    return out


def _factor_rounds(n: int) -> list[str]:
    """Sinkhorn from the softmax cells c_i_j on, as row factors a_i and column factors b_j of those
    cells, kept fixed (K): the cells after any round are K_ij a_i b_j. The reference's row step
    divides each row by its sum + eps: a_i <- a_i / (a_i (K b)_i + eps), which is 1/a_i <-
    (K b)_i + eps / a_i, one fused multiply-add on the reciprocal kept alongside (ai_i), then one
    reciprocal; (K b)_i is one multiply and n - 1 fused multiply-adds. The columns alike with
    (K^T a)_j. (Two chains added, the first from eps ai_i, shorten the dependent chain from 5 to 3
    operations but take 9 more instructions a round: 57 against 48 on sm_90, and the T=64 merge
    ended no sooner, 1.9 us after the last arrival against 1.8: stop18_experiments.json, call 4.
    One chain that starts from eps ai_i, 4 dependent operations after b and the same 48
    instructions, measured slower: T=64 8.37 against 8.07 us, stop19_experiments.json.) A
    half-round is n (n + 1) instructions and n reciprocals, against n (2n + 1) and n for the
    cells; at the end comb = K a b. The first column normalisation starts b (a = 1)."""
    ks = range(n)
    out = []
    for j in ks:
        out.append(f"bi_{j} = {_tree_sum([f'c_{i}_{j}' for i in ks])} + HC_EPS")
        out.append(f"b_{j} = _reciprocal(bi_{j}, INTERPRETED)")
    out += [f"a_{i} = b_0 * 0.0 + 1.0" for i in ks]  # (a = 1 / ai = 1: what SINKHORN_ITERS = 1 ends with)
    out += [f"ai_{i} = a_{i}" for i in ks]
    body = []
    for i in ks:
        body.append(f"ai_{i} = {_fma_chain([(f'c_{i}_{j}', f'b_{j}') for j in ks])} + HC_EPS * ai_{i}")
        body.append(f"a_{i} = _reciprocal(ai_{i}, INTERPRETED)")
    for j in ks:
        body.append(f"bi_{j} = {_fma_chain([(f'c_{i}_{j}', f'a_{i}') for i in ks])} + HC_EPS * bi_{j}")
        body.append(f"b_{j} = _reciprocal(bi_{j}, INTERPRETED)")
    out.append(f"for _ in range((SINKHORN_ITERS - 1) // {SINKHORN_UNROLL}):")
    out.append(f"    for _ in tl.static_range({SINKHORN_UNROLL}):")
    out += ["        " + line for line in body]
    out.append(f"for _ in tl.static_range((SINKHORN_ITERS - 1) % {SINKHORN_UNROLL}):")
    out += ["    " + line for line in body]
    out += [f"c_{i}_{j} = c_{i}_{j} * a_{i} * b_{j}" for i in ks for j in ks]
    return out


def _fma_chain(pairs: list[tuple[str, str]]) -> str:
    """x0 * y0 + x1 * y1 + ... as one multiply and a chain of fused multiply-adds."""
    expr = f"{pairs[0][0]} * {pairs[0][1]}"
    for x, y in pairs[1:]:
        expr = f"({expr}) + {x} * {y}"
    return expr


def _tree_sum(names: list[str]) -> str:
    """a + b + c + d as ((a + b) + (c + d)): log2(n) dependent additions instead of n - 1."""
    while len(names) > 1:
        names = [f"({a} + {b})" for a, b in zip(names[::2], names[1::2])] + (names[-1:] if len(names) % 2 else [])
    return names[0]


def _max_expr(names: list[str]) -> str:
    expr = names[0]
    for name in names[1:]:
        expr = f"tl.maximum({expr}, {name})"
    return expr


def _normalise_lines(n: int, axis: str, indent: int) -> list[str]:
    """comb / (sum over the other index + eps): `row` sums over j, `col` over i. One division per
    row (a reciprocal), then n multiplications: the Sinkhorn rounds are one thread's dependent
    chain per token, so their instruction count is their latency (x * (1/s) differs from x / s
    by about an ulp). One reciprocal for all n sums (1/s_a = product of the others / product of
    all: 1 special-function issue a half-round instead of n, 16 more instructions a round) measured
    slower: T=64 9.24 against 8.85 us, T=1 6.01 against 5.69 (stop16_experiments.json)."""
    pad = " " * indent
    out = []
    for a in range(n):
        cells = [f"c_{a}_{b}" if axis == "row" else f"c_{b}_{a}" for b in range(n)]
        out.append(f"{pad}inv = _reciprocal({_tree_sum(cells)} + HC_EPS, INTERPRETED)")
        for cell in cells:
            out.append(f"{pad}{cell} = {cell} * inv")
    return out


def generate_source(spec: MhcSpec) -> str:
    """The Triton module for `spec` (raises ValueError for an unsupported spec)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_mhc cannot generate this spec: {reason}")
    n = spec.n
    streams = range(n)
    lines = {}

    def block(name, indent, rows):
        lines[name] = "\n".join(" " * indent + r for r in rows)

    def step(k, stride):  # pointer offset of stream k
        return "" if k == 0 else f" + {k} * {stride}"

    # what _load_streams / _load_chunk return, and the loop's current / next names for them
    bf16, fp16 = spec.stream_dtype == "bfloat16", spec.stream_dtype == "float16"
    pieces = [[f"fa_{k}", f"fb_{k}"] if bf16 else [f"w_{k}"] for k in streams]  # fn's block per stream
    fn_names = [name for names in pieces for name in names] if spec.has_coefficients else []

    def stream_names(sfx):
        return (["y" + sfx] if spec.has_post else []) + [f"x_{k}{sfx}" for k in streams]

    load = []
    if spec.has_post:
        load.append("y = tl.load(y_ptr + rows64[:, None] * stride_yt + d[None, :], mask=ok, other=0.0, "
                    "eviction_policy=\"evict_first\")")
    load += [f"x_{k} = tl.load(x_ptrs{step(k, 'stride_xk')}, mask=ok, other=0.0, eviction_policy=\"evict_first\")"
             for k in streams]
    load.append("return " + ", ".join(stream_names("")))
    block("STREAM_LOAD_LINES", 4, load)
    load = [", ".join(stream_names("")) + " = _load_streams(",
            "    x_ptr, y_ptr, rows64, row_ok, stride_xt, stride_xk, stride_yt, chunk, c_end, BLOCK_D)"]
    if spec.has_coefficients:
        load.append("# fn^T's block for each stream: rows d of stream k, columns 0..SLOT (past WIDTH: zeros)")
        load.append("fcols = tl.arange(0, SLOT)")
        fn_block = "fcols[None, :].to(tl.int64) * ND + (d + {k} * D)[:, None]"
        load.append("f_ok = ((d < D) & live)[:, None] & (fcols < WIDTH)[None, :]")
        zeros = "tl.full([BLOCK_D, SLOT], 0.0, dtype=tl.{})"
        if bf16:
            # timing diagnostic (leave_out): zeros of the dtype the load would give, nothing read
            for branch, dtype in (("if (LEAVE_FN_LOADS & LEAVE_OUT) and PRESPLIT:", "bfloat16"),
                                  ("elif LEAVE_FN_LOADS & LEAVE_OUT:", "float32")):
                load.append(branch)
                for k in streams:
                    load += [f"    fa_{k} = {zeros.format(dtype)}", f"    fb_{k} = fa_{k}"]
            load.append("elif PRESPLIT:  # fn's pieces, split once per launch (mega_mhc_split_fn)")
            for k in streams:
                load.append(f"    fa_{k} = tl.load(fns_ptr + {fn_block.format(k=k)}, mask=f_ok, other=0.0)")
                load.append(f"    fb_{k} = tl.load(fns_ptr + SLOT * ND + {fn_block.format(k=k)}, mask=f_ok, other=0.0)")
            load.append("else:  # the fp32 block, split by _project")
            for k in streams:
                load.append(f"    fa_{k} = tl.load(fn_ptr + {fn_block.format(k=k)}, mask=f_ok, other=0.0)")
                load.append(f"    fb_{k} = fa_{k}")
        else:
            load.append("if LEAVE_FN_LOADS & LEAVE_OUT:  # timing diagnostic: nothing read")
            load += [f"    w_{k} = {zeros.format('float32')}" for k in streams]
            load.append("else:")
            load += [f"    w_{k} = tl.load(fn_ptr + {fn_block.format(k=k)}, mask=f_ok, other=0.0)" for k in streams]
    loaded = stream_names("") + fn_names
    load.append("return " + ", ".join(loaded))
    block("LOAD_LINES", 4, load)
    lines["STREAM_LOAD_DOC"] = ", ".join((["y"] if spec.has_post else []) + ["the n streams"])
    lines["LOAD_DOC"] = lines["STREAM_LOAD_DOC"] + (", fn^T's block per stream" if spec.has_coefficients else "")
    lines["CUR_NAMES"] = ", ".join(loaded)
    lines["CUR_NAMES_S1"] = ", ".join(stream_names(SUB_SUFFIX[1]))
    lines["NEXT_NAMES"] = ", ".join(f"{name}_n" for name in loaded)

    def sub_rows(sfx: str, first_row: str) -> list[str]:
        """One sub-tile's rows and zeroed partial sums: no memory access (before _begin)."""
        out = [f"rows{sfx} = tile * TILE_T + {first_row}tl.arange(0, SUB_T)",
               f"row_ok{sfx} = rows{sfx} < T  # tokens past T load zeros and are never stored",
               f"rows64{sfx} = rows{sfx}.to(tl.int64)"]
        out += ["# two projection accumulators (even and odd streams): a chunk's 2n tensor-core dots form two",
                "# independent chains instead of one through a single accumulator (one accumulator per stream",
                "# took the 16 x 64 sm_90 builds to 255 registers and spills)"]
        out += [f"acc_{k}{sfx} = tl.full([SUB_T, SLOT], 0.0, dtype=tl.float32)" for k in range(2)]
        out += [f"sumsq{sfx} = tl.full([SUB_T], 0.0, dtype=tl.float32)",
                f"csq{sfx} = tl.full([SUB_T], 0.0, dtype=tl.float32)"]
        return out

    def sub_setup(sfx: str) -> list[str]:
        """One sub-tile's per-token scalars (loads: after _begin, before the chunk loop)."""
        out = ["if HAS_POST:",
               "    # per-token scalars as [SUB_T] columns: post_j = post[t, j], comb_i_j = comb[t, i, j]"]
        out += [f"    post_{j}{sfx} = tl.load(post_ptr + rows64{sfx} * stride_post + {j}, mask=row_ok{sfx}, other=0.0)"
                for j in streams]
        out += [f"    comb_{i}_{j}{sfx} = tl.load(comb_ptr + rows64{sfx} * stride_comb + {i * n + j}, "
                f"mask=row_ok{sfx}, other=0.0)" for i in streams for j in streams]
        out.append("if not FRESH:")
        out += [f"    pre_{k}{sfx} = tl.load(cpre_ptr + rows64{sfx} * stride_cpre + {k}, mask=row_ok{sfx}, other=0.0)"
                for k in streams]
        return out

    def sub_finish(sfx: str) -> list[str]:
        acc = _tree_sum([f"acc_{k}{sfx}" for k in range(2)])
        return [f"_add_partials(acc_ptr, csq_slot, T, tile, acc_copy, rows64{sfx}, row_ok{sfx}, {acc}, sumsq{sfx}, "
                f"csq{sfx}, TILE_T, ACC_COPIES, ATOMIC, CSQ_SLOT)"]

    def widen_lines(sfx: str) -> list[str]:  # the rounded X' in fp32, as every later step reads it
        return [f"xf_{k}{sfx} = _widen(x_{k}{sfx}, INTERPRETED)" for k in streams]

    def collapse_expr(sfx: str) -> str:  # hc_pre with the carried (or, in _collapse, the fresh) pre
        return " + ".join(f"pre_{k}{sfx}[:, None] * xf_{k}{sfx}" for k in streams)

    def sub_body(sfx: str) -> str:
        """One sub-tile's share of a chunk, names suffixed with `sfx`."""
        sub = {"S": sfx}
        post = [f"yf{sfx} = _widen(y{sfx}, INTERPRETED)"] + [f"xf_{i}{sfx} = _widen(x_{i}{sfx}, INTERPRETED)"
                                                             for i in streams]
        post.append("# mHC post: X'[j] = post[j] * y + sum_i comb[i, j] X[i] (C^T X: the sum runs over comb's")
        post.append("# first index), in fp32, rounded to the stream dtype and stored")
        for j in streams:
            mix = " + ".join(f"comb_{i}_{j}{sfx}[:, None] * xf_{i}{sfx}" for i in streams)
            post.append(f"x_{j}{sfx} = _round(post_{j}{sfx}[:, None] * yf{sfx} + ({mix}), INTERPRETED)")
        post.append("if (LEAVE_STREAM_STORES & LEAVE_OUT) == 0:")
        for j in streams:
            post.append(f"    tl.store(xo_ptr + rows64{sfx}[:, None] * ND + ({j} * D) + d[None, :], x_{j}{sfx}, "
                        f"mask=ok{sfx}, eviction_policy=\"evict_first\")")
        sub["POST_LINES"] = "\n".join("    " + r for r in post)
        sub["F32_LINES"] = "\n".join(widen_lines(sfx))
        sub["SUMSQ_EXPR"] = " + ".join(f"xf_{k}{sfx} * xf_{k}{sfx}" for k in streams)
        sub["COLLAPSE_EXPR"] = collapse_expr(sfx)
        return _SUB_BODY.substitute(sub).rstrip("\n")

    def project(k: int, sfx: str) -> str:
        operand = f"xf_{k}{sfx}" if fp16 else f"x_{k}{sfx}"  # fp16: the widened X' meets fp32 fn
        return (f"acc_{k % 2}{sfx} = _project(acc_{k % 2}{sfx}, _opaque({operand}, INTERPRETED), "
                f"{', '.join(pieces[k])}, {'PRESPLIT, ' if bf16 else ''}INTERPRETED)")

    # per stream, every sub-tile's dots with fn's block, one after the other (its pieces are split
    # once and die at once)
    block("PROJECT_LINES", 8, [line for k in streams
                               for line in (project(k, ""), "if SUB_TILES > 1:", "    " + project(k, SUB_SUFFIX[1]))])

    def both_sub_tiles(lines_for) -> list[str]:  # sub-tile 0, then sub-tile 1 where there are two
        return lines_for(0) + ["if SUB_TILES > 1:"] + ["    " + r for r in lines_for(1)]

    block("SUB_ROWS", 4, both_sub_tiles(lambda s: sub_rows(SUB_SUFFIX[s], "SUB_T + " if s else "")))
    block("SUB_SETUP", 4, both_sub_tiles(lambda s: sub_setup(SUB_SUFFIX[s])))
    block("SUB_FINISH", 4, both_sub_tiles(lambda s: sub_finish(SUB_SUFFIX[s])))
    block("SUB_BODY", 0, sub_body("").split("\n"))
    block("SUB_BODY_S1", 4, sub_body(SUB_SUFFIX[1]).split("\n"))
    block("FRESH_PRE_LINES", 4,
          [f"pre_{k} = tl.load(pre_ptr + rows64 * N + {k}, mask=row_ok, other=0.0)"
           for k in streams])
    block("FRESH_XO_LINES", 12,
          [f"x_{k} = tl.load(x_ptrs{step(k, 'D')}, mask=ok, other=0.0)" for k in streams])
    block("FRESH_X_LINES", 12,
          [f"x_{k} = tl.load(x_ptrs{step(k, 'stride_xk')}, mask=ok, other=0.0)" for k in streams])
    block("F32_LINES", 8, widen_lines(""))
    block("GATE_LINES", 8, _gate_lines(spec))
    block("COMB_LINES", 8, _comb_lines(spec))
    lines["TRACE_EVENTS"] = len(TRACE_EVENTS)
    lines["COUNT_MASK"] = hex((1 << HANDOFF_SHIFT) - 1)
    lines["HANDOFF_SHIFT"] = HANDOFF_SHIFT
    lines["LEAVE_CONSTANTS"] = "\n".join(f"LEAVE_{part.upper()} = tl.constexpr({bit})"
                                         for part, bit in LEAVE_OUT_PARTS.items())
    lines["TRACE_CONSTANTS"] = "\n".join(
        [f"EV_{name.upper()} = tl.constexpr({i})" for i, name in enumerate(TRACE_EVENTS)]
        + [f"ROLE_{name.upper().replace(' ', '_')} = tl.constexpr({i})" for i, name in enumerate(TRACE_ROLES)])
    lines["COLLAPSE_EXPR"] = collapse_expr("")

    math_doc = []
    if spec.has_post:
        math_doc.append("    X'    = (post[j] * y + sum_i comb[i, j] X[i]) in fp32, rounded          (stored)")
    else:
        math_doc.append("    X'    = X                                         (no post: not stored)")
    if spec.has_coefficients:
        math_doc += [
            f"    r     = rsqrt(mean(X'^2 over n*D) + {_fmt_float(spec.stat_eps)})",
            "    m     = (X' . fn^T) * r = [m_pre | m_post | m_comb]",
            f"    pre'  = sigmoid(m_pre * scale0 + base_pre) + {_fmt_float(spec.hc_eps)}             (stored)",
            "    post' = 2 * sigmoid(m_post * scale1 + base_post)                   (stored)",
            f"    comb' = Sinkhorn(m_comb * scale2 + base_comb), {spec.sinkhorn_iters} iterations      (stored)"]
    p = "pre'" if spec.pre == "fresh" else "the carried pre"
    math_doc += [
        f"    c     = sum_k p[k] X'[k] in fp32, rounded, with p = {p}",
        f"    u     = c * rsqrt(mean(c^2) + {_fmt_float(spec.norm_eps)}) * norm_weight, rounded        (stored)"]
    spec_line = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(spec).items())
    body = _CHUNK_BODY.substitute(lines)
    lines["BUFFERED_BODY"] = lines["PIPELINED_BODY"] = "\n".join(
        (" " * 12 + line) if line.strip() else line for line in body.rstrip("\n").split("\n"))
    project_functions = _PROJECT_BF16 if bf16 else string.Template(_PROJECT_FP32).substitute(
        PROJECT_FP16_NOTE=" With fp16 streams xs is the widened (exact) X'." if fp16 else "")
    # fp16 streams round with .to(), to nearest even in both modes (numpy's conversion in the
    # interpreter); fp32 streams round nothing
    round_other = "x.to(tl.float16)" if fp16 else "x"
    return _TEMPLATE.substitute(
        KEY=spec.key(), SPEC_LINE=spec_line, FORM=spec.form(), N=n, D=spec.dim,
        DTYPE_NAME=spec.stream_dtype, MATH_DOC="\n".join(math_doc), CONSTANTS=_constants(spec),
        PROJECT_FUNCTIONS=project_functions, ROUND_OTHER=round_other, **lines)


def kernel_name(spec: MhcSpec) -> str:
    """The cache file stem: content-addressed by the spec and the generator's template."""
    return f"mega_mhc_{spec.key()}"


def source_path(spec: MhcSpec):
    """Write (if needed) and return the cached source file of `spec`."""
    return kernel_cache.write_source(kernel_name(spec), generate_source(spec))


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchConfig:
    """Tiling of one launch.

    tile_t       tokens per token tile (a power of two >= 16); a stage-A job sweeps one tile
    block_d      columns per chunk of the sweep (a power of two >= 16: the K of the dot); every
                 stream's chunk is a [tile_t / sub_tiles, block_d] register tile
    split_cols   columns of D per stage-A job (a multiple of block_d); >= D is the tiled variant
    r_splits     split variant: rescale jobs per token tile; 0 = the tile's last arrival rescales
    pipeline_stages  0: stage A double-buffers one chunk ahead in registers; k >= 2: the chunk
                 loads sit in a `tl.range(num_stages=k)` loop and Triton's pipeliner keeps k - 1
                 chunks in flight through shared memory (cp.async): on sm_90 fewer registers
                 (T=64: 212 instead of 255) and 44 KB of shared memory per stage
                 (tools.hopper_builds); the tuned rows use k = 3 from T=64 up
    presplit_fn  bf16 streams with coefficients: a first launch splits fn into its bf16 pieces
                 once (mega_mhc_split_fn), and stage A loads those instead of splitting its fp32
                 block again in every token tile (the split is ~1/3 of stage A's instructions per
                 chunk on sm_90, repeated T / tile_t times per launch)
    rescale_stages  0: the rescale (u = c / rms * w over the parked collapse) loads one block
                 ahead in registers; k >= 2: its loads are pipelined by Triton through shared
                 memory, k - 1 blocks ahead (the sweep's shared memory is free by then: no more
                 per program on sm_90)
    sub_tiles    1, or 2 with pipeline_stages >= 2: stage A sweeps the tile as two register tiles
                 of tile_t / 2 tokens (the M of the projection dot, >= 16) that share each chunk's
                 block of fn, loaded and split once (its L2 traffic halved; sm_90: 1286 instead
                 of 2 x 784 instructions per chunk, 255 registers)
    acc_copies   split variant: copies of each token tile's accumulator block; stage-A job `part`
                 of a tile adds its partial sums into copy part % acc_copies, and the merge sums
                 the copies (at most one per stage-A job of a tile: more are not used). The
                 atomics of a tile's jobs all land on the same (2+n)n + 2 columns of its tokens
                 and wait on one another: at T=64 (27 jobs a tile) a job's arrival (a release,
                 which waits for its atomics) took 1.9 us after its sweep with one copy and 0.9
                 with four; the merge's loads grow with the copies (see the launch table)
    co_resident  split variant with epilogue jobs, on CUDA: where the device holds every program
                 of the launch at once (occupancy of the compiled kernel), launch them as one
                 cooperative grid (CUDA refuses one that cannot be resident) and take job = program
                 id, instead of every program claiming its job with an atomic on one counter
                 first (the claims of a launch serialise there: the last came 0.45 us after the
                 first start at T=64); False: always claim. See "forward progress". The same
                 T=64 build launched plainly (not cooperatively; unsafe, an experiment) measured
                 8.52 against 8.04 us (results/bench_mhc_runs/stop21_experiments.json, call 3)
    handoff      split variant with epilogue jobs and a carried pre (at most MAX_HANDOFF_PARTS
                 rescale jobs a tile), any device: job = program id, with neither a claim nor a
                 cooperative launch (co_resident is not consulted), and a rescale job that has
                 waited MAX_SPINS for its tile hands its blocks to the tile's last stage-A arrival,
                 which does them after its merge: correct whatever the dispatch order and however
                 few programs are resident. The T=1 row uses it (with the rescale at once and
                 Sinkhorn on factors 5.52 / 5.36 against 5.89 / 5.63 us for the stop-16 row in two
                 calls); at T=64 it measured slower (9.06 against 8.89 us) and at T=4096, where the
                 grid is not resident, much slower (170 against 145: handed parts run one after
                 another). results/bench_mhc_runs/stop17_experiments.json
    sinkhorn_factors  Sinkhorn's rounds after the first column normalisation keep the softmax
                 cells K fixed and update row and column factors (_comb_lines): 48 instead of 72
                 instructions a round on sm_90, where the merge's rounds are bound by instruction
                 issue (16 more a round measured +0.39 us at T=64). Within 1e-7 of the reference on
                 the CPU. The merge ends ~0.3 us sooner at T=64 (traces), though the launch gained
                 0-0.07 us there (the rescale jobs end as late): the T=1 and T=64 rows use it
    rescale_at_once  rescale jobs (carried pre) load their whole part, [tile_t, r_per_job * r_block],
                 before the tile's sum(c^2): one round trip, where the block loop waits for 1/rms
                 before its first block (T=64: a rescale job's work ends 1.1 us after its tile's
                 arrivals against 1.4; 8.80 against 9.02 us, T=512 24.50 against 24.72;
                 stop17_experiments.json). Only where r_per_job is a power of two and the part has
                 at most RESCALE_AT_ONCE_ELEMS elements (registers); otherwise the block loop
    pdl          on devices with programmatic dependent launch (CUDA sm_90+): the seam is launched
                 as a programmatic dependent of the stream's previous kernel, so its programs are
                 scheduled while that kernel ends; each waits for the previous kernel's writes
                 (griddepcontrol.wait) just before its first memory access, then lets the next
                 kernel launch early the same way: only launch latency and the programs' set-up
                 (job numbers, addresses; claimed jobs wait before the claim) overlap, no memory
                 access. Back to back in graph replay on the H200, with the wait at the kernel's
                 start: T=64 8.39 / 8.42 against 8.73 / 8.74 us, T=1 5.00 / 4.97 against 5.46 /
                 5.40, T=512 23.83 / 23.96 against 24.53 / 24.62, T=4096 unchanged; after a kernel
                 launched without it (a zero fill) only 8.79-8.83 against 8.87-8.90 at T=64
                 (results/bench_mhc_runs/stop18_experiments.json, calls 1-2). The wait moved to the
                 first access: T=64 7.96 against 8.37, T=1 4.67 against 4.94 (stop20, call 5)
    """
    tile_t: int
    block_d: int
    split_cols: int
    r_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2
    pipeline_stages: int = 0
    presplit_fn: bool = False
    rescale_stages: int = 0
    sub_tiles: int = 1
    acc_copies: int = 1
    co_resident: bool = True
    handoff: bool = False
    sinkhorn_factors: bool = False
    rescale_at_once: bool = False
    pdl: bool = True

    def variant(self, dim: int) -> str:
        return "tiled" if self.split_cols >= dim else "split"


# CUDA launch table: the fastest correct configuration of tools/bench_mhc.py --sweep on one H200
# (D=5120, n=4, bf16 streams, delayed seam, CUDA-graph replay; results/bench_mhc_runs/stop13_sweep.json
# "sweep", the last --sweep run, and
# results/bench_mhc_runs/stop12_experiments.json for T = 1024 and 2048). Rows: (max T, config).
# Stop 17 added launch flags to the rows (results/bench_mhc_runs/stop17_experiments.json, same
# process, interleaved): T=1 handoff + Sinkhorn on factors + rescale at once, T=64 factors + at
# once, T=512 at once (LaunchConfig). The times below are those of the sweeps.
#   T=1    160 one-chunk stage-A jobs of 32 columns + 10   5.84 us (80 64-column jobs 6.29, the same
#          rescale jobs                                           with 2 warps 6.02)
#   T=64   4 tiles x 27 slices of 3 chunks + 5 rescale     9.71 us (stop13_experiments.json: the
#          jobs a tile (two blocks each), stage A                stop-12 row, 10 rescale jobs a tile
#          pipelined 3 deep, 4 accumulator copies                and one copy, 11.08; 8 copies 10.14,
#          (128 programs: one per SM)                            16 copies 11.97; 10 rescale jobs and
#                                                                8 copies 12.33; 2-chunk slices and 8
#                                                                copies 11.19. Before the copies:
#                                                                pipelined 2 deep 12.36, 2 chunks a
#                                                                slice 11.76, 4 chunks 12.05, not
#                                                                pipelined 12.10)
#          (the 148 programs of 10 rescale jobs a tile put two on 16 SMs, and the stage-A jobs that
#          shared an SM took 7.2-7.7 us against 4.7-5.2 alone, 8 warps a program 6.0). The rescale
#          is pipelined 3 deep (rescale_stages): its jobs' two blocks took 1.7 us after their
#          1/rms and end 0.4 us sooner that way, which leaves the merge the launch's only critical
#          path; in one process 9.58 against 9.64 us (stop14_experiments.json; 10 rescale jobs a
#          tile with it 11.90). Stop 20 (stop20_experiments.json, against this row's
#          8.16-8.21): one-chunk jobs at three programs per SM 8.59 (two tiles' merges met on one
#          SM), two-chunk jobs 9.57, 32-column chunks 10.09, 32-token tiles as two sub-tiles 9.16,
#          pipelined 2 deep 8.65
#   T=512  32 tiles x 8 slices + 5 rescale jobs a tile    24.72 us (10 rescale jobs a tile 25.09, 4
#          (two 512-column blocks each), pipelined 3 deep       25.29, 2 deep 35.5, 12 chunks a
#                                                                slice 27.95, fn split first 26.6,
#                                                                two sub-tiles 26.5)
#          (256 stage-A jobs: at most two per SM; 10 slices left 56 SMs with three and 76 with two)
#   T=1024 32 tiles of 32 tokens (two 16-token sub-tiles)  43.26 us (16-token tiles, 640 columns
#          x 8 slices + 7 rescale jobs a tile                    49.5, 1280 columns 45.9;
#                                                                rescale_stages 3 48.9; stop12_
#                                                                experiments.json, before _acc_block)
#   T=2048 64 tiles of 32 tokens x 4 slices + 4 rescale   79.0 us (8 slices 83.0; the T=512 row
#          jobs a tile, rescale pipelined 3 deep                 96.7 in the same run; ditto)
#   above  tiles of 32 tokens x 2 slices + 4 rescale jobs 145.4 us at T=4096 (rescale not pipelined
#          a tile, rescale pipelined 3 deep                      150.7, 8 rescale jobs 146.2, fn split
#                                                                first 149.6, 16-token tiles split
#                                                                164.9 and tiled 166.6)
# From T=1024 on, stage A sweeps 32-token tiles as two 16-token sub-tiles (`sub_tiles`): each chunk
# of fn is loaded and split once for 32 tokens, which halves fn's traffic from L2 (504 MB at
# T=4096 with 16-token tiles, more than the launch's 422 MB of HBM traffic) and takes ~18% of the
# instructions per token (sm_90: 1286 per two-sub-tile chunk against 2 x 784); at T=512 its jobs
# are too short to gain (5 chunks each: 28.0 against 26.4 us) and at T=64 too few (14.3 against 12.9).
# Only where stage A projects onto fn's bf16 pieces (choose_config): other forms run the sub-tiles
# as 16-token tiles. Split jobs then give the GPU its programs (about 256 stage-A jobs: two per
# SM); the tiled variant (one program per tile, nothing shared) stays for the CPU and a forced
# variant="tiled". The chunk body's order matters too: each sub-tile's collapse comes before the
# projection dots (X' widened to fp32 then dies before the dots), which took the T=64 build from
# 212 to 170 registers and measured 11.03 against 12.02 us at T=64 and 26.31 against 27.02 at
# T=512 (the same instance, interleaved; T=1 unchanged).
# 64-column chunks (128 B of a bf16 row) beat 32-column ones wherever registers allow two programs
# per SM. presplit_fn only applies to bf16 streams with coefficients (choose_config drops it
# otherwise; no row uses it now: 155.3 against 156.2 us at T=4096, within the noise, for a second
# launch). Sweep of one run: neighbours within ~3% trade places between runs, and instances differ
# by up to ~10% at T=64. Also measured slower at every T (results/bench_mhc_runs/
# stop10_experiments.json, stop11_experiments.json): 64-token register tiles (a wgmma projection
# that reads fn a quarter as often), 32-column presplit rows at three programs per SM, rescale jobs
# claimed a few tiles after their tile's stage A (so that they read a parked collapse still in L2),
# one accumulator per stream. Accumulator copies only pay at T=64 (stop13_experiments.json): the
# merge sums them, ~0.2 us a copy at T=1 (4 copies 6.76 against 5.92 us), and elsewhere the atomics
# did not wait (T=512 2 / 4 / 8 copies 24.68 / 24.98 / 25.91 against 24.67, T=2048 4 copies 93.5
# against 76.2, T=4096 2 copies 147.4 against 148.1).
_CUDA_TABLE = (
    (16, LaunchConfig(16, 32, 32, 16, handoff=True, sinkhorn_factors=True, rescale_at_once=True)),
    (128, LaunchConfig(16, 64, 192, 5, pipeline_stages=3, acc_copies=4, rescale_stages=3, sinkhorn_factors=True,
                       rescale_at_once=True)),
    (512, LaunchConfig(16, 64, 640, 8, pipeline_stages=3, rescale_at_once=True)),
    (1024, LaunchConfig(32, 64, 640, 8, pipeline_stages=3, sub_tiles=2)),
    (2048, LaunchConfig(32, 64, 1280, 4, pipeline_stages=3, sub_tiles=2, rescale_stages=3)),
    (None, LaunchConfig(32, 64, 2560, 4, pipeline_stages=3, sub_tiles=2, rescale_stages=3)),
)
# variant="tiled" on CUDA: 16-token tiles, the whole row per program (171.6 us at T=4096, stop 11)
_CUDA_TILED = LaunchConfig(16, 64, 1 << 30, pipeline_stages=3, rescale_stages=3)


def choose_config(spec: MhcSpec, n_tokens: int, *, device: torch.device | str = "cuda",
                  variant: str | None = None) -> LaunchConfig:
    """The launch configuration for `n_tokens` tokens.

    CUDA: the table above (tuned at D=5120 on the delayed seam), adapted to the spec: for other D
    the same column counts per job apply, and a D too small to split gets 16-column slices; fn's
    presplit, the rescale's pipeline and sub-tiles only where stage A projects onto fn's bf16
    pieces (elsewhere a sub-tiled row's sub-tiles become tiles of their own).
    `variant` forces "split" (the table's rows are all split) or "tiled".
    CPU (the interpreter): few, large programs, since every interpreted op costs about the same.
    """
    if variant not in (None, "split", "tiled"):
        raise ValueError(f"variant must be 'split', 'tiled' or None, not {variant!r}")
    device = torch.device(device)
    D = spec.dim
    if device.type != "cuda":
        block_d = min(64, max(16, _next_pow2(D) // 4))
        if variant in (None, "tiled"):
            return LaunchConfig(16, block_d, _round_up(D, block_d))
        split_cols = _round_up(-(-D // 2), block_d)
        if split_cols >= D:  # too small to halve at this block: one 16-column block per slice
            block_d = split_cols = 16
        return LaunchConfig(16, block_d, split_cols, r_splits=0)
    if variant == "tiled":
        cfg = dataclasses.replace(_CUDA_TILED, split_cols=_round_up(D, _CUDA_TILED.block_d))
    else:
        cfg = next(c for max_t, c in _CUDA_TABLE if max_t is None or n_tokens <= max_t)
        if cfg.split_cols >= D:  # D too small to split at these sizes: 16-column slices
            cfg = dataclasses.replace(cfg, block_d=16, split_cols=16)
    bf16_fn = projects_bf16_pieces(spec)
    if not bf16_fn and cfg.sub_tiles > 1:  # the sub-tiles as tiles of their own (see the table)
        cfg = dataclasses.replace(cfg, tile_t=cfg.tile_t // cfg.sub_tiles, sub_tiles=1)
    # the rescale's pipeline fits in stage A's shared memory only where stage A stages fn's blocks
    # too; elsewhere it would take more per program
    # (fp32 final collapse on sm_90: 69632 B instead of 40960, three programs per SM, not four)
    return dataclasses.replace(cfg, presplit_fn=cfg.presplit_fn and bf16_fn,
                               rescale_stages=cfg.rescale_stages if bf16_fn else 0)


def split_fn(fn: torch.Tensor, spec: MhcSpec) -> torch.Tensor:
    """fn [(2+n)n, nD] fp32 -> its bf16 pieces [2, slot, nD] (hi rows, then lo rows; the rows past
    (2+n)n zero), as mega_mhc_split_fn writes them: hi = fn rounded to bf16, lo = (fn - hi) rounded,
    both to nearest even. For `mega_mhc(fn_pieces=...)` where fn is fixed (frozen weights)."""
    if not projects_bf16_pieces(spec):
        raise ValueError(f"split_fn: fn's bf16 pieces are for bf16 streams with coefficients, not the "
                         f"{spec.stream_dtype} {spec.form()} form")
    _check("fn", fn, (spec.width(), spec.n * spec.dim), (torch.float32,), fn.device)
    hi = fn.to(torch.bfloat16)
    lo = (fn - hi.float()).to(torch.bfloat16)
    pieces = torch.zeros((2, _slot_width(spec.n), spec.n * spec.dim), dtype=torch.bfloat16, device=fn.device)
    pieces[0, :spec.width()], pieces[1, :spec.width()] = hi, lo
    return pieces


def _check_fn_pieces(fn_pieces: torch.Tensor, spec: MhcSpec, device) -> None:
    if not projects_bf16_pieces(spec):
        raise ValueError(f"mega_mhc: fn_pieces are for bf16 streams with coefficients, not the "
                         f"{spec.stream_dtype} {spec.form()} form")
    _check("fn_pieces", fn_pieces, (2, _slot_width(spec.n), spec.n * spec.dim), (torch.bfloat16,), device)
    if not fn_pieces.is_contiguous():
        raise ValueError("mega_mhc: fn_pieces must be contiguous (split_fn makes them so)")


def projects_bf16_pieces(spec: MhcSpec) -> bool:
    """Stage A projects onto fn's bf16 pieces (bf16 streams with coefficients): the forms where fn
    can be split beforehand (presplit_fn), whose pipeline stages fn's blocks (rescale_stages), and
    where two sub-tiles sharing those blocks fit two programs per SM (sub_tiles; with fp32 streams
    the sm_90 build spills ~600 B and holds one program per SM)."""
    return spec.has_coefficients and spec.stream_dtype == "bfloat16"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ----------------------------------------------------------------------------------------------
# Persistent sync state (per device)
# ----------------------------------------------------------------------------------------------

class _DeviceState:
    """The split variant's persistent buffers on one device: the int32 sync buffer and the fp32
    accumulator of partial sums, all zero between launches (the kernel restores that itself), and
    MONOTONIC launches' int64 token-tile counters, per (n_splits, r_splits): [tiles, 2] that only
    grow, each tile's by the same amounts every launch (see the kernel). Buffers only grow; an
    outgrown buffer is kept alive (`retired`): a captured graph may point at it."""

    def __init__(self):
        self.sync = None
        self.acc = None
        self.tiles: dict[tuple[int, int], torch.Tensor] = {}
        self.retired = []


_states: dict[str, _DeviceState] = {}
_state_lock = threading.Lock()


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


def _grown(st: _DeviceState, buf: torch.Tensor | None, name: str, need: int, minimum: int, dtype,
           device) -> torch.Tensor:
    """`buf`, or a zeroed buffer of at least `need` elements where it is smaller (or None)."""
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"mega_mhc needs to allocate its persistent {name} buffer during CUDA graph capture; "
                "run mega_mhc once eagerly at the largest token count (or call reserve_sync) first")
        if buf is not None:
            st.retired.append(buf)
        buf = torch.zeros(max(need, minimum), dtype=dtype, device=device)
    return buf


def _grow(st: _DeviceState, name: str, need: int, minimum: int, dtype, device) -> torch.Tensor:
    setattr(st, name, _grown(st, getattr(st, name), name, need, minimum, dtype, device))
    return getattr(st, name)


def _counters_consistent(counters: torch.Tensor, n_splits: int, r_splits: int) -> bool:
    """Whether every token tile's counters are whole launches: arrivals / n_splits equal to rescale
    tickets / r_splits (what every completed launch leaves)."""
    arrive, rescale = counters.view(-1, 2).unbind(1)
    return bool((arrive * r_splits == rescale * n_splits).all())


def _tile_counters(device: torch.device, n_splits: int, r_splits: int, n_tiles: int) -> torch.Tensor:
    """A MONOTONIC launch's int64 token-tile counters (_DeviceState.tiles)."""
    with _state_lock:
        st = _states.setdefault(_device_key(device), _DeviceState())
        key = (n_splits, r_splits)
        st.tiles[key] = _grown(st, st.tiles.get(key), "token-tile counter", 2 * n_tiles, 2 * 1024, torch.int64,
                               device)
        return st.tiles[key]


def _split_buffers(device: torch.device, n_tiles: int, acc_elems: int):
    """(sync, accumulator) for a split launch with n_tiles token tiles."""
    with _state_lock:
        st = _states.setdefault(_device_key(device), _DeviceState())
        sync = _grow(st, "sync", 2 + SYNC_PER_TILE * max(n_tiles, 1), 2 + SYNC_PER_TILE * 1024, torch.int32, device)
        acc = _grow(st, "acc", acc_elems, 1 << 16, torch.float32, device)
        return sync, acc


def reserve_sync(spec: MhcSpec, max_tokens: int, device: torch.device | str = "cuda") -> None:
    """Allocate the persistent buffers launches of up to `max_tokens` need (call before capturing
    a CUDA graph, or run one eager launch at the largest token count)."""
    device = torch.device(device)
    # the most token tiles any launch up to max_tokens has: at the top of each band of the table
    # (a band of shorter tiles may have more tiles than the next band's first sizes)
    sizes = [max_tokens] + [t for t, _ in _CUDA_TABLE if t is not None and t < max_tokens]
    plans = [_plan(spec, choose_config(spec, t, device=device, variant="split"), t) for t in sizes]
    _split_buffers(device, max(p["n_tiles"] for p in plans), max(p["acc_elems"] for p in plans))
    for p in plans:  # (whether a launch runs MONOTONIC is known only at launch: reserved alike)
        if p["r_splits"] and spec.pre == "carried":
            _tile_counters(device, p["n_splits"], p["r_splits"], p["n_tiles"])


def reset_sync(device: torch.device | str = "cuda") -> None:
    """Zero the persistent state again (only needed after a launch was aborted mid-way)."""
    st = _states.get(_device_key(torch.device(device)))
    if st is not None:
        for buf in (st.sync, st.acc, *st.tiles.values()):
            if buf is not None:
                buf.zero_()


# ----------------------------------------------------------------------------------------------
# Launch and reference
# ----------------------------------------------------------------------------------------------

_kernels: dict[tuple[str, bool], object] = {}


def load(spec: MhcSpec, interpret: bool, name: str = KERNEL_NAME):
    """The jitted kernel `name` of `spec`'s module for one mode (writes the source to the cache on
    first use)."""
    memo = (spec.key(), interpret, name)
    kernel = _kernels.get(memo)
    if kernel is None:
        kernel = kernel_cache.load_kernel(source_path(spec), name, interpret)
        _kernels[memo] = kernel
    return kernel


def _check(name, t, shape, dtypes, device):
    if t is None:
        raise ValueError(f"mega_mhc: {name} is required by this spec but is None")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"mega_mhc: {name} must be {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        names = " or ".join(dict.fromkeys(str(d).replace("torch.", "") for d in dtypes))
        raise ValueError(f"mega_mhc: {name} dtype {str(t.dtype).replace('torch.', '')} must be {names}")
    if t.device != device:
        raise ValueError(f"mega_mhc: {name} is on {t.device}, streams on {device}")


def validate(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec):
    """Raise ValueError naming the first input the kernel cannot take (shape, dtype, device). The
    pass runs it on a match's fake tensors, so what a launch would refuse stays unfused instead."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(f"mega_mhc: unsupported spec: {reason}")
    n, D = spec.n, spec.dim
    sdtype = DTYPES[spec.stream_dtype]
    if streams is None or streams.dim() != 3 or tuple(streams.shape[1:]) != (n, D):
        got = None if streams is None else list(streams.shape)
        raise ValueError(f"mega_mhc: streams must be [T, {n}, {D}], got {got}")
    if streams.dtype != sdtype:
        raise ValueError(f"mega_mhc: streams dtype {streams.dtype} does not match spec stream_dtype "
                         f"{spec.stream_dtype}")
    T, device, f32 = streams.shape[0], streams.device, (torch.float32,)
    if spec.has_post:
        # y is read once and widened to fp32, so its dtype need not be the streams' (torch 2.11 folds
        # a bf16 model's last X' round trip away, leaving fp32 streams with a bf16 y)
        _check("y", y, (T, D), tuple(DTYPES.values()), device)
        _check("post", post, (T, n), f32, device)
        _check("comb", comb, (T, n, n), f32, device)
    if spec.pre == "carried":
        _check("carried_pre", carried_pre, (T, n), f32, device)
    if spec.has_coefficients:
        _check("fn", fn, ((2 + n) * n, n * D), f32, device)
        _check("base", base, ((2 + n) * n,), f32, device)
        _check("scale", scale, (3,), f32, device)
    _check("norm_weight", norm_weight, (D,), f32, device)


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """Innermost dimensions contiguous (rows may be strided, even broadcast with stride 0)."""
    if t is None:
        return None
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return t.contiguous()
        expected *= size
    return t


def _plan(spec: MhcSpec, cfg: LaunchConfig, T: int) -> dict:
    """The grid a config gives at T tokens. D is n_chunks chunks of block_d; a stage-A job takes
    split_chunks of them (n_splits jobs per token tile). The rescale streams blocks of r_block
    columns ([tile_t, r_block] = 8K elements): r_per_job blocks per rescale job, r_splits jobs per
    tile (0: the last arrival rescales the whole tile)."""
    if cfg.tile_t < 16 or cfg.tile_t & (cfg.tile_t - 1) or cfg.block_d < 16 or cfg.block_d & (cfg.block_d - 1) \
            or cfg.split_cols % cfg.block_d or cfg.r_splits < 0 or cfg.rescale_stages < 0 \
            or cfg.rescale_stages == 1 or cfg.acc_copies < 1:
        raise ValueError(f"mega_mhc: inconsistent launch config {cfg}: tile_t and block_d must be powers of "
                         "two >= 16, split_cols a multiple of block_d, r_splits >= 0, rescale_stages 0 or >= 2, "
                         "acc_copies >= 1")
    if cfg.sub_tiles not in range(1, MAX_SUB_TILES + 1) or cfg.tile_t // cfg.sub_tiles < 16 \
            or (cfg.sub_tiles > 1 and cfg.pipeline_stages < 2):
        raise ValueError(f"mega_mhc: inconsistent launch config {cfg}: sub_tiles must be 1..{MAX_SUB_TILES}, "
                         "with tile_t / sub_tiles >= 16 (the projection dot's M), and sub_tiles > 1 needs "
                         "pipeline_stages >= 2")
    if cfg.presplit_fn and not projects_bf16_pieces(spec):
        raise ValueError(f"mega_mhc: presplit_fn needs bf16 streams and coefficients (fn), not the "
                         f"{spec.stream_dtype} {spec.form()} form: {cfg}")
    n_tiles = -(-T // cfg.tile_t)
    n_chunks = -(-spec.dim // cfg.block_d)
    split_chunks = min(cfg.split_cols // cfg.block_d, n_chunks)
    n_splits = -(-n_chunks // split_chunks)
    r_block = max(16, min(_next_pow2(spec.dim), 8192 // cfg.tile_t))
    n_rblocks = -(-spec.dim // r_block)
    r_per_job = -(-n_rblocks // max(cfg.r_splits, 1))
    r_splits = -(-n_rblocks // r_per_job) if (n_splits > 1 and cfg.r_splits > 0) else 0
    n_jobs = n_tiles * n_splits
    if r_splits:
        n_jobs = n_jobs * (2 if spec.pre == "fresh" else 1) + n_tiles * r_splits
    if n_splits >> HANDOFF_SHIFT:
        raise ValueError(f"mega_mhc: {n_splits} stage-A jobs a token tile (D={spec.dim} in slices of "
                         f"{split_chunks * cfg.block_d} columns) exceed the sync words' count of "
                         f"{(1 << HANDOFF_SHIFT) - 1}: use wider slices (split_cols)")
    acc_copies = min(cfg.acc_copies, n_splits)
    part_cols = r_per_job * r_block  # (r_block is a power of two)
    # handoff needs the carried pre (a fresh collapse job waits on the merge: no one to hand to)
    # and a bit per rescale part in the tile's arrival word; otherwise the co_resident / claim rules
    handoff = cfg.handoff and 0 < r_splits <= MAX_HANDOFF_PARTS and spec.pre == "carried"
    return dict(n_tiles=n_tiles, n_chunks=n_chunks, split_chunks=split_chunks, n_splits=n_splits,
                r_block=r_block, r_per_job=r_per_job, r_splits=r_splits, n_jobs=n_jobs, acc_copies=acc_copies,
                acc_elems=n_tiles * acc_copies * cfg.tile_t * _slot_width(spec.n), handoff=handoff,
                rescale_at_once=(cfg.rescale_at_once and r_splits > 0 and spec.pre == "carried"
                                 and r_per_job & (r_per_job - 1) == 0
                                 and cfg.tile_t * part_cols <= RESCALE_AT_ONCE_ELEMS),
                part_cols=part_cols, variant="tiled" if n_splits == 1 else "split")


def mega_mhc(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec, *,
             fn_pieces: torch.Tensor | None = None, variant: str | None = None, config: LaunchConfig | None = None,
             out=None, trace: torch.Tensor | None = None, leave_out: tuple[str, ...] = (), job_rotation: int = 0):
    """(X' or None, u, pre' or None, post' or None, comb' or None) of the seam, in one launch.

    streams [T, n, D] (stream dtype), y [T, D] (stream dtype or fp32), post [T, n], comb [T, n, n],
    carried_pre [T, n], fn [(2+n)n, nD], base [(2+n)n], scale [3], norm_weight [D] (all fp32).
    Arguments the spec does not use may be None (and are ignored). `fn_pieces` (bf16 streams with
    coefficients): `split_fn(fn, spec)`, made once where fn does not change (frozen weights: the
    pass does it at compile time); stage A then loads them instead of splitting fn in every token
    tile (presplit_fn without the split launch). They must be fn's: nothing checks that on the GPU.
    `variant` forces "split" or
    "tiled" (default: chosen from T); `config` overrides the tiling (benchmark sweeps). `out`
    optionally supplies the five output tensors (None where the spec has no such output; tests and
    benchmarks poison them to prove every element is written). `trace` (CUDA only): an int64
    [programs, len(TRACE_EVENTS)] tensor (`trace_shape`) that a traced build of the kernel fills
    with per-program event times (see TRACE_EVENTS). `leave_out` (a timing diagnostic, names from
    LEAVE_OUT_PARTS) compiles those parts of stage A out: the outputs are then wrong by design.
    `job_rotation` (a test of LaunchConfig.handoff, which it needs) numbers program p's job
    (p + job_rotation) % jobs: with the tiles' rescale jobs first, the interpreter (programs one at
    a time, in order) runs each before its tile's stage A, so that every one hands its blocks off.
    Inputs are never modified.
    """
    # a repeat of an earlier call's layout (the usual case: every layer, every step) launches with
    # that call's decisions (lowering.launch); diagnostics and overrides always take the whole path
    kept_key = None
    if streams.is_cuda and variant is None and config is None and out is None and trace is None \
            and not leave_out and job_rotation == 0:
        kept_key = (spec, layout_key(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, fn_pieces))
        kept = _kept.get(kept_key)
        if kept is not None:
            return _relaunch(kept, streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec,
                             fn_pieces)
    validate(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec)
    if fn_pieces is not None:
        _check_fn_pieces(fn_pieces, spec, streams.device)
    leave_out_bits = _leave_out_bits(leave_out)
    T, device = streams.shape[0], streams.device
    if out is None:
        out = _outputs(spec, T, device)
    else:
        _check_out(out, spec, T, device)
    if T == 0:
        return tuple(out)
    given = (streams, y, post, comb, carried_pre, fn, base, scale, norm_weight)
    streams, y, post, comb, carried_pre, fn, base, scale, norm_weight = laid_out = _row_major(*given, spec)
    row_major = all(a is b or b is None for a, b in zip(given, laid_out))  # (None: an input the spec ignores)

    cfg = config or choose_config(spec, T, device=device, variant=variant)
    plan = _plan(spec, cfg, T)
    if trace is not None:
        _check_trace(trace, plan, device)
    rotation_ok = job_rotation == 0 or (plan["handoff"] and 0 <= job_rotation < plan["n_jobs"])
    if not isinstance(job_rotation, int) or not rotation_ok:
        raise ValueError(f"mega_mhc: job_rotation={job_rotation!r} needs a launch with handoff (a split config "
                         f"with handoff=True and rescale jobs, carried pre) and a value in 0..{plan['n_jobs'] - 1}; "
                         f"this one is {cfg} (handoff {plan['handoff']})")
    n_splits = plan["n_splits"]
    interpret = device.type != "cuda"
    if fn_pieces is not None:  # split beforehand: stage A loads the pieces (PRESPLIT), nothing to split here
        cfg = dataclasses.replace(cfg, presplit_fn=True)
    elif cfg.presplit_fn:
        fn_pieces = torch.empty((2, _slot_width(spec.n), spec.n * spec.dim), dtype=torch.bfloat16, device=device)
        split = load(spec, interpret=interpret, name=SPLIT_FN_KERNEL)
        split[(-(-spec.n * spec.dim // SPLIT_FN_BLOCK), spec.width())](fn, fn_pieces, BLOCK=SPLIT_FN_BLOCK,
                                                                       INTERPRETED=interpret, num_warps=4)
    kernel = load(spec, interpret=interpret)

    # A co-resident launch with epilogue jobs and the carried pre runs MONOTONIC (see the kernel)
    # on its own token-tile counters and sum(c^2) slots; a launch that turns out not to fit at
    # once never reads them, and a grid too large to be co-resident (_fits_at_once refuses it
    # without a build) does not get them
    try_co_resident = cfg.co_resident and plan["r_splits"] > 0 and not plan["handoff"]
    csq_slots = _next_pow2(n_splits) if try_co_resident and spec.pre == "carried" else 0
    monotonic = bool(csq_slots) and (interpret or co_resident_candidate(
        plan["n_jobs"], torch.cuda.get_device_properties(device).multi_processor_count))
    buffers = _launch_buffers(device, plan, cfg, csq_slots if monotonic else 0)
    if interpret:  # host memory: checking is free
        sync, acc, tiles = buffers[2], buffers[0], buffers[3]
        if n_splits > 1 and (bool(sync.any()) or bool(acc.any())):
            warnings.warn("mega_mhc: persistent state was left dirty by an aborted launch; resetting it")
            reset_sync(device)
        if monotonic and not _counters_consistent(tiles, n_splits, plan["r_splits"]):
            warnings.warn("mega_mhc: token-tile counters were left inconsistent by an aborted launch; "
                          "resetting the persistent state")
            reset_sync(device)
    args = _kernel_args(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, fn_pieces, out,
                        buffers, trace, T, plan["n_tiles"], spec)
    options = dict(
        TILE_T=cfg.tile_t, SUB_TILES=cfg.sub_tiles, BLOCK_D=cfg.block_d, N_CHUNKS=plan["n_chunks"],
        SPLIT_CHUNKS=plan["split_chunks"], N_SPLITS=n_splits, R_BLOCK=plan["r_block"],
        R_PER_JOB=plan["r_per_job"], R_SPLITS=plan["r_splits"], PIPELINE_STAGES=cfg.pipeline_stages,
        RESCALE_STAGES=cfg.rescale_stages, ACC_COPIES=plan["acc_copies"], PRESPLIT=cfg.presplit_fn,
        CO_RESIDENT=False, HANDOFF=plan["handoff"], JOB_ROTATE=job_rotation,
        SINKHORN_FACTORS=cfg.sinkhorn_factors, RESCALE_AT_ONCE=plan["rescale_at_once"],
        PART_COLS=plan["part_cols"], CSQ_SLOTS=0, INTERPRETED=interpret,
        MAX_SPINS=1 << 10 if interpret else 1 << 22, TRACE=trace is not None, LEAVE_OUT=leave_out_bits,
        **_pdl_options(cfg, device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (plan["n_jobs"],)
    if try_co_resident:
        # the interpreter runs programs one at a time in program-id order, the order jobs are
        # claimed in, so there job = program id holds as it is
        co_resident = dict(options, CO_RESIDENT=True, CSQ_SLOTS=csq_slots,
                           **({} if interpret else {"launch_cooperative_grid": True}))
        if interpret or _fits_at_once(kernel, grid, args, co_resident, device):
            options = co_resident
    compiled = kernel[grid](*args, **options)
    if kept_key is not None and not (cfg.presplit_fn and kept_key[1][-1] is None):  # (no split launch to repeat)
        _kept.keep(kept_key, compiled, grid, kernel, options, device, plan=plan, cfg=cfg,
                   csq_slots=csq_slots if monotonic else 0, row_major=row_major)
    return tuple(out)


_kept = PreparedLaunches()


def forget_kept_launches() -> None:
    """The next call of every layout takes the whole path again: validation, configuration, the
    co-resident check and Triton's JIT (lowering.launch)."""
    _kept.clear()


def _relaunch(kept, streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec, fn_pieces):
    """mega_mhc's launch for a layout an earlier call validated and planned (`kept`)."""
    T, device = streams.shape[0], streams.device
    out = _outputs(spec, T, device)
    if T == 0:
        return out
    if not kept.decisions["row_major"]:  # (the key holds the strides: the same copies again)
        streams, y, post, comb, carried_pre, fn, base, scale, norm_weight = _row_major(
            streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec)
    plan = kept.decisions["plan"]
    buffers = _launch_buffers(device, plan, kept.decisions["cfg"], kept.decisions["csq_slots"])
    kept(*_kernel_args(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, fn_pieces, out,
                       buffers, None, T, plan["n_tiles"], spec))
    return out


def _outputs(spec: MhcSpec, T: int, device) -> tuple:
    """Fresh (X', u, pre', post', comb'), None where the spec has no such output."""
    sdtype, f32 = DTYPES[spec.stream_dtype], torch.float32
    n, D = spec.n, spec.dim
    return (empty((T, n, D), sdtype, device) if spec.has_post else None,
            empty((T, D), sdtype, device),
            empty((T, n), f32, device) if spec.has_coefficients else None,
            empty((T, n), f32, device) if spec.has_coefficients else None,
            empty((T, n, n), f32, device) if spec.has_coefficients else None)


def _row_major(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec) -> tuple:
    """The inputs with the layouts the kernel indexes: rows may be strided, their insides not."""
    streams = streams if streams.stride(2) == 1 else streams.contiguous()
    y, post, comb, carried_pre = (_rows(t) if used else None for t, used in (
        (y, spec.has_post), (post, spec.has_post), (comb, spec.has_post), (carried_pre, spec.pre == "carried")))
    if spec.has_coefficients:
        fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    return streams, y, post, comb, carried_pre, fn, base, scale, norm_weight.contiguous()


def _launch_buffers(device, plan: dict, cfg: LaunchConfig, csq_slots: int) -> tuple:
    """(accumulator, 1/rms workspace, sync, token-tile counters, sum(c^2) slots) of one launch:
    the persistent state for split launches, per-call buffers otherwise; the accumulator stands in
    for what the launch does not read (csq_slots 0: not MONOTONIC)."""
    n_tiles, acc_elems = plan["n_tiles"], plan["acc_elems"]
    if plan["n_splits"] > 1:
        sync, acc = _split_buffers(device, n_tiles, acc_elems)
        ws = empty((n_tiles * cfg.tile_t,), torch.float32, device)  # 1/rms per token
    else:
        # tiled: the partial sums go to a per-call buffer (every element read is written first)
        acc = empty((acc_elems,), torch.float32, device)
        sync = ws = acc  # unused
    tiles = csq = acc
    if csq_slots:
        tiles = _tile_counters(device, plan["n_splits"], plan["r_splits"], n_tiles)
        csq = empty((n_tiles * csq_slots * cfg.tile_t,), torch.float32, device)
    return acc, ws, sync, tiles, csq


def _kernel_args(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, fn_pieces, out, buffers,
                 trace, T: int, n_tiles: int, spec: MhcSpec) -> tuple:
    """The kernel's runtime arguments, in its signature's order; any tensor stands in for a
    pointer the spec never dereferences."""
    x_out, u, pre_out, post_out, comb_out = out
    acc, ws, sync, tiles, csq = buffers
    dummy = streams
    return (
        streams, y if y is not None else dummy, post if post is not None else dummy,
        comb if comb is not None else dummy, carried_pre if carried_pre is not None else dummy,
        fn if spec.has_coefficients else dummy, fn_pieces if fn_pieces is not None else dummy,
        base if spec.has_coefficients else dummy, scale if spec.has_coefficients else dummy, norm_weight,
        x_out if x_out is not None else u, u,
        pre_out if pre_out is not None else acc, post_out if post_out is not None else acc,
        comb_out if comb_out is not None else acc, acc, ws, sync, tiles, csq, trace if trace is not None else acc,
        T, streams.stride(0), streams.stride(1), y.stride(0) if y is not None else 0,
        post.stride(0) if post is not None else 0, comb.stride(0) if comb is not None else 0,
        carried_pre.stride(0) if carried_pre is not None else 0, n_tiles)


# Grids of more programs than this per SM are launched with claimed jobs without asking: learning
# a co-resident build's occupancy means compiling it, which for a grid that then does not fit is a
# build thrown away (every tuned row from T=512 up: 416 programs and more, two per SM at most; their
# claims end in the first 0.5 us of a 24 us launch or longer).
CO_RESIDENT_CANDIDATE_PER_SM = 2


def co_resident_candidate(n_jobs: int, sms: int) -> bool:
    """Whether a grid of n_jobs programs on `sms` SMs is worth compiling co-resident to learn its
    occupancy (CO_RESIDENT_CANDIDATE_PER_SM); tools.hopper_builds mirrors the launcher with it."""
    return n_jobs <= CO_RESIDENT_CANDIDATE_PER_SM * sms


def _fits_at_once(kernel, grid, args, options, device) -> bool:
    """Whether `device` holds every program of this launch at once: the occupancy of the kernel
    these options compile (its registers and shared memory; Triton returns the build a launch
    would use without launching it, the same specialisation of these arguments). Grids past
    co_resident_candidate are not compiled to find out."""
    if not co_resident_candidate(grid[0], torch.cuda.get_device_properties(device).multi_processor_count):
        return False
    build = kernel.warmup(*args, grid=grid, **options)
    build._init_handles()  # loads the binary, which is what reports its registers
    return grid[0] <= occupancy.resident_programs(build.n_regs, build.metadata.shared, build.metadata.num_warps,
                                                  device)


def _pdl_options(cfg: LaunchConfig, device: torch.device) -> dict:
    """The kernel's PDL constexpr and Triton's launch option for it: on CUDA devices of compute
    capability 9.0 and up (Hopper's griddepcontrol), where the config asks for it."""
    pdl = cfg.pdl and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def _leave_out_bits(parts) -> int:
    """The kernel's LEAVE_OUT bits for `parts` (names from LEAVE_OUT_PARTS)."""
    if isinstance(parts, str):
        parts = (parts,)
    unknown = [p for p in parts if p not in LEAVE_OUT_PARTS]
    if unknown:
        raise ValueError(f"leave_out: unknown stage-A part(s) {', '.join(map(repr, unknown))}; "
                         f"valid: {', '.join(LEAVE_OUT_PARTS)}")
    bits = 0
    for p in parts:
        bits |= LEAVE_OUT_PARTS[p]
    return bits


def trace_shape(spec: MhcSpec, n_tokens: int, config: LaunchConfig) -> tuple[int, int]:
    """The shape of the `trace` tensor a launch of `config` at `n_tokens` tokens fills."""
    return _plan(spec, config, n_tokens)["n_jobs"], len(TRACE_EVENTS)


def _check_trace(trace: torch.Tensor, plan: dict, device) -> None:
    if device.type != "cuda":
        raise ValueError("mega_mhc: trace needs a CUDA device (the interpreter has no %globaltimer)")
    want = (plan["n_jobs"], len(TRACE_EVENTS))
    if tuple(trace.shape) != want or trace.dtype != torch.int64 or trace.device != device \
            or not trace.is_contiguous():
        raise ValueError(f"mega_mhc: trace must be a contiguous int64 {list(want)} tensor on {device}, "
                         f"got {trace.dtype} {list(trace.shape)} on {trace.device}")
    trace.zero_()


def _check_out(out, spec: MhcSpec, T: int, device) -> None:
    n, D = spec.n, spec.dim
    sdtype = DTYPES[spec.stream_dtype]
    want = ((T, n, D, sdtype) if spec.has_post else None, (T, D, sdtype),
            *(((T, n, torch.float32), (T, n, torch.float32), (T, n, n, torch.float32))
              if spec.has_coefficients else (None, None, None)))
    if len(out) != 5:
        raise ValueError("mega_mhc: out must hold five entries (streams, u, pre, post, comb)")
    for name, t, w in zip(("streams", "u", "pre", "post", "comb"), out, want):
        if w is None:
            if t is not None:
                raise ValueError(f"mega_mhc: out {name} must be None for this spec")
            continue
        if t is None or tuple(t.shape) != w[:-1] or t.dtype != w[-1] or t.device != device \
                or not t.is_contiguous():
            raise ValueError(f"mega_mhc: out {name} must be a contiguous {list(w[:-1])} {w[-1]} on {device}")


def reference(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec):
    """The torch reference of the fused op: `model.mhc` + `model.layers.rms_normalize`."""
    from model.layers import rms_normalize
    from model.mhc import hc_post, hc_pre, mhc_coefficients

    x = hc_post(y, streams, post, comb) if spec.has_post else streams
    pre = post_next = comb_next = None
    if spec.has_coefficients:
        pre, post_next, comb_next = mhc_coefficients(x, fn, base, scale, spec.sinkhorn_iters,
                                                     spec.hc_eps, spec.stat_eps)
    collapsed = hc_pre(x, pre if spec.pre == "fresh" else carried_pre)
    u = (rms_normalize(collapsed, spec.norm_eps) * norm_weight).to(x.dtype)
    return (x if spec.has_post else None), u, pre, post_next, comb_next
