"""The compiled step's build: cold and warm compile time, graphs per kind, CUDA-graph memory, and the
decode step against the whole-region compile.

    python3 -m megafuse.tools.bench_compile --config flash-lite --phases blocks,blocks,regions
    python3 -m megafuse.tools.bench_compile --config tiny --batches 2 --context 40 --dry-run   # CPU

Each phase runs in a fresh process (`--phase`, the tool calling itself), all sharing one Inductor
cache folder (`--cache-dir`; default: a new empty one, so the first phase compiles cold):

- `blocks`: the engine's step (runtime.graphs.CompiledStep) compiled once per kind of layer;
  a second `blocks` phase is the warm start: a new process served by the caches the first wrote;
- `regions`: the same step compiled as two whole-region graphs (blocks=False).

In each phase: the first decode step of `--batches`[0] requests at `--context` tokens compiles the
step (`compile_s`: that call's wall time, compiles included; `graphs`, `graphs_from_cache`: from the
pass report; `compile_split_s`: where those seconds went), then the passes' fused-site counts per step; the logits of every batch size, each
call on a cleared cache (saved, so the summary compares phases: blocks against regions; each
against a second call of itself, the step's run-to-run noise, and against the eager step, the
compile's own deviation); on a GPU the step with CUDA graphs (median wall time of `--repeat`
after 3 untimed), then every decode bucket of a `--token-budget` engine captured into the step's
one pool (`graph_bytes`: what the pool reserved, largest bucket first). The contexts are synthetic,
as in bench_decode: zero bytes, no prefill.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from megafuse.model import CacheLayout, build_model, resolve_config
from megafuse.runtime.graphs import CompiledStep, default_buckets
from megafuse.tools.bench_common import require_cuda, step_wall_time, synthetic_decode_batch
from megafuse.tools.common import add_pass_arguments, positive_ints, selected_passes
from megafuse.tools.output import environment

PAGE_SIZE = 64
WARMUP = 3
PHASES = ("blocks", "regions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m megafuse.tools.bench_compile", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="flash-lite", help="preset, config JSON or checkpoint dir (default flash-lite)")
    parser.add_argument("--phases", default="blocks,blocks,regions",
                        help="comma-separated, each a fresh process: blocks (per kind of layer) or regions (whole "
                             "regions); a repeated phase is a warm start (default blocks,blocks,regions)")
    parser.add_argument("--batches", type=positive_ints, default=(1, 32), help="decode batch sizes (default 1,32)")
    parser.add_argument("--context", type=int, default=8192, help="tokens each request holds (default 8192)")
    parser.add_argument("--token-budget", type=int, default=256,
                        help="the engine budget whose decode buckets are captured (default 256)")
    parser.add_argument("--repeat", type=int, default=20, help="timed steps per measurement (default 20)")
    parser.add_argument("--cache-dir", help="Inductor's cache folder for every phase (default: a new empty one)")
    parser.add_argument("--phase-timeout", type=float, default=580.0, help="seconds a phase may run (default 580)")
    parser.add_argument("--out", help="results JSON (default results/compile/bench.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, no timing claims: checks the phases run")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one phase, in this process
    parser.add_argument("--phase-out", help=argparse.SUPPRESS)
    add_pass_arguments(parser, "passes of every phase")
    args = parser.parse_args(argv)
    require_cuda(parser, args.dry_run)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        parser.error(f"--phases takes {' or '.join(PHASES)}, comma-separated; got {args.phases!r}")
    if min(args.context, args.repeat, args.token_budget) < 1:
        parser.error("--context, --repeat and --token-budget must be >= 1")
    if args.phase:
        result = run_phase(args)
        with open(args.phase_out, "w") as f:
            json.dump(result, f)
        return 0
    return run_phases(args, phases, argv if argv is not None else sys.argv[1:])


def run_phases(args, phases: list[str], argv: list[str]) -> int:
    out = args.out or (os.path.join(tempfile.gettempdir(), "compile_bench_dry_run.json") if args.dry_run
                       else os.path.join("results", "compile", "bench.json"))
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="megafuse_inductor_")
    work = tempfile.mkdtemp(prefix="megafuse_bench_compile_")
    results = {"schema": "megafuse.bench_compile/1", "config": args.config, "passes": selected_passes(args),
               "phases": phases, "batches": args.batches, "context": args.context, "token_budget": args.token_budget,
               "command": "python3 -m megafuse.tools.bench_compile " + " ".join(argv),
               "date": datetime.date.today().isoformat(), "environment": environment(), "runs": []}
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    for index, phase in enumerate(phases):
        phase_out = os.path.join(work, f"{index}_{phase}.json")
        command = [sys.executable, "-m", "megafuse.tools.bench_compile", *argv, "--phase", phase,
                   "--phase-out", phase_out, "--cache-dir", cache_dir]
        print(f"phase {index} ({phase}): a new process, Inductor's cache in {cache_dir}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, timeout=args.phase_timeout)
            ok = done.returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        run = {"phase": phase, "ok": ok, "process_s": round(time.perf_counter() - start, 1)}
        if ok:
            with open(phase_out) as f:
                run.update(json.load(f))
        results["runs"].append(run)
        results["summary"] = summary(results["runs"], work)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results["summary"], indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(r["ok"] for r in results["runs"]) else 1


def summary(runs: list[dict], work: str) -> dict:
    """Cold against warm, blocks against regions: counts, logits, step times, graph memory."""
    done = [r for r in runs if r["ok"]]
    blocks = [r for r in done if r["phase"] == "blocks"]
    regions = next((r for r in done if r["phase"] == "regions"), None)
    out: dict = {}
    if blocks:
        out["cold_compile_s"] = blocks[0]["compile_s"]
        out["warm_compile_s"] = blocks[1]["compile_s"] if len(blocks) > 1 else None
        out["warm_graphs_from_cache"] = f"{blocks[1]['graphs_from_cache']} of {blocks[1]['graphs']}" if len(blocks) > 1 else None
    if blocks and regions:
        out["counts_equal"] = blocks[0]["counts"] == regions["counts"]
        diffs = {}
        for B in blocks[0]["logits"]:
            a, b = torch.load(blocks[0]["logits"][B]), torch.load(regions["logits"][B])
            diffs[B] = (a - b).abs().max().item()
        out["blocks_vs_regions_logits_max_abs"] = diffs
        out["run_to_run_max_abs"] = {"blocks": blocks[0]["repeat_max_abs"], "regions": regions["repeat_max_abs"]}
        out["vs_eager_max_abs"] = {"blocks": blocks[0]["eager_max_abs"], "regions": regions["eager_max_abs"]}
        if "graphs_step_s" in regions:
            out["graphs_step_speedup_vs_regions"] = {B: regions["graphs_step_s"][B] / blocks[0]["graphs_step_s"][B]
                                                     for B in regions["graphs_step_s"]}
    return out


def run_phase(args) -> dict:
    """One phase in this process (module docstring)."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    cfg = resolve_config(args.config)
    B_max, C = max(args.batches), args.context
    layout = CacheLayout.private(B_max, C + 1, PAGE_SIZE)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()


    with torch.no_grad():
        model = build_model(cfg, seed=0, device=device)
        buckets = tuple(sorted(set(default_buckets(args.token_budget)) | {max(B, 2) for B in args.batches}))
        step = CompiledStep(model, layout=layout, buckets=buckets, passes=selected_passes(args),
                            blocks=args.phase == "blocks")
        batches = {B: synthetic_decode_batch(cfg, layout, B, C, device) for B in args.batches}
        first = batches[args.batches[0]]
        sync()
        start = time.perf_counter()
        step(first, step.cache)
        sync()
        result = {"compile_s": round(time.perf_counter() - start, 2), "compile_split_s": compile_split(step),
                  "graphs": step.stats.graphs,
                  "graphs_from_cache": step.stats.graphs_from_cache, "counts": step.report().counts(),
                  "graph_blocks": [g.blocks for g in step.report().graphs], "logits": {}, "repeat_max_abs": 0.0}
        result["eager_max_abs"] = 0.0
        for B, batch in batches.items():  # each call on a cleared cache: the same inputs every time
            logits = fresh(step, batch).clone()
            again = fresh(step, batch)
            eager = fresh(step, batch, model.step)
            result["repeat_max_abs"] = max(result["repeat_max_abs"], (again - logits).abs().max().item())
            result["eager_max_abs"] = max(result["eager_max_abs"], (eager - logits).abs().max().item())
            path = os.path.join(os.path.dirname(args.phase_out), f"{os.path.basename(args.phase_out)}.{B}.pt")
            torch.save(logits.cpu(), path)
            result["logits"][str(B)] = path
        result["first_runs_s"] = round(step.stats.first_run_s, 2)  # every bucket the batches needed
        if device.type == "cuda":
            step.cuda_graphs = True
            result["graphs_step_s"] = {str(B): step_wall_time(step, batch, args.repeat, WARMUP)
                                       for B, batch in batches.items()}
            step.prepare([(size, size) for size in buckets])  # every decode bucket of the budget
            result.update(captures=step.stats.captures, capture_s=round(step.stats.capture_s, 2),
                          graph_bytes=step.stats.graph_bytes, graph_gib=round(step.stats.graph_bytes / 2 ** 30, 3))
    return result


def compile_split(step: CompiledStep) -> dict:
    """Where the compile's seconds went: Dynamo's own phase timers (tracing is entire_frame_compile less
    backend_compile; Inductor's lowering and code generation, and waiting on its kernel compiles,
    lie inside backend_compile) and the passes' own time from the report."""
    from torch._dynamo.utils import calculate_time_spent
    phases = calculate_time_spent()
    keys = ("entire_frame_compile", "backend_compile", "inductor_compile", "code_gen", "async_compile.wait")
    split = {key: round(phases.get(key, 0.0), 2) for key in keys}
    split["passes"] = round(sum(p["time_s"] for p in step.report().to_dict()["per_pass"].values()), 2)
    return split


def fresh(step: CompiledStep, batch, run=None):
    """`run` (default: the step) on the step's cache, cleared first (a step writes its rows: a
    second call would read them)."""
    step.cache.clear()
    return (run or step)(batch, step.cache)




if __name__ == "__main__":
    sys.exit(main())
