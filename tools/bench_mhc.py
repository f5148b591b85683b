"""H200 benchmark of the fused Mega-mHC kernel (lowering/mega_mhc/) against plain torch.

    python3 -m megafuse.tools.bench_mhc --out results/mega_mhc/bench.json [--sweep] [--trace] [--dry-run] [--tokens 1,64]
    python3 -m megafuse.tools.bench_mhc --leave-out --out results/mega_mhc/leave_out.json [--tokens 64,512,4096]

V4.1-Flash seam: D=5120, n=4, bf16 streams, the delayed form (post + coefficients + carried pre +
RMSNorm), 20 Sinkhorn iterations, eps 1e-6 / 1e-20; T in {1, 64, 512, 4096}. In one run:

1. correctness first, on CUDA: every seam form (delayed, first/Engram, final collapse, V4 fresh
   with and without post) in bf16 plus the delayed form in fp32, each through the split variant
   (last-arrival and epilogue-job modes, stage A in one tile or two sub-tiles) and the tiled one,
   on fresh random inputs with the outputs poisoned (NaN) beforehand, against `mega_mhc.reference`
   (cuBLAS fp32); a CUDA-graph capture replayed on new inputs; the persistent sync state all-zero
   at the end;
2. `--sweep`: a set of launch configurations per T (correct first, then graph-replay time); the
   fastest correct one is what step 3 times (the data behind `mega_mhc.choose_config`);
   `--trace`: where that configuration's launch spends its time, from a traced build of the kernel
   (per program, the GPU's %globaltimer at each phase: claimed, stage A done, arrived, merged,
   ready, rescaled, ended; and its SM), replayed in a CUDA graph and summarised per role, with the
   programs that ran beside another on their SM;
3. per T, medians: CUDA-graph replay (`triton.testing.do_bench_cudagraph`) of (a) the fused kernel,
   (b) the same chain as plain torch (model.mhc + rms_normalize) under `torch.compile` (default
   mode), (c) eager; plain `do_bench` of the fused kernel (eager launches); the fused kernel in
   graph replay with L2 flushed before every call (fn then comes from HBM, as in a real model);
   with fn's bf16 pieces given (`split_fn` once: what the pass does for frozen weights); without
   programmatic dependent launch (`LaunchConfig.pdl=False`); and after a small kernel launched
   without it (a 1 MB fill), whose end the seam's launch cannot overlap (back to back, each seam
   launch overlaps the previous one's end: PDL);
4. roofline floor = bytes / 4.3 TB/s with bytes = 20*D*T (bf16 X, y in; X', u out) + fn's bytes;
   achieved GB/s; ratios; the issue's targets (>= 8x vs compile and <= 2x max(floor, 4 us) for
   T <= 512; <= 1.6x floor at T = 4096).

`--dry-run` runs the correctness part on CPU through the Triton interpreter at toy sizes (its JSON goes
to a temp file unless --out names one: results/ holds H200 runs).
`--leave-out` replaces steps 2-4 with a timing diagnostic: per T, the tuned launch as it is and with
each part of stage A compiled out in turn (`mega_mhc(leave_out=...)`: fn's loads, the projection
dots, the X' stores, the parked collapse's store), each timed in graph replay and traced; what a
part costs is the difference (the outputs are wrong by design, so nothing is checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time

import torch
import triton

from megafuse.tools.bench_common import HBM_BYTES_PER_S, Stages, default_out, open_log, require_cuda, time_cold_l2_us, time_eager_us, time_graph_us
from megafuse.tools.common import median
from megafuse.lowering import mega_mhc as mm
from megafuse.lowering.mega_mhc import LaunchConfig, MhcSpec
from megafuse.model.mhc import sinkhorn

LAUNCH_FLOOR_US = 4.0
TOKENS = (1, 64, 512, 4096)
V41 = MhcSpec(n=4, dim=5120, sinkhorn_iters=20, hc_eps=1e-6, stat_eps=1e-20, norm_eps=1e-20,
              has_post=True, has_coefficients=True, pre="carried", stream_dtype="bfloat16")
FORMS = {  # name -> (has_post, has_coefficients, pre)
    "delayed": (True, True, "carried"),
    "first_or_engram": (False, True, "carried"),
    "final_collapse": (True, False, "carried"),
    "v4_fresh": (True, True, "fresh"),
    "v4_fresh_no_post": (False, True, "fresh"),
}
OUT_NAMES = ("streams", "u", "pre", "post", "comb")


# ------------------------------------------------------------------------------------------------
# inputs and correctness
# ------------------------------------------------------------------------------------------------

def make_inputs(spec: MhcSpec, T: int, device, seed: int):
    """Realistic scales: unit streams and output, comb a real Sinkhorn output, fn ~ N(0, 0.1/sqrt(nD))."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n, D = spec.n, spec.dim
    dtype = mm.DTYPES[spec.stream_dtype]
    streams = torch.randn(T, n, D, generator=g)
    y = torch.randn(T, D, generator=g)
    post = 2 * torch.sigmoid(torch.randn(T, n, generator=g))
    comb = sinkhorn(torch.randn(T, n, n, generator=g) + 2 * torch.eye(n), 20, 1e-6)
    carried = torch.sigmoid(torch.randn(T, n, generator=g)) + 1e-6
    fn = torch.randn((2 + n) * n, n * D, generator=g) * (0.1 / (n * D) ** 0.5)
    base = torch.randn((2 + n) * n, generator=g) * 0.5
    base[2 * n:] += (2 * torch.eye(n)).flatten()
    scale = 1 + 0.1 * torch.randn(3, generator=g)
    weight = 1 + 0.1 * torch.randn(D, generator=g)
    to = lambda t, dt=torch.float32: t.to(dt).to(device)
    return (to(streams, dtype), to(y, dtype), to(post), to(comb), to(carried), to(fn), to(base),
            to(scale), to(weight))


def poisoned_outputs(spec: MhcSpec, T: int, device):
    n, D = spec.n, spec.dim
    dtype = mm.DTYPES[spec.stream_dtype]
    nan = lambda *shape, dt=torch.float32: torch.full(shape, float("nan"), dtype=dt, device=device)
    coeffs = (nan(T, n), nan(T, n), nan(T, n, n)) if spec.has_coefficients else (None, None, None)
    return (nan(T, n, D, dt=dtype) if spec.has_post else None, nan(T, D, dt=dtype), *coeffs)


def compare(spec: MhcSpec, got, ref) -> dict:
    """Relative L2 error per output; NaN (an unwritten element) never passes."""
    tol_io = 1e-5 if spec.stream_dtype == "float32" else 1e-2
    r = {"ok": True}
    for name, a, b in zip(OUT_NAMES, got, ref):
        if b is None:
            if a is not None:
                r["ok"] = False
                r[name] = "unexpected output"
            continue
        a, b = a.float(), b.float()
        finite = bool(torch.isfinite(a).all())
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if finite else float("nan")
        tol = tol_io if name in ("streams", "u") else 1e-5
        r[name] = err
        r["ok"] &= finite and err <= tol
    return r


def check_one(spec: MhcSpec, T: int, device, seed: int, *, variant=None, config=None, pieces=False) -> dict:
    args = make_inputs(spec, T, device, seed)
    out = poisoned_outputs(spec, T, device)
    kw = {"fn_pieces": mm.split_fn(args[5], spec)} if pieces else {}
    got = mm.mega_mhc(*args, spec, variant=variant, config=config, out=out, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return compare(spec, got, mm.reference(*args, spec))


def correctness_suite(device, dry: bool, log) -> list:
    D = 160 if dry else 5120
    odd_D = 96 if dry else 1000  # not a multiple of any block
    rows = []
    runs = []
    for name, (post, coeffs, pre) in FORMS.items():
        spec = MhcSpec(4, D, 20, 1e-6, 1e-20, 1e-20, post, coeffs, pre, "bfloat16")
        # (on CUDA one variant per form keeps compile time down; the CPU tests cover the rest)
        if dry or name != "v4_fresh":  # (CUDA: v4_fresh runs in the epilogue-job check below)
            runs += [(name, spec, 37, "split", None)] + ([(name, spec, 3, "tiled", None)] if dry else [])
    delayed = MhcSpec(4, D, 20, 1e-6, 1e-20, 1e-20, True, True, "carried", "bfloat16")
    if dry:
        runs += [("delayed/epilogue-jobs", delayed, 37, None, LaunchConfig(16, 32, 64, r_splits=2)),
                 ("v4_fresh/epilogue-jobs", dataclasses.replace(delayed, pre="fresh"), 37, None,
                  LaunchConfig(16, 32, 64, r_splits=2))]
    else:
        runs += [("delayed/last-arrival", delayed, 50, None, LaunchConfig(16, 64, 128, r_splits=0)),
                 ("v4_fresh/epilogue-jobs", dataclasses.replace(delayed, pre="fresh"), 70, None,
                  LaunchConfig(16, 64, 512, r_splits=8)),
                 ("delayed", delayed, 2100, "tiled", None)]
    # two sub-tiles per token tile (the tuned rows from T=1024 on), every form that has them, a
    # last tile whose second sub-tile is partly (T = 2100, 1100) or wholly (T = 1040) past T
    first = MhcSpec(4, D, 20, 1e-6, 1e-20, 1e-20, False, True, "carried", "bfloat16")
    sub = LaunchConfig(32, 32, 64, r_splits=3, pipeline_stages=3, sub_tiles=2, rescale_stages=2) if dry else None
    runs += [("delayed/sub-tiles", delayed, 37 if dry else 2100, None, sub),
             ("v4_fresh/sub-tiles", dataclasses.replace(delayed, pre="fresh"), 21 if dry else 1100, None, sub),
             ("first_or_engram/sub-tiles", first, 37 if dry else 1040, None, sub)]
    # fn's bf16 pieces given (split_fn once): the tiled and the epilogue-job split variants, delayed
    # and fresh
    runs += [("delayed/tiled/given-fn-pieces", delayed, 37 if dry else 600, None,
              LaunchConfig(16, 32, 4096 if dry else 5120, pipeline_stages=3)),
             ("v4_fresh/given-fn-pieces", dataclasses.replace(delayed, pre="fresh"), 37 if dry else 300, None,
              LaunchConfig(16, 32, 64 if dry else 512, r_splits=2 if dry else 8))]
    # partial sums spread over accumulator copies (the tuned rows at T <= 128), the fresh collapse's
    # sum(c^2) in them too
    runs += [("v4_fresh/acc-copies", dataclasses.replace(delayed, pre="fresh"), 37 if dry else 64, None,
              LaunchConfig(16, 32, 32, r_splits=3, acc_copies=3) if dry else None)]
    # jobs claimed with an atomic (Dispatch.CLAIMED: what a grid too large for the device at once
    # gets) at a size whose tuned launch is co-resident
    claimed = LaunchConfig(16, 32, 32, r_splits=3, acc_copies=3) if dry else mm.choose_config(delayed, 64)
    runs += [("delayed/claimed-jobs", delayed, 37 if dry else 64, None,
              dataclasses.replace(claimed, dispatch=mm.Dispatch.CLAIMED)),
             # neither claimed nor cooperative: a rescale job that waits too long hands off its blocks
             ("delayed/handoff", delayed, 37 if dry else 64, None, dataclasses.replace(claimed, dispatch=mm.Dispatch.HANDOFF)),
             # Sinkhorn's rounds on row and column factors of the fixed softmax cells, and on the
             # cells; the rescale jobs' parts loaded at once, and in the block loop (whichever the
             # tuned row does, the other is checked too)
             ("delayed/sinkhorn-factors", delayed, 37 if dry else 64, None,
              dataclasses.replace(claimed, sinkhorn_factors=True)),
             ("delayed/sinkhorn-cells", delayed, 37 if dry else 64, None,
              dataclasses.replace(claimed, sinkhorn_factors=False)),
             ("delayed/rescale-at-once", delayed, 37 if dry else 64, None,
              dataclasses.replace(claimed, rescale_at_once=True)),
             ("delayed/rescale-loop", delayed, 37 if dry else 64, None,
              dataclasses.replace(claimed, rescale_at_once=False)),
             # co-resident with the carried pre (MONOTONIC tile counters) and fn's pieces given
             # (split once, as for frozen weights); without programmatic dependent launch
             ("delayed/given-fn-pieces", delayed, 37 if dry else 64, None, None),
             ("delayed/no-pdl", delayed, 37 if dry else 64, None, dataclasses.replace(claimed, dispatch=mm.Dispatch.RESIDENT,
                                                                                       pdl=False))]
    fp32 = dataclasses.replace(delayed, stream_dtype="float32")
    runs += [("delayed fp32", fp32, 37, "split", None)] + ([("delayed fp32", fp32, 3, "tiled", None)] if dry else [])
    odd = dataclasses.replace(delayed, dim=odd_D)
    runs += [("delayed odd D", odd, 5, "split", None), ("delayed odd D", odd, 37, "tiled", None),
             ("delayed odd D/sub-tiles", odd, 37 if dry else 1100, None, sub)]
    for i, (name, spec, T, variant, cfg) in enumerate(runs):
        t0 = time.time()
        try:
            r = check_one(spec, T, device, seed=100 + i, variant=variant, config=cfg,
                          pieces=name.endswith("given-fn-pieces"))
        except Exception as e:
            r = {"ok": False, "error": repr(e)[:800]}
        used = cfg or mm.choose_config(spec, T, device=device, variant=variant)
        r.update(form=name, dtype=spec.stream_dtype, D=spec.dim, T=T, config=dataclasses.asdict(used),
                 variant=mm.plan(spec, used, T)["variant"], seconds=round(time.time() - t0, 2))
        rows.append(r)
        errs = {k: (f"{r[k]:.1e}" if isinstance(r.get(k), float) else r.get(k)) for k in OUT_NAMES if k in r}
        log(f"  {name:24s} {spec.stream_dtype:8s} D={spec.dim:5d} T={T:5d} {r['variant']:5s} "
            f"{'ok' if r['ok'] else 'FAIL'} {errs} {r.get('error', '')}")
    return rows


def graph_replay_check(device, log) -> dict:
    """Capture the fused op once, then replay it on new inputs copied into the static ones."""
    out = {}
    for T in (64,):
        args = make_inputs(V41, T, device, seed=7 + T)
        mm.mega_mhc(*args, V41)  # compile and allocate the sync buffer outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(g):
            static_out = mm.mega_mhc(*args, V41)
        torch.cuda.current_stream().wait_stream(stream)
        res = []
        for rep in range(3):
            fresh = make_inputs(V41, T, device, seed=900 + rep + T)
            for dst, src in zip(args, fresh):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            res.append(compare(V41, static_out, mm.reference(*args, V41)))
        out[T] = {"replays": res, "ok": all(x["ok"] for x in res)}
        log(f"  graph replay T={T}: {'ok' if out[T]['ok'] else 'FAIL'} {res[-1]}")
    return out


def sync_state_clean() -> dict:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {dev: int((st.sync != 0).sum()) if st.sync is not None else 0 for dev, st in mm.states.items()}


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------

def sweep_configs(T: int) -> list[LaunchConfig]:
    """Launch configurations timed by --sweep (after the tuned one): per band of T, the tuned row's
    neighbours in tiling, rescale jobs and pipelining, and, from T=1024 on, the split tiles' sizes
    with and without sub-tiles and the tiled variant."""
    C = LaunchConfig
    if T <= 16:
        return [C(16, 64, 64, 8), C(16, 32, 32, 16, num_warps=2), C(16, 32, 64, 8)]
    if T <= 128:
        # 4 tiles x 27 slices + 5 rescale jobs a tile = 128 programs, one per SM; first the tuned row
        # without its pipelined rescale, and a row of 32 rescale jobs a tile with one copy
        return [C(16, 64, 192, 5, pipeline_stages=3, acc_copies=4),
                C(16, 64, 192, 32, pipeline_stages=3), C(16, 64, 192, 5, pipeline_stages=3),
                C(16, 64, 192, 5, pipeline_stages=3, acc_copies=8), C(16, 64, 192, 32, pipeline_stages=3, acc_copies=4),
                C(16, 64, 128, 32, pipeline_stages=3, acc_copies=4)]
    if T <= 1024:
        # 32 tiles x 8 slices = 256 stage-A jobs over 132 SMs: at most two per SM (10 slices put
        # three on 56 SMs); 10 rescale jobs a tile are one 512-column block each
        return [C(16, 64, 640, 10, pipeline_stages=3), C(16, 64, 640, 4, pipeline_stages=3),
                C(16, 64, 640, 10, pipeline_stages=2), C(16, 64, 768, 10, pipeline_stages=3),
                C(32, 64, 320, 8, pipeline_stages=3, sub_tiles=2)]
    return [C(32, 64, 2560, 4, pipeline_stages=3, sub_tiles=2), C(32, 64, 2560, 8, pipeline_stages=3, sub_tiles=2,
                                                                  rescale_stages=3),
            C(16, 64, 2560, 4, pipeline_stages=3, rescale_stages=3),
            C(16, 64, 5120, pipeline_stages=3, rescale_stages=3)]


def run_sweep(T: int, device, log) -> list:
    args = make_inputs(V41, T, device, seed=T + 11)
    ref = mm.reference(*args, V41)
    rows = []
    tuned = mm.choose_config(V41, T, device=device)
    # the tuned row with each launch choice flipped, as well (the other dispatch of handoff and
    # resident; Sinkhorn on factors or cells; the rescale jobs' parts at once or in the loop)
    other_dispatch = mm.Dispatch.RESIDENT if tuned.dispatch is mm.Dispatch.HANDOFF else mm.Dispatch.HANDOFF
    configs = [tuned] + [c for c in sweep_configs(T) if c != tuned] + [
        dataclasses.replace(tuned, dispatch=other_dispatch),
        *(dataclasses.replace(tuned, **{flag: not getattr(tuned, flag)}) for flag in ("sinkhorn_factors", "rescale_at_once"))]
    for cfg in dict.fromkeys(configs):  # (a neighbour may be the tuned row)
        r = {"config": dataclasses.asdict(cfg)}
        try:  # (a flipped flag may be one the plan refuses at this T)
            r["plan"] = mm.plan(V41, cfg, T)
            t0 = time.time()
            got = mm.mega_mhc(*args, V41, config=cfg, out=poisoned_outputs(V41, T, device))
            torch.cuda.synchronize()
            r["compile_s"] = round(time.time() - t0, 1)
            r["check"] = compare(V41, got, ref)
            r["graph_us"] = time_graph_us(lambda: mm.mega_mhc(*args, V41, config=cfg), rep=40)
        except Exception as e:
            r["error"] = repr(e)[:500]
        rows.append(r)
        log(f"  T={T:5d} {cfg} jobs={r['plan']['n_jobs']} -> {r.get('graph_us', float('nan')):8.2f} us "
            f"{'ok' if r.get('check', {}).get('ok') else 'FAIL ' + str(r.get('check', '')) + r.get('error', '')[:300]}")
    return rows


def trace_T(T: int, device, cfg: LaunchConfig, log, replays: int = 7, leave_out: tuple = ()) -> dict:
    """Where one launch's time goes: a CUDA graph of one traced launch (`mega_mhc(trace=...)`) is
    replayed `replays` times; per replay, every program's event times are taken relative to the
    earliest program start, and summarised per role (median and max over programs); the medians of
    those over the replays are reported, in us, with the span (first start to last end)."""
    args = make_inputs(V41, T, device, seed=T + 5)
    trace = torch.zeros(mm.trace_shape(V41, T, cfg), dtype=torch.int64, device=device)
    mm.mega_mhc(*args, V41, config=cfg, trace=trace, leave_out=leave_out)  # compile, warm up: outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mm.mega_mhc(*args, V41, config=cfg, trace=trace, leave_out=leave_out)
    rows = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        rows.append(trace.cpu())
    out = {"config": dataclasses.asdict(cfg), "plan": mm.plan(V41, cfg, T), "replays": replays,
           **summarise_traces(rows)}
    log(f"  T={T} trace: span {out['span_us']:.2f} us, {out['plan']['n_jobs']} programs ({cfg})")
    for role, r in out["roles"].items():
        cells = "  ".join(f"{name} {r[name]['median_us']:.2f}/{r[name]['max_us']:.2f}"
                          + (f" (n={r[name]['n']})" if r[name]["n"] != r["programs"] else "")
                          for name in mm.TRACE_TIMES if name in r)
        log(f"    {role:9s} x{r['programs']:<4d} ({r['sharing_sm']:g} beside another on their SM) "
            f"median/max us after first start: {cells}")
    return out


def leave_out_T(T: int, device, cfg: LaunchConfig, log) -> list:
    """Where stage A's time goes, by difference: the launch as tuned, then with each part of stage A
    compiled out in turn (`mega_mhc(leave_out=...)`: wrong outputs by design, timing only); per
    variant the CUDA-graph time and the traced timeline (stage A's end, the span)."""
    args = make_inputs(V41, T, device, seed=T + 17)
    rows = []
    for part in (None,) + tuple(mm.LEAVE_OUT_PARTS):
        left = (part,) if part else ()
        us = time_graph_us(lambda: mm.mega_mhc(*args, V41, config=cfg, leave_out=left), rep=40)
        trace = trace_T(T, device, cfg, lambda msg: None, leave_out=left)
        stage_a = trace["roles"].get("stage A") or trace["roles"].get("tiled")
        row = {"left_out": part, "graph_us": us, "span_us": trace["span_us"],
               "stage_a_work_us": stage_a["work"], "roles": trace["roles"]}
        if rows:
            row["graph_saved_us"] = rows[0]["graph_us"] - us
            row["stage_a_saved_us"] = rows[0]["stage_a_work_us"]["median_us"] - stage_a["work"]["median_us"]
        rows.append(row)
        log(f"  T={T:5d} {'(nothing left out)' if part is None else 'without ' + part:24s} graph {us:8.2f} us, "
            f"span {trace['span_us']:8.2f}, stage A done {stage_a['work']['median_us']:8.2f}/"
            f"{stage_a['work']['max_us']:.2f} (median/max)"
            + (f", saves {row['graph_saved_us']:+.2f} us (stage A {row['stage_a_saved_us']:+.2f})" if part else ""))
    return rows


def summarise_traces(rows: list) -> dict:
    """Per launch (an int64 [programs, len(mm.TRACE_EVENTS)] trace), event times relative to the
    earliest program start, summarised per role as {programs, sharing_sm, event: {n, median_us,
    max_us}} (n: programs that reached the event; sharing_sm: programs that ran beside another
    program of the launch on their SM, which slows both); then the median of each number over the
    launches, with `span_us` (first start to last end)."""
    times = mm.TRACE_TIMES
    role_col = mm.TRACE_EVENTS.index("role")
    summaries = []
    for t in rows:
        start = t[:, 0][t[:, 0] > 0].min()
        s = {"span_us": float((t[:, times.index("end")].max() - start) / 1e3), "roles": {}}
        sharing = _sharing_an_sm(t)
        for role_id, role in enumerate(mm.TRACE_ROLES):
            in_role = t[:, role_col] == role_id
            mine = t[in_role]
            if len(mine) == 0:
                continue
            r = s["roles"][role] = {"programs": len(mine), "sharing_sm": int(sharing[in_role].sum())}
            for k, name in enumerate(times):
                hit = mine[:, k][mine[:, k] > 0]
                if len(hit):
                    us = (hit - start).double() / 1e3
                    r[name] = {"n": len(hit), "median_us": float(us.median()), "max_us": float(us.max())}
        summaries.append(s)
    out = {"span_us": median([s["span_us"] for s in summaries]), "roles": {}}
    for role, r0 in summaries[0]["roles"].items():
        role_out = out["roles"][role] = {
            "programs": r0["programs"],
            "sharing_sm": median([s["roles"][role]["sharing_sm"] for s in summaries if role in s["roles"]])}
        for name in times:
            vals = [s["roles"][role][name] for s in summaries if name in s["roles"].get(role, {})]
            if vals:
                role_out[name] = {"n": vals[0]["n"], "median_us": median([v["median_us"] for v in vals]),
                                  "max_us": median([v["max_us"] for v in vals])}
    return out


def _sharing_an_sm(t: torch.Tensor) -> torch.Tensor:
    """Per program of one traced launch: did another program run on its SM while it ran (their
    [start, end] overlap)?"""
    sm, start, end = (t[:, mm.TRACE_EVENTS.index(name)] for name in ("sm", "start", "end"))
    same_sm = sm[:, None] == sm[None, :]
    overlap = (start[:, None] < end[None, :]) & (start[None, :] < end[:, None])
    return (same_sm & overlap).sum(1) > 1  # (each program overlaps itself)


def seam_bytes(T: int, spec: MhcSpec = V41) -> int:
    fn_bytes = (2 + spec.n) * spec.n * spec.n * spec.dim * 4
    return 20 * spec.dim * T + fn_bytes


def bench_T(T: int, device, cfg: LaunchConfig, log) -> dict:
    args = make_inputs(V41, T, device, seed=T)
    r = {"T": T, "config": dataclasses.asdict(cfg), "plan": mm.plan(V41, cfg, T)}
    got = mm.mega_mhc(*args, V41, config=cfg, out=poisoned_outputs(V41, T, device))
    torch.cuda.synchronize()
    r["check"] = compare(V41, got, mm.reference(*args, V41))
    log(f"  T={T}: check {r['check']}")
    fused = lambda: mm.mega_mhc(*args, V41, config=cfg)
    pieces = mm.split_fn(args[5], V41)  # fn's bf16 pieces made once, as the pass does for frozen weights
    got = mm.mega_mhc(*args, V41, config=cfg, fn_pieces=pieces, out=poisoned_outputs(V41, T, device))
    torch.cuda.synchronize()
    r["check_frozen"] = compare(V41, got, mm.reference(*args, V41))
    frozen = lambda: mm.mega_mhc(*args, V41, config=cfg, fn_pieces=pieces)
    no_pdl = dataclasses.replace(cfg, pdl=False)
    chain = lambda *a: mm.reference(*a, V41)  # the unfused chain: model.mhc + rms_normalize
    compiled = torch.compile(chain, dynamic=False)
    t0 = time.time()
    compiled(*args)  # compile outside the timed region
    r["torch_compile_s"] = round(time.time() - t0, 1)
    r["fused_graph_us"] = time_graph_us(fused)
    # frozen weights (fn's pieces given); without PDL; after a kernel launched without PDL (a 1 MB
    # fill, L2 kept warm), which does not let the seam's launch overlap its end
    r["fused_frozen_graph_us"] = time_graph_us(frozen)
    r["fused_no_pdl_graph_us"] = time_graph_us(lambda: mm.mega_mhc(*args, V41, config=no_pdl))
    r["fused_after_plain_kernel_us"] = time_cold_l2_us(fused, n=30, flush_mb=1, reps=9)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):  # no sync: at small T the GPU keeps up, so this is the host's cost per call
        fused()
    r["host_us_per_call"] = (time.perf_counter() - t0) / 100 * 1e6
    torch.cuda.synchronize()
    r["fused_eager_launch_us"] = time_eager_us(fused)
    r["fused_graph_cold_l2_us"] = time_cold_l2_us(fused, n=30, flush_mb=128, reps=9)
    r["compile_graph_us"] = time_graph_us(lambda: compiled(*args))
    r["eager_graph_us"] = time_graph_us(lambda: chain(*args))
    nbytes = seam_bytes(T)
    floor = nbytes / HBM_BYTES_PER_S * 1e6
    practical = max(floor, LAUNCH_FLOOR_US)
    r.update(bytes=nbytes, floor_us=floor, practical_floor_us=practical,
             achieved_gbps=nbytes / r["fused_graph_us"] / 1e3,
             achieved_gbps_cold_l2=nbytes / r["fused_graph_cold_l2_us"] / 1e3,
             speedup_vs_compile=r["compile_graph_us"] / r["fused_graph_us"],
             speedup_vs_eager=r["eager_graph_us"] / r["fused_graph_us"],
             x_of_floor=r["fused_graph_us"] / floor, x_of_practical_floor=r["fused_graph_us"] / practical)
    if T <= 512:
        r["targets"] = {"vs_compile>=8x": r["speedup_vs_compile"] >= 8.0,
                        "<=2x max(floor,4us)": r["x_of_practical_floor"] <= 2.0}
    else:
        r["targets"] = {"<=1.6x floor": r["x_of_floor"] <= 1.6}
    log(f"  T={T}: fused {r['fused_graph_us']:.2f} us (frozen fn {r['fused_frozen_graph_us']:.2f}, no PDL "
        f"{r['fused_no_pdl_graph_us']:.2f}, after a plain kernel {r['fused_after_plain_kernel_us']:.2f}; "
        f"check frozen {'ok' if r['check_frozen']['ok'] else 'FAIL'})")
    log(f"  T={T}: fused {r['fused_graph_us']:.2f} us (cold L2 {r['fused_graph_cold_l2_us']:.2f}, eager launch "
        f"{r['fused_eager_launch_us']:.2f}), compile {r['compile_graph_us']:.2f}, eager {r['eager_graph_us']:.2f}, "
        f"floor {floor:.2f}")
    return r


# ------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the results JSON (default results/mega_mhc/bench.json; --dry-run: a temp file)")
    ap.add_argument("--sweep", action="store_true", help="time launch configs per T; bench the fastest")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, toy sizes, correctness only")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="also record where each T's launch spends its time (per-program event times)")
    ap.add_argument("--leave-out", action="store_true",
                    help="instead of the benchmark: time each T's launch with each part of stage A compiled "
                         f"out in turn ({', '.join(mm.LEAVE_OUT_PARTS)}; timing only, wrong outputs)")
    args = ap.parse_args(argv)
    if args.leave_out and (args.dry_run or args.sweep):
        ap.error("--leave-out times the tuned launch on CUDA: not with --dry-run or --sweep")
    require_cuda(ap, args.dry_run)
    args.out = args.out or default_out("mega_mhc", args.dry_run)
    tokens = [int(t) for t in args.tokens.split(",")]
    log = open_log(args.out)

    device = torch.device("cpu" if args.dry_run else "cuda")
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
           "spec": V41.describe(), "hbm_bytes_per_s": HBM_BYTES_PER_S, "launch_floor_us": LAUNCH_FLOOR_US,
           "bytes_formula": "20*D*T + (2+n)*n*n*D*4 (fn)", "stages": {}}

    stages = Stages(res, args.out, log)
    stage, save = stages.run, stages.save

    if not args.skip_correctness:
        stage("correctness", lambda: correctness_suite(device, args.dry_run, log))
    if args.dry_run:
        res["sync_state_nonzero"] = sync_state_clean()
        save()
        bad = [r for r in res.get("correctness", []) if not r.get("ok")]
        log(f"dry run: {len(res.get('correctness', []))} checks, {len(bad)} failed; "
            f"sync state nonzero {res['sync_state_nonzero']}")
        return 1 if bad else 0

    configs = {T: mm.choose_config(V41, T, device=device) for T in tokens}
    if args.leave_out:
        res["leave_out"] = {}
        for T in tokens:
            log(f"T={T}: {configs[T]}")
            stage(f"leave_out_T{T}", lambda T=T: leave_out_T(T, device, configs[T], log))
            res["leave_out"][T] = {"config": dataclasses.asdict(configs[T]), "rows": res.pop(f"leave_out_T{T}", None)}
        res["sync_state_nonzero"] = sync_state_clean()
        save()
        return 0
    stage("graph_replay", lambda: graph_replay_check(device, log))
    if args.sweep:
        res["sweep"] = {}
        for T in tokens:
            stage(f"sweep_T{T}", lambda T=T: run_sweep(T, device, log))
            rows = res.pop(f"sweep_T{T}", None) or []
            res["sweep"][T] = rows
            ok = [x for x in rows if "graph_us" in x and x["check"]["ok"]]
            if ok:
                best = min(ok, key=lambda x: x["graph_us"])
                configs[T] = LaunchConfig(**best["config"])
                log(f"sweep T={T}: best {best['graph_us']:.2f} us with {configs[T]}")
    if args.trace:
        res["trace"] = {}
        for T in tokens:
            stage(f"trace_T{T}", lambda T=T: trace_T(T, device, configs[T], log))
            res["trace"][T] = res.pop(f"trace_T{T}", None)
    res["results"] = []
    for T in tokens:
        stage(f"bench_T{T}", lambda T=T: bench_T(T, device, configs[T], log))
        if res.get(f"bench_T{T}"):
            res["results"].append(res.pop(f"bench_T{T}"))
    res["sync_state_nonzero"] = sync_state_clean()
    save()

    log("")
    log(f"{res['device']}  torch {res['torch']}  triton {res['triton']}")
    log("Mega-mHC delayed seam (D=5120, n=4, bf16 streams), CUDA-graph medians in us; floor = bytes / 4.3 TB/s")
    log(f"{'T':>5} {'fused':>8} {'compile':>8} {'eager':>8} {'floor':>7} {'xCompile':>8} {'xEager':>7} "
        f"{'/max(fl,4)':>10} {'/floor':>7} {'GB/s':>6} {'coldL2':>7} {'eagerLaunch':>11} {'frozenFn':>8} "
        f"{'noPDL':>7} {'afterPlain':>10}  check  targets")
    for r in res["results"]:
        tgt = " ".join(f"{k}:{'HIT' if v else 'MISS'}" for k, v in r["targets"].items())
        log(f"{r['T']:>5} {r['fused_graph_us']:8.2f} {r['compile_graph_us']:8.2f} {r['eager_graph_us']:8.2f} "
            f"{r['floor_us']:7.2f} {r['speedup_vs_compile']:8.2f} {r['speedup_vs_eager']:7.1f} "
            f"{r['x_of_practical_floor']:10.2f} {r['x_of_floor']:7.2f} {r['achieved_gbps']:6.0f} "
            f"{r['fused_graph_cold_l2_us']:7.2f} {r['fused_eager_launch_us']:11.2f} {r['fused_frozen_graph_us']:8.2f} "
            f"{r['fused_no_pdl_graph_us']:7.2f} {r['fused_after_plain_kernel_us']:10.2f}  "
            f"{'ok' if r['check']['ok'] else 'BAD':5s}  {tgt}")
    for r in res["results"]:
        log(f"  T={r['T']}: config {r['config']}")
    bad = [r for r in res.get("correctness", []) if not r.get("ok")]
    replay = res.get("graph_replay") or {}
    log(f"correctness: {len(res.get('correctness', []))} CUDA checks, {len(bad)} failed; graph replay "
        f"{ {k: v['ok'] for k, v in replay.items()} }; sync state nonzero {res['sync_state_nonzero']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
