"""Mega-mHC: the mHC seam between two sublayers in one generated Triton launch.

    X'   = hc_post(y, X, post, comb)          if has_post, else X         [T, n, D], stream dtype
    pre', post', comb' = mhc_coefficients(X')  if has_coefficients         fp32 [T,n], [T,n], [T,n,n]
    c    = hc_pre(X', p)                       p = carried pre, or pre' ("fresh")     [T, D]
    u    = (rms_normalize(c, norm_eps) * norm_weight).to(stream dtype)             [T, D]

`mega_mhc(...)` (here) launches it; `reference(...)` is the same maths in plain torch. Modules:
spec (MhcSpec and its forms), codegen (generate_source, the kernel cache, load) over the
template_* pieces and merge_codegen, tuning (LaunchConfig, the CUDA table, plan), state (the
persistent per-device sync buffers), inputs (validation, layouts, outputs), reference.

Design: docs/mega_mhc.md
"""

from __future__ import annotations

import warnings

import torch
import triton.language  # noqa: F401  (import Triton before any kernel module: see kernel_cache)

from .. import occupancy
from ..launch import COMPILE_OPTIONS, PreparedLaunches, empty, layout_key
from .codegen import KERNEL_NAME, generate_source, kernel_name, load, source_path
from .inputs import (check_fn_pieces, check_out, check_trace, check_tensor, new_outputs, row_major, split_fn,
                     validate)
from .merge_codegen import SINKHORN_UNROLL
from .reference import reference
from .spec import (DTYPES, HANDOFF_SHIFT, LEAVE_OUT_PARTS, MAX_HANDOFF_PARTS, MAX_SUB_TILES, PRE_MODES,
                   TRACE_EVENTS, TRACE_ROLES, TRACE_TIMES, MhcSpec, next_pow2, slot_width, unsupported_reason)
from .state import (DeviceState, counters_consistent, device_key, reserve_sync, reset_sync, split_buffers, states,
                    sync_state_is_clear, tile_counters)
from .tuning import (CUDA_TABLE, CUDA_TILED, RESCALE_AT_ONCE_ELEMS, Dispatch, LaunchConfig, choose_config, plan,
                     projects_bf16_pieces)

__all__ = [
    "CO_RESIDENT_CANDIDATE_PER_SM", "CUDA_TABLE", "CUDA_TILED", "DTYPES", "HANDOFF_SHIFT", "KERNEL_NAME",
    "LEAVE_OUT_PARTS", "MAX_HANDOFF_PARTS", "MAX_SUB_TILES", "PRE_MODES", "RESCALE_AT_ONCE_ELEMS",
    "SINKHORN_UNROLL", "TRACE_EVENTS", "TRACE_ROLES", "TRACE_TIMES",
    "DeviceState", "Dispatch", "LaunchConfig", "MhcSpec", "check_tensor", "choose_config", "co_resident_candidate",
    "counters_consistent", "device_key", "fits_at_once", "forget_kept_launches", "generate_source",
    "kernel_name", "load", "mega_mhc", "pdl_options", "plan", "projects_bf16_pieces", "reference",
    "reserve_sync", "reset_sync", "slot_width", "source_path", "split_buffers", "split_fn", "states",
    "sync_state_is_clear", "tile_counters", "trace_shape", "unsupported_reason", "validate",
]

# The launcher lives in the package module itself: tools that wrap `lowering.mega_mhc.load` or
# `.mega_mhc` (tools.inspect_kernels) and tests that replace `.fits_at_once` reach the names it
# calls.


def mega_mhc(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec: MhcSpec, *,
             fn_pieces: torch.Tensor | None = None, variant: str | None = None, config: LaunchConfig | None = None,
             out=None, trace: torch.Tensor | None = None, leave_out: tuple[str, ...] = (), job_rotation: int = 0):
    """(X' or None, u, pre' or None, post' or None, comb' or None) of the seam, in one launch.

    streams [T, n, D] (stream dtype), y [T, D] (stream dtype or fp32), post [T, n], comb [T, n, n],
    carried_pre [T, n], fn [(2+n)n, nD], base [(2+n)n], scale [3], norm_weight [D] (all fp32).
    Arguments the spec does not use may be None (and are ignored). `fn_pieces` (bf16 streams with
    coefficients): `split_fn(fn, spec)`, made once where fn does not change (frozen weights: the
    pass does it at compile time); stage A then loads them instead of splitting fn in every token
    tile. They must be fn's: nothing checks that on the GPU.
    `variant` forces "split" or "tiled" (default: chosen from T); `config` overrides the tiling
    (benchmark sweeps), and plan refuses a combination it cannot launch. `out`
    optionally supplies the five output tensors (None where the spec has no such output; tests and
    benchmarks poison them to prove every element is written). `trace` (CUDA only): an int64
    [programs, len(TRACE_EVENTS)] tensor (`trace_shape`) that a traced build of the kernel fills
    with per-program event times (see TRACE_EVENTS). `leave_out` (a timing diagnostic, names from
    LEAVE_OUT_PARTS) compiles those parts of stage A out: the outputs are then wrong by design.
    `job_rotation` (a test of Dispatch.HANDOFF, which it needs) numbers program p's job
    (p + job_rotation) % jobs: with the tiles' rescale jobs first, the interpreter (programs one at
    a time, in order) runs each before its tile's stage A, so that every one hands its blocks off.
    Inputs are never modified. Outside a CUDA graph a call costs 0.1-0.3 ms of host time (Triton's
    launcher with ~30 arguments, plus this wrapper): run it under CUDA graphs.
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
        check_fn_pieces(fn_pieces, spec, streams.device)
    leave_out_bits = _leave_out_bits(leave_out)
    T, device = streams.shape[0], streams.device
    if out is None:
        out = new_outputs(spec, T, device)
    else:
        check_out(out, spec, T, device)
    if T == 0:
        return tuple(out)
    given = (streams, y, post, comb, carried_pre, fn, base, scale, norm_weight)
    streams, y, post, comb, carried_pre, fn, base, scale, norm_weight = laid_out = row_major(*given, spec)
    kept_layout = all(a is b or b is None for a, b in zip(given, laid_out))  # (None: an input the spec ignores)

    cfg = config or choose_config(spec, T, device=device, variant=variant)
    launch_plan = plan(spec, cfg, T)
    if trace is not None:
        check_trace(trace, launch_plan, device)
    rotation_ok = job_rotation == 0 or (launch_plan["handoff"] and 0 <= job_rotation < launch_plan["n_jobs"])
    if not isinstance(job_rotation, int) or not rotation_ok:
        raise ValueError(f"mega_mhc: job_rotation={job_rotation!r} needs a launch with handoff (a split config "
                         f"with dispatch=handoff and rescale jobs, carried pre) and a value in "
                         f"0..{launch_plan['n_jobs'] - 1}; "
                         f"this one is {cfg} (handoff {launch_plan['handoff']})")
    n_splits = launch_plan["n_splits"]
    interpret = device.type != "cuda"
    kernel = load(spec, interpret=interpret)

    # A co-resident launch with epilogue jobs and the carried pre runs MONOTONIC (see the kernel)
    # on its own token-tile counters and sum(c^2) slots; a launch that turns out not to fit at
    # once never reads them, and a grid too large to be co-resident (fits_at_once refuses it
    # without a build) does not get them
    try_co_resident = cfg.dispatch is Dispatch.RESIDENT and launch_plan["r_splits"] > 0
    csq_slots = next_pow2(n_splits) if try_co_resident and spec.pre == "carried" else 0
    monotonic = bool(csq_slots) and (interpret or co_resident_candidate(
        launch_plan["n_jobs"], torch.cuda.get_device_properties(device).multi_processor_count))
    buffers = _launch_buffers(device, launch_plan, cfg, csq_slots if monotonic else 0)
    if interpret:  # host memory: checking is free
        sync, acc, tiles = buffers[2], buffers[0], buffers[3]
        if n_splits > 1 and (bool(sync.any()) or bool(acc.any())):
            warnings.warn("mega_mhc: persistent state was left dirty by an aborted launch; resetting it")
            reset_sync(device)
        if monotonic and not counters_consistent(tiles, n_splits, launch_plan["r_splits"]):
            warnings.warn("mega_mhc: token-tile counters were left inconsistent by an aborted launch; "
                          "resetting the persistent state")
            reset_sync(device)
    args = _kernel_args(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, fn_pieces, out,
                        buffers, trace, T, launch_plan["n_tiles"], spec)
    options = dict(
        TILE_T=cfg.tile_t, SUB_TILES=cfg.sub_tiles, BLOCK_D=cfg.block_d, N_CHUNKS=launch_plan["n_chunks"],
        SPLIT_CHUNKS=launch_plan["split_chunks"], N_SPLITS=n_splits, R_BLOCK=launch_plan["r_block"],
        R_PER_JOB=launch_plan["r_per_job"], R_SPLITS=launch_plan["r_splits"],
        PIPELINE_STAGES=cfg.pipeline_stages,
        RESCALE_STAGES=cfg.rescale_stages, ACC_COPIES=launch_plan["acc_copies"], PRESPLIT=fn_pieces is not None,
        CO_RESIDENT=False, HANDOFF=launch_plan["handoff"], JOB_ROTATE=job_rotation,
        SINKHORN_FACTORS=cfg.sinkhorn_factors, RESCALE_AT_ONCE=launch_plan["rescale_at_once"],
        PART_COLS=launch_plan["part_cols"], CSQ_SLOTS=0, INTERPRETED=interpret,
        MAX_SPINS=1 << 10 if interpret else 1 << 22, TRACE=trace is not None, LEAVE_OUT=leave_out_bits,
        **pdl_options(cfg, device),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **COMPILE_OPTIONS)
    grid = (launch_plan["n_jobs"],)
    if try_co_resident:
        # the interpreter runs programs one at a time in program-id order, the order jobs are
        # claimed in, so there job = program id holds as it is
        co_resident = dict(options, CO_RESIDENT=True, CSQ_SLOTS=csq_slots,
                           **({} if interpret else {"launch_cooperative_grid": True}))
        if interpret or fits_at_once(kernel, grid, args, co_resident, device):
            options = co_resident
    compiled = kernel[grid](*args, **options)
    if kept_key is not None:
        _kept.keep(kept_key, compiled, grid, kernel, options, device, plan=launch_plan, cfg=cfg,
                   csq_slots=csq_slots if monotonic else 0, row_major=kept_layout)
    return tuple(out)


_kept = PreparedLaunches()


def forget_kept_launches() -> None:
    """The next call of every layout takes the whole path again: validation, configuration, the
    co-resident check and Triton's JIT (lowering.launch)."""
    _kept.clear()


def _relaunch(kept, streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec, fn_pieces):
    """mega_mhc's launch for a layout an earlier call validated and planned (`kept`)."""
    T, device = streams.shape[0], streams.device
    out = new_outputs(spec, T, device)
    if T == 0:
        return out
    if not kept.decisions["row_major"]:  # (the key holds the strides: the same copies again)
        streams, y, post, comb, carried_pre, fn, base, scale, norm_weight = row_major(
            streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, spec)
    launch_plan = kept.decisions["plan"]
    buffers = _launch_buffers(device, launch_plan, kept.decisions["cfg"], kept.decisions["csq_slots"])
    kept(*_kernel_args(streams, y, post, comb, carried_pre, fn, base, scale, norm_weight, fn_pieces, out,
                       buffers, None, T, launch_plan["n_tiles"], spec))
    return out


def _launch_buffers(device, launch_plan: dict, cfg: LaunchConfig, csq_slots: int) -> tuple:
    """(accumulator, 1/rms workspace, sync, token-tile counters, sum(c^2) slots) of one launch:
    the persistent state for split launches, per-call buffers otherwise; the accumulator stands in
    for what the launch does not read (csq_slots 0: not MONOTONIC)."""
    n_tiles, acc_elems = launch_plan["n_tiles"], launch_plan["acc_elems"]
    if launch_plan["n_splits"] > 1:
        sync, acc = split_buffers(device, n_tiles, acc_elems)
        ws = empty((n_tiles * cfg.tile_t,), torch.float32, device)  # 1/rms per token
    else:
        # tiled: the partial sums go to a per-call buffer (every element read is written first)
        acc = empty((acc_elems,), torch.float32, device)
        sync = ws = acc  # unused
    tiles = csq = acc
    if csq_slots:
        tiles = tile_counters(device, launch_plan["n_splits"], launch_plan["r_splits"], n_tiles)
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


def fits_at_once(kernel, grid, args, options, device) -> bool:
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


def pdl_options(cfg: LaunchConfig, device: torch.device) -> dict:
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
    return plan(spec, config, n_tokens)["n_jobs"], len(TRACE_EVENTS)

