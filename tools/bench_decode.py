"""H200: the engine's decode step, compiled with and without the passes, with and without CUDA graphs.

    python3 -m megafuse.tools.bench_decode --config flash-lite --batches 1,32 --context 27648
    python3 -m megafuse.tools.bench_decode --config tiny --batches 2 --context 40 --dry-run   # CPU

For each batch size B: B requests each holding `--context` tokens decode one token, through the
engine's step (runtime.graphs.CompiledStep, a bucket of max(B, 2) rows: buckets hold at least 2).
Stages, each saved as it finishes:

1. build: the preset on the device, seeded weights;
2. passes-<B>: the step compiled with the passes (`--passes`, `--no-<pass>`; default all), one
   compiled step for every B (the first B's first run compiles both regions, `graphs_compiled`
   stays 2), then the wall time of one step
   (call to synchronised result, so the host's launch cost counts: that is what graphs remove)
   without CUDA graphs and with them (capture time, graph memory), median of `--repeat` after
   3 untimed calls; the logits of the two compared (max |difference|), beside the difference
   between two calls without graphs (the step's own run-to-run noise); and `profile`: the step's
   kernels from torch.profiler over `--profiled` steps without graphs (a graph replays the same
   kernels), per step: launches, and the time of each launcher's kernels (`time_us`: a pass's name
   for its fused kernels, "inductor", "other": `tools.common.KERNEL_COUNT_METHOD`) with its
   `share` of their sum, so `share.mega_attention` is the fused attention's part of the step, and
   the `heaviest` kernel names (tools.common.count_kernels);
3. no-passes-<B>: the same compiled by plain torch.compile (passes "none"), graphs on, profiled;
4. summary: graphs' speed-up at each B (passes), the passes' speed-up at each B (graphs on), and
   the step with both over its floor ("x of floor"), also logged as a table.

The floor (`floor`, before any stage): the bytes one decode step of B requests at the context must
read at least (model.stats.decode_read_bytes: the weights it touches as stored, the routed experts of
min(E, B x k) per layer, the cache rows its attention and indexers read, the head) over the device's
peak HBM bandwidth (tools.bench_common.HBM_PEAK_BYTES_PER_S; a device not listed, and the CPU, get
the bytes and no floor, with a note saying why). Each passes / no-passes stage gives its step times
over that floor, `x_of_floor`: 1.0 would be a step that only streams those bytes at the peak rate.

The first B's stages compile (minutes on a large preset). A run cut off by a time limit keeps its
finished stages in the JSON; `--resume` with the same arguments continues it, keeping those and
running the rest (on the same device and versions, else a usage error naming what differs).

The contexts are synthetic: each request's pages hold zero bytes (its cache rows decode to 0.0,
all index scores tie and the top-k picks the first entries), so the step reads and computes what
a real context of that length costs without a prefill to fill it. Every run of a batch is the
same step (its cache writes rewrite the same rows).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

from megafuse.model import CacheLayout, build_model, resolve_config
from megafuse.model.stats import decode_read_bytes
from megafuse.runtime.graphs import CompiledStep
from megafuse.tools.bench_common import (Stages, default_out, hbm_rate_or_reason, require_cuda, step_wall_time,
                                         synthetic_decode_batch)
from megafuse.tools.common import add_pass_arguments, count_kernels, positive_ints, selected_passes
from megafuse.tools.output import environment

PAGE_SIZE = 64
WARMUP = 3  # untimed calls before each timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m megafuse.tools.bench_decode", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="flash-lite", help="preset, config JSON or checkpoint dir (default flash-lite)")
    parser.add_argument("--batches", type=positive_ints, default=(1, 32), help="decode batch sizes (default 1,32)")
    parser.add_argument("--context", type=int, default=27648, help="tokens each request holds (default 27648)")
    parser.add_argument("--repeat", type=int, default=20, help="timed steps per measurement (default 20)")
    parser.add_argument("--profiled", type=int, default=5, help="steps the profile covers (default 5)")
    parser.add_argument("--out", help="results JSON (default results/decode/bench.json)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run whose JSON is at --out: keep its finished stages, run the rest")
    parser.add_argument("--dry-run", action="store_true", help="CPU, no timing claims: checks the stages run")
    add_pass_arguments(parser, "passes of the passes-<B> stages")
    args = parser.parse_args(argv)
    require_cuda(parser, args.dry_run)
    if args.context < 1 or args.repeat < 1 or args.profiled < 1:
        parser.error("--context, --repeat and --profiled must be >= 1")
    device = torch.device("cpu" if args.dry_run else "cuda")
    out = args.out or default_out("decode", args.dry_run)
    cfg = resolve_config(args.config)
    B_max, C = max(args.batches), args.context
    layout = CacheLayout.private(B_max, C + 1, PAGE_SIZE)
    chosen = selected_passes(args)
    results = {"schema": "megafuse.bench_decode/4", "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant,
               "passes": chosen, "context": C, "batches": args.batches, "cache_layout": vars(layout),
               "method": "wall time of step() to a synchronised result, median of --repeat",
               "date": datetime.date.today().isoformat(), "environment": environment()}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results["floor"] = floor = decode_floor(cfg, args.batches, C, torch.cuda.get_device_name() if device.type == "cuda"
                                            else None)
    if floor["note"]:
        log(floor["note"])
    stages = Stages(results, out, log)
    if args.resume:
        try:
            stages.resume(same=("schema", "config", "dtype", "quant", "passes", "context", "batches", "cache_layout"),
                          rerun=("build", "summary"))
        except ValueError as e:
            parser.error(str(e))
    state: dict = {}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def batch_of(B: int):
        return synthetic_decode_batch(cfg, layout, B, C, device)

    def timed(step: CompiledStep, batch) -> float:
        return step_wall_time(step, batch, args.repeat, WARMUP)

    def step_for(passes: str | list[str]) -> CompiledStep:
        """One compiled step per pass set, shared by the batch sizes: its regions take the row count as a
        symbolic size, so the first batch compiles them and the others only capture their buckets."""
        key = str(passes)
        if key not in state:
            buckets = tuple(sorted({max(B, 2) for B in args.batches}))
            state[key] = CompiledStep(state["model"], layout=layout, buckets=buckets, passes=passes)
        return state[key]

    def measure(B: int, passes: str | list[str], both_graph_modes: bool) -> dict:
        step, batch = step_for(passes), batch_of(B)
        step.cuda_graphs = False
        with torch.no_grad():
            start = time.perf_counter()
            no_graph_logits = step(batch, step.cache).clone()
            sync()
            out = {"first_run_s": round(time.perf_counter() - start, 1), "graphs_compiled": step.stats.graphs,
                   "counts": step.report().counts()}
            if both_graph_modes:
                out["no_graphs_step_s"] = timed(step, batch)
            # the compiled step's own call-to-call difference: a graph difference no larger than this
            # is the step's run-to-run noise, not the graphs'
            out["no_graphs_repeat_max_abs"] = (step(batch, step.cache) - no_graph_logits).abs().max().item()
            out["profile"] = profile(step, batch)
            if device.type == "cuda":
                step.cuda_graphs = True
                captured, graph_bytes = step.stats.capture_s, step.stats.graph_bytes
                graph_logits = step(batch, step.cache).clone()
                out["graphs_step_s"] = timed(step, batch)
                out["capture_s"] = step.stats.capture_s - captured
                out["graph_bytes"] = step.stats.graph_bytes - graph_bytes
                out["graphs_vs_no_graphs_max_abs"] = (graph_logits - no_graph_logits).abs().max().item()
        floor_s = floor["by_batch"][B]["floor_s"]
        out["x_of_floor"] = {mode: _ratio(out.get(f"{mode}_step_s"), floor_s) for mode in ("no_graphs", "graphs")}
        return out

    def profile(step: CompiledStep, batch) -> dict:
        kernels = count_kernels(step, (batch, step.cache), device.type, forwards=args.profiled)
        total = sum(kernels["time_us"].values())
        return {"steps": args.profiled, "kernels_per_step": kernels["total"], "time_us": kernels["time_us"],
                "share": {k: v / total for k, v in kernels["time_us"].items()} if total else {},
                "heaviest": kernels["heaviest"], "method": kernels["method"]}

    def build():
        start = time.time()
        with torch.no_grad():
            state["model"] = build_model(cfg, seed=0, device=device)
        return {"seconds": round(time.time() - start, 1)}

    def summary():
        rows = {}
        for B in args.batches:
            fused, plain = results.get(f"passes-{B}", {}), results.get(f"no-passes-{B}", {})
            rows[B] = {"graphs_speedup": _ratio(fused.get("no_graphs_step_s"), fused.get("graphs_step_s")),
                       "passes_speedup": _ratio(plain.get("graphs_step_s"), fused.get("graphs_step_s")),
                       "floor_s": floor["by_batch"][B]["floor_s"],
                       "x_of_floor": _ratio(fused.get("graphs_step_s"), floor["by_batch"][B]["floor_s"])}
        log(summary_table(rows, floor))
        return rows

    stages.run("build", build)
    if results["stages"]["build"]["ok"]:
        for passes, label in ((chosen, "passes"), ("none", "no-passes")):
            for B in args.batches:
                stages.run(f"{label}-{B}", lambda B=B: measure(B, passes, label == "passes"))
            state.pop(str(passes), None)  # its cache and graphs' memory go before the next pass set's
            if device.type == "cuda":
                torch.cuda.empty_cache()
        stages.run("summary", summary)
    log(f"wrote {out}")
    return 0 if all(s["ok"] for s in results["stages"].values()) else 1


def decode_floor(cfg, batches, context: int, device_name: str | None) -> dict:
    """The JSON's `floor`: per batch size the bytes a decode step must read (model.stats.decode_read_bytes)
    and, where the device's peak HBM bandwidth is known, the time they take at it. `device_name`
    None: the CPU's dry run, bytes only."""
    rate, note = hbm_rate_or_reason(
        device_name, "a dry run on the CPU: the bytes a decode step must read, no floor (no HBM to divide by)")
    meta = build_model(cfg, device="meta")
    by_batch = {}
    for B in batches:
        reads = decode_read_bytes(cfg, B, context, meta).to_dict()
        by_batch[B] = reads | {"floor_s": reads["total"] / rate if rate else None}
    return {"method": "bytes a decode step must read at least (model.stats.decode_read_bytes) / peak HBM bandwidth",
            "device": device_name or "cpu", "hbm_peak_bytes_per_s": rate, "note": note, "by_batch": by_batch}


def summary_table(rows: dict, floor: dict) -> str:
    """The summary as a table for the log: per batch size the step (passes, graphs), its floor and the ratios."""
    def cell(value, fmt):
        return "-" if value is None else fmt.format(value)

    lines = [f"{'batch':>5}  {'bytes read':>12}  {'floor':>9}  {'x of floor':>10}  {'graphs speed-up':>15}  "
             f"{'passes speed-up':>15}"]
    for B, row in rows.items():
        floor_ms = row["floor_s"] * 1e3 if row["floor_s"] else None
        lines.append(f"{B:>5}  {floor['by_batch'][B]['total'] / 1e9:>9.3f} GB  {cell(floor_ms, '{:.3f} ms'):>9}  "
                     f"{cell(row['x_of_floor'], '{:.2f}x'):>10}  {cell(row['graphs_speedup'], '{:.2f}x'):>15}  "
                     f"{cell(row['passes_speedup'], '{:.2f}x'):>15}")
    return "\n".join(lines)


def _ratio(slow: float | None, fast: float | None) -> float | None:
    return slow / fast if slow and fast else None


if __name__ == "__main__":
    sys.exit(main())
