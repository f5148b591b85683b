"""Launch configurations: LaunchConfig, the tuned CUDA table, choose_config, and plan (the grid a
config gives at T tokens, refusing impossible combinations)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from .spec import HANDOFF_SHIFT, MAX_HANDOFF_PARTS, MAX_SUB_TILES, MhcSpec, next_pow2, slot_width

# LaunchConfig.rescale_at_once: the largest part (elements) a rescale job holds in registers at once
RESCALE_AT_ONCE_ELEMS = 16384


class Dispatch(str, enum.Enum):
    """How a split launch with rescale jobs gives each program its job: one choice, the config's
    `dispatch` (docs/mega_mhc.md, "forward progress", argues each correct).

    RESIDENT  on CUDA, where the device holds every program of the launch at once (the occupancy
              of the compiled kernel), one cooperative grid (CUDA refuses one that cannot be
              resident) with job = program id; otherwise CLAIMED. The interpreter runs programs in
              order, so job = program id there.
    CLAIMED   every program claims its job with an atomic on one counter first, any grid (the
              claims of a launch serialise there: the last comes 0.45 us after the first start at
              T=64).
    HANDOFF   job = program id with neither a claim nor a cooperative launch, any device; a rescale
              job that has waited MAX_SPINS for its tile hands its blocks to the tile's last
              stage-A arrival, which does them after its merge: correct whatever the dispatch order
              and however few programs are resident. Needs the carried pre and at most
              MAX_HANDOFF_PARTS rescale jobs a tile (plan refuses it otherwise). The T=1 row uses it
              (5.52 against 5.89 us); at T=64 it is slower (9.06 against 8.89 us) and at T=4096,
              where the grid is not resident, much slower (170 against 145: handed parts run one
              after another).
    """
    RESIDENT = "resident"
    CLAIMED = "claimed"
    HANDOFF = "handoff"


@dataclass(frozen=True)
class LaunchConfig:
    """Tiling of one launch. Times are CUDA-graph replays on one H200 (D=5120, n=4, bf16, delayed
    seam); instances differ by up to ~10% at T=64.

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
                 which waits for its atomics) takes 1.9 us after its sweep with one copy and 0.9
                 with four; the merge's loads grow with the copies (see the table)
    dispatch     split variant with epilogue jobs: how programs get their jobs (Dispatch)
    sinkhorn_factors  Sinkhorn's rounds after the first column normalisation keep the softmax
                 cells K fixed and update row and column factors (merge_codegen): 48 instead of 72
                 instructions a round on sm_90, where the merge's rounds are bound by instruction
                 issue (16 more a round cost +0.39 us at T=64). Within 1e-7 of the reference on
                 the CPU. The merge ends ~0.3 us sooner at T=64 (traces), though the launch gains
                 0-0.07 us there (the rescale jobs end as late): the T=1 and T=64 rows use it
    rescale_at_once  rescale jobs (carried pre) load their whole part, [tile_t, r_per_job * r_block],
                 before the tile's sum(c^2): one round trip, where the block loop waits for 1/rms
                 before its first block (T=64: a rescale job's work ends 1.1 us after its tile's
                 arrivals against 1.4; 8.80 against 9.02 us, T=512 24.50 against 24.72). Needs
                 rescale jobs, the carried pre, r_per_job a power of two and a part of at most
                 RESCALE_AT_ONCE_ELEMS elements (registers): plan refuses it otherwise
    pdl          on devices with programmatic dependent launch (CUDA sm_90+): the seam is launched
                 as a programmatic dependent of the stream's previous kernel, so its programs are
                 scheduled while that kernel ends; each waits for the previous kernel's writes
                 (griddepcontrol.wait) just before its first memory access, then lets the next
                 kernel launch early the same way: only launch latency and the programs' set-up
                 (job numbers, addresses; claimed jobs wait before the claim) overlap, no memory
                 access. Back to back in graph replay, with the wait at the kernel's start: T=64
                 8.39 against 8.73 us, T=1 5.00 against 5.46, T=512 23.8 against 24.5, T=4096
                 unchanged; with the wait just before the first access: T=64 7.96 against 8.37,
                 T=1 4.67 against 4.94
    """
    tile_t: int
    block_d: int
    split_cols: int
    r_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2
    pipeline_stages: int = 0
    rescale_stages: int = 0
    sub_tiles: int = 1
    acc_copies: int = 1
    dispatch: Dispatch = Dispatch.RESIDENT
    sinkhorn_factors: bool = False
    rescale_at_once: bool = False
    pdl: bool = True

    def variant(self, dim: int) -> str:
        return "tiled" if self.split_cols >= dim else "split"


# CUDA launch table: the fastest correct configuration of tools/bench_mhc.py --sweep on one H200
# (D=5120, n=4, bf16 streams, delayed seam, CUDA-graph replay; results/mega_mhc/sweep.json).
# Rows: (max T, config). Neighbours within ~3% trade places between runs.
#   T=1    160 one-chunk stage-A jobs of 32 columns + 10   (80 64-column jobs are slower, with 2
#          rescale jobs; hand-off, Sinkhorn on factors,    warps or 4)
#          the rescale at once
#   T=64   4 tiles x 27 slices of 3 chunks + 5 rescale     (one program per SM: the 148 programs of
#          jobs a tile (two blocks each), stage A           10 rescale jobs a tile put two on 16 SMs,
#          pipelined 3 deep, 4 accumulator copies          and a stage-A job that shares an SM takes
#          (128 programs), rescale pipelined 3 deep         7.2-7.7 us against 4.7-5.2 alone; 1, 8 or
#          and at once, Sinkhorn on factors                 16 copies, one-chunk or two-chunk jobs,
#                                                           32-column chunks, sub-tiles or 2 stages
#                                                           are all slower)
#   T=512  32 tiles x 8 slices + 5 rescale jobs a tile    (10 or 4 rescale jobs, 2 stages, 12-chunk
#          (two 512-column blocks each), pipelined 3     slices, fn split first and sub-tiles are
#          deep, the rescale at once                      slower; 256 stage-A jobs: at most two
#                                                           per SM)
#   T=1024 32 tiles of 32 tokens (two 16-token sub-tiles)  (16-token tiles, or a pipelined rescale,
#          x 8 slices + 7 rescale jobs a tile               are slower)
#   T=2048 64 tiles of 32 tokens x 4 slices + 4 rescale   (8 slices are slower)
#          jobs a tile, rescale pipelined 3 deep
#   above  tiles of 32 tokens x 2 slices + 4 rescale jobs  145 us at T=4096 (an unpipelined
#          a tile, rescale pipelined 3 deep                 rescale 151, 8 rescale jobs 146, fn
#                                                           split first 150, 16-token tiles 165,
#                                                           tiled 167)
# From T=1024 on, stage A sweeps 32-token tiles as two 16-token sub-tiles (`sub_tiles`): each chunk
# of fn is loaded and split once for 32 tokens, which halves fn's traffic from L2 (504 MB at
# T=4096 with 16-token tiles, more than the launch's 422 MB of HBM traffic) and takes ~18% of the
# instructions per token; at T=512 its jobs are too short to gain (5 chunks each) and at T=64 too
# few. Only where stage A projects onto fn's bf16 pieces (choose_config): other forms run the
# sub-tiles as 16-token tiles. Each sub-tile's collapse comes before the projection dots (X'
# widened to fp32 then dies before the dots): 170 registers instead of 212 at T=64, 11.0 against
# 12.0 us. 64-column chunks (128 B of a bf16 row) beat 32-column ones wherever registers allow two
# programs per SM. Also slower at every T: 64-token register tiles (a wgmma projection that reads fn
# a quarter as often), 32-column rows of given fn pieces at three programs per SM, rescale jobs claimed a few
# tiles after their tile's stage A, one accumulator per stream. Accumulator copies only pay at
# T=64: the merge sums them (~0.2 us a copy at T=1), and elsewhere the atomics do not wait.
CUDA_TABLE = (
    (16, LaunchConfig(16, 32, 32, 16, dispatch=Dispatch.HANDOFF, sinkhorn_factors=True, rescale_at_once=True)),
    (128, LaunchConfig(16, 64, 192, 5, pipeline_stages=3, acc_copies=4, rescale_stages=3, sinkhorn_factors=True,
                       rescale_at_once=True)),
    (512, LaunchConfig(16, 64, 640, 8, pipeline_stages=3, rescale_at_once=True)),
    (1024, LaunchConfig(32, 64, 640, 8, pipeline_stages=3, sub_tiles=2)),
    (2048, LaunchConfig(32, 64, 1280, 4, pipeline_stages=3, sub_tiles=2, rescale_stages=3)),
    (None, LaunchConfig(32, 64, 2560, 4, pipeline_stages=3, sub_tiles=2, rescale_stages=3)),
)
# variant="tiled" on CUDA: 16-token tiles, the whole row per program (172 us at T=4096)
CUDA_TILED = LaunchConfig(16, 64, 1 << 30, pipeline_stages=3, rescale_stages=3)


def choose_config(spec: MhcSpec, n_tokens: int, *, device: torch.device | str = "cuda",
                  variant: str | None = None) -> LaunchConfig:
    """The launch configuration for `n_tokens` tokens.

    CUDA: the table above (tuned at D=5120 on the delayed seam), adapted to the spec: for other D
    the same column counts per job apply, and a D too small to split gets 16-column slices; the
    rescale's pipeline and sub-tiles only where stage A projects onto fn's bf16
    pieces (elsewhere a sub-tiled row's sub-tiles become tiles of their own); handoff and
    rescale_at_once only where the spec's grid allows them (plan refuses them elsewhere).
    `variant` forces "split" (the table's rows are all split) or "tiled".
    CPU (the interpreter): few, large programs, since every interpreted op costs about the same.
    """
    if variant not in (None, "split", "tiled"):
        raise ValueError(f"variant must be 'split', 'tiled' or None, not {variant!r}")
    device = torch.device(device)
    D = spec.dim
    if device.type != "cuda":
        block_d = min(64, max(16, next_pow2(D) // 4))
        if variant in (None, "tiled"):
            return LaunchConfig(16, block_d, round_up(D, block_d))
        split_cols = round_up(-(-D // 2), block_d)
        if split_cols >= D:  # too small to halve at this block: one 16-column block per slice
            block_d = split_cols = 16
        return LaunchConfig(16, block_d, split_cols, r_splits=0)
    if variant == "tiled":
        cfg = dataclasses.replace(CUDA_TILED, split_cols=round_up(D, CUDA_TILED.block_d))
    else:
        cfg = next(c for max_t, c in CUDA_TABLE if max_t is None or n_tokens <= max_t)
        if cfg.split_cols >= D:  # D too small to split at these sizes: 16-column slices
            cfg = dataclasses.replace(cfg, block_d=16, split_cols=16)
    bf16_fn = projects_bf16_pieces(spec)
    if not bf16_fn and cfg.sub_tiles > 1:  # the sub-tiles as tiles of their own (see the table)
        cfg = dataclasses.replace(cfg, tile_t=cfg.tile_t // cfg.sub_tiles, sub_tiles=1)
    # the rescale's pipeline fits in stage A's shared memory only where stage A stages fn's blocks
    # too; elsewhere it would take more per program
    # (fp32 final collapse on sm_90: 69632 B instead of 40960, three programs per SM, not four)
    cfg = dataclasses.replace(cfg, rescale_stages=cfg.rescale_stages if bf16_fn else 0)
    grid = _grid(spec, cfg)
    refused_handoff = cfg.dispatch is Dispatch.HANDOFF and _handoff_refusal(spec, grid) is not None
    return dataclasses.replace(cfg, dispatch=Dispatch.RESIDENT if refused_handoff else cfg.dispatch,
                               rescale_at_once=cfg.rescale_at_once and _at_once_refusal(spec, cfg, grid) is None)


def projects_bf16_pieces(spec: MhcSpec) -> bool:
    """Stage A projects onto fn's bf16 pieces (bf16 streams with coefficients): the forms where fn
    can be split beforehand (split_fn), whose pipeline stages fn's blocks (rescale_stages), and
    where two sub-tiles sharing those blocks fit two programs per SM (sub_tiles; with fp32 streams
    the sm_90 build spills ~600 B and holds one program per SM)."""
    return spec.has_coefficients and spec.stream_dtype == "bfloat16"


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan(spec: MhcSpec, cfg: LaunchConfig, T: int) -> dict:
    """The grid a config gives at T tokens. D is n_chunks chunks of block_d; a stage-A job takes
    split_chunks of them (n_splits jobs per token tile). The rescale streams blocks of r_block
    columns ([tile_t, r_block] = 8K elements): r_per_job blocks per rescale job, r_splits jobs per
    tile (0: the last arrival rescales the whole tile). Raises ValueError for a config this spec
    cannot launch, naming the combination."""
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
    grid = _grid(spec, cfg)
    n_splits, r_splits = grid["n_splits"], grid["r_splits"]
    if n_splits >> HANDOFF_SHIFT:
        raise ValueError(f"mega_mhc: {n_splits} stage-A jobs a token tile (D={spec.dim} in slices of "
                         f"{grid['split_chunks'] * cfg.block_d} columns) exceed the sync words' count of "
                         f"{(1 << HANDOFF_SHIFT) - 1}: use wider slices (split_cols)")
    handoff = cfg.dispatch is Dispatch.HANDOFF
    for choice, asked, refusal in (("dispatch=handoff", handoff, _handoff_refusal(spec, grid)),
                                   ("rescale_at_once=True", cfg.rescale_at_once, _at_once_refusal(spec, cfg, grid))):
        if asked and refusal:
            raise ValueError(f"mega_mhc: {choice} needs {refusal} (the {spec.form()} form at D={spec.dim}): {cfg}")
    n_tiles = -(-T // cfg.tile_t)
    n_jobs = n_tiles * n_splits
    if r_splits:
        n_jobs = n_jobs * (2 if spec.pre == "fresh" else 1) + n_tiles * r_splits
    acc_copies = min(cfg.acc_copies, n_splits)
    return dict(n_tiles=n_tiles, n_chunks=grid["n_chunks"], split_chunks=grid["split_chunks"], n_splits=n_splits,
                r_block=grid["r_block"], r_per_job=grid["r_per_job"], r_splits=r_splits, n_jobs=n_jobs,
                acc_copies=acc_copies, acc_elems=n_tiles * acc_copies * cfg.tile_t * slot_width(spec.n),
                handoff=handoff, rescale_at_once=cfg.rescale_at_once, part_cols=grid["part_cols"],
                variant="tiled" if n_splits == 1 else "split")


def _grid(spec: MhcSpec, cfg: LaunchConfig) -> dict:
    """A config's jobs per token tile for this spec (they do not depend on T)."""
    n_chunks = -(-spec.dim // cfg.block_d)
    split_chunks = min(cfg.split_cols // cfg.block_d, n_chunks)
    n_splits = -(-n_chunks // split_chunks)
    r_block = max(16, min(next_pow2(spec.dim), 8192 // cfg.tile_t))
    n_rblocks = -(-spec.dim // r_block)
    r_per_job = -(-n_rblocks // max(cfg.r_splits, 1))
    r_splits = -(-n_rblocks // r_per_job) if (n_splits > 1 and cfg.r_splits > 0) else 0
    return dict(n_chunks=n_chunks, split_chunks=split_chunks, n_splits=n_splits, r_block=r_block,
                r_per_job=r_per_job, r_splits=r_splits, part_cols=r_per_job * r_block)  # (r_block: a power of two)


def _handoff_refusal(spec: MhcSpec, grid: dict) -> str | None:
    """Why handoff cannot run on this grid, or None. It needs the carried pre (a fresh collapse
    job waits on the merge: no one to hand to) and a bit per rescale part in the tile's arrival
    word."""
    if spec.pre != "carried":
        return "the carried pre"
    if not 0 < grid["r_splits"] <= MAX_HANDOFF_PARTS:
        return (f"1..{MAX_HANDOFF_PARTS} rescale jobs a token tile (split_cols < D and r_splits > 0), "
                f"not {grid['r_splits']}")
    return None


def _at_once_refusal(spec: MhcSpec, cfg: LaunchConfig, grid: dict) -> str | None:
    """Why rescale_at_once cannot run on this grid, or None: it needs rescale jobs of the carried
    pre, whose part is a power of two of blocks and fits RESCALE_AT_ONCE_ELEMS registers."""
    if spec.pre != "carried":
        return "the carried pre"
    if not grid["r_splits"]:
        return "rescale jobs (split_cols < D and r_splits > 0)"
    r_per_job = grid["r_per_job"]
    if r_per_job & (r_per_job - 1) or cfg.tile_t * grid["part_cols"] > RESCALE_AT_ONCE_ELEMS:
        return (f"a power of two of rescale blocks a job within {RESCALE_AT_ONCE_ELEMS} elements, not "
                f"{r_per_job} blocks of [{cfg.tile_t}, {grid['r_block']}]")
    return None
