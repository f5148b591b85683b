"""`megafuse ablate`: what each pass buys, configuration by configuration.

The configurations, for the swept passes P (default: every registered pass, `--passes` / `--no-*`
narrow it): no passes (plain Inductor), each pass alone, all but each one, all passes. Configurations
with the same pass set are one row, listed under every name that maps to it (with two passes, "only
a" is "all but b"). For each row, on the same random prompt [B, T]:

    matches      per pass, from the compile's pass report
    kernels      launched per forward, from torch.profiler, and the time per forward of each
                 launcher's kernels: each pass's fused kernels, Inductor's, the rest
                 (common.KERNEL_COUNT_METHOD says exactly what is counted and timed on each device)
    step         latency of one forward: on CUDA the compiled forward captured in a CUDA graph and
                 replayed (CUDA events, median of --repeat replays; falls back to timed launches
                 if capture fails, and says so); on CPU the wall clock of --repeat calls (median),
                 labelled as such: the fused kernels run in the Triton interpreter there, so the
                 times measure the interpreter, not the kernels
    speed-up     on CUDA only: step latency of the no-pass row / this row's, shown (and drawn) only
                 where it is resolved: at least MIN_RUNS forwards each and the two rows' step times
                 (min..max) do not overlap; otherwise "unresolved". On CPU none is computed (null)
    error        logits against eager on the same prompt: max abs, cosine, top-1 agreement

Output: two rich tables that fit 80 columns (matches and kernels; time, speed-up and error),
`--json PATH` and, on CUDA, a PNG bar chart of speed-up vs no passes (`--png`). On CPU no chart is
drawn (an interpreter's times are not a speed-up) and a line on stderr says so.

JSON (`--json PATH`, '-' for stdout): schema "megafuse.ablate/1", documented in docs/tools.md.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch
from rich.table import Table

from . import common
from .common import Stopwatch, compare_logits, median, step
from .output import console, environment, progress_console, tables_to_stderr, write_json

EXAMPLES = """examples:
  megafuse ablate --config tiny                                 # every configuration of every registered pass
  megafuse ablate --config tiny --passes mega_gate --repeat 1   # sweep one pass: none vs mega_gate
  megafuse ablate --config tiny --json ablate.json --png ablate.png
  megafuse ablate --config tiny --layer 2                       # one block: four compiles of ~20 s on CPU
  megafuse ablate --config proxy --device cuda --prompt-len 64 --json results/tools/ablate_proxy.json

With n passes there are up to 2n + 2 configurations; each is a full compile (about 1.5 minutes for
tiny on CPU).
"""


MIN_RUNS = 3  # forwards per row before a speed-up can be called resolved
INTERPRETER_TIMING = "wall clock on CPU, where the fused kernels run in the Triton interpreter: not a speed-up"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, prompt_len=8)
    common.add_layer_argument(parser)
    common.add_pass_arguments(parser, what="passes to sweep")
    parser.add_argument("--repeat", type=common.in_range(at_least=1), metavar="N",
                        help="timed forwards per configuration (default: 50 CUDA-graph replays on CUDA, 3 calls on CPU)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")
    parser.add_argument("--png", metavar="PATH", help="speed-up chart on CUDA (default: ablate_<config>.png; on CPU "
                                                      "none is drawn: its times are the Triton interpreter's)")


def configurations(swept: list[str]) -> list[dict]:
    """Rows for: none, each alone, all but each, all; one row per distinct pass set, in that order,
    with every name that maps to it. Pass lists keep registry order."""
    named = [("none", [])]
    named += [(f"only {p}", [p]) for p in swept]
    named += [(f"all but {p}", [q for q in swept if q != p]) for p in swept]
    named += [("all", list(swept))]
    rows: dict[frozenset, dict] = {}
    for name, chosen in named:
        row = rows.setdefault(frozenset(chosen), {"names": [], "passes": chosen})
        if name not in row["names"]:
            row["names"].append(name)
    return list(rows.values())


def speedups(rows: list[dict], device: str, repeat: int) -> None:
    """Each row's step_spread_s, speedup_vs_none and speedup_resolved, in place (module docstring):
    on CPU no speed-up (null, unresolved), since an interpreter's times do not compare kernels."""
    none = next(r for r in rows if not r["passes"])
    for row in rows:
        row["step_spread_s"] = [min(row["step_times_s"]), max(row["step_times_s"])]
    for row in rows:
        timed = device == "cuda" and none["step_s"] > 0 and row["step_s"] > 0
        row["speedup_vs_none"] = none["step_s"] / row["step_s"] if timed else None
        apart = row["step_spread_s"][1] < none["step_spread_s"][0] or row["step_spread_s"][0] > none["step_spread_s"][1]
        row["speedup_resolved"] = timed and row is not none and repeat >= MIN_RUNS and apart


def _graph_step_times(fn, inputs: tuple, repeat: int) -> tuple[list[float], str]:
    """Capture one compiled forward in a CUDA graph and time `repeat` replays with CUDA events.
    The inputs stay alive and unchanged, so replays read the captured addresses."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (kernels' workspaces are allocated here, not in capture)
        for _ in range(2):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return times, "CUDA-graph replay (CUDA events)"


def _step_times(fn, inputs: tuple, device: str, repeat: int) -> tuple[list[float], str]:
    if device == "cuda":
        try:
            return _graph_step_times(fn, inputs, repeat)
        except Exception as e:  # capture is not always possible; time plain launches instead
            torch.cuda.synchronize()
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            clock = Stopwatch(device)
            return [clock(fn, *inputs)[1] for _ in range(repeat)], f"timed launches, CUDA events (graph capture failed: {reason})"
    clock = Stopwatch(device)
    return [clock(fn, *inputs)[1] for _ in range(repeat)], INTERPRETER_TIMING


def _compared(output):
    """The model's logits; a block returns (streams, pre): its streams."""
    return output[0] if isinstance(output, tuple) else output


def main(args: argparse.Namespace) -> int:
    with tables_to_stderr(args.json == "-"):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    swept, cfg, target, inputs, what = common.prepare_target(args, cuda_repeat=50, cpu_repeat=3)
    repeat = args.repeat
    rows = configurations(swept)
    console.print(f"[bold]megafuse ablate[/bold]: {cfg.name} {what} ({cfg.dtype}, quant={cfg.quant}, {args.device}), "
                  f"{args.batch} x {args.prompt_len} tokens, passes {', '.join(swept) or '(none)'}: "
                  f"{len(rows)} configurations")
    with torch.no_grad():
        reference = _compared(target(*inputs))
        for i, row in enumerate(rows, start=1):
            label = " = ".join(row["names"])
            common.reset_compiler()
            fused = common.compile_model(target, row["passes"], args.device)
            with step(f"[{i}/{len(rows)}] {label}: compiling"):
                out, row["compile_s"] = Stopwatch(args.device)(fused, *inputs)
            with step(f"[{i}/{len(rows)}] {label}: counting kernels, timing {repeat} forwards", quiet=True):
                row["error"] = compare_logits(reference, _compared(out))
                kernels = common.count_kernels(fused, inputs, args.device)
                times, row["step_method"] = _step_times(fused, inputs, args.device, repeat)
            row["matches"] = fused.report.counts()
            row["report"] = fused.report.to_dict()
            row["kernels_per_forward"] = kernels["total"]
            row["kernels"] = kernels["by_kind"]
            row["kernel_time_us"] = kernels["time_us"]
            row["step_times_s"] = times
            row["step_s"] = median(times)
            clock = "step" if args.device == "cuda" else "interpreter wall clock"
            console.print(f"  {label}: {row['kernels_per_forward']:g} kernels/forward, {clock} {row['step_s'] * 1e3:.2f} ms, "
                          f"max |err| {row['error']['max_abs']:.2e}, matches {row['matches'] or '-'}")
            del fused, out
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    speedups(rows, args.device, repeat)

    png = (args.png or f"ablate_{cfg.name}.png") if args.device == "cuda" else None
    result = {
        "schema": "megafuse.ablate/1",
        "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant, "device": args.device, "target": what,
        "compared": "logits" if args.layer is None else "the block's output streams",
        "batch": args.batch, "tokens": args.prompt_len, "seed": args.seed, "repeat": repeat,
        "passes": swept,
        "timing": {"method": rows[0]["step_method"], "indicative": args.device != "cuda"},
        "kernel_count": {"method": common.KERNEL_COUNT_METHOD[args.device]},
        "configurations": {name: i for i, row in enumerate(rows) for name in row["names"]},
        "rows": rows,
        "png": png,
        "environment": environment(),
    }
    for table in _tables(result):
        console.print(table)
    if png is None:
        progress_console.print(f"megafuse ablate: no chart{f' ({args.png})' if args.png else ''} on CPU: its times "
                               "are the Triton interpreter's wall clock, not a speed-up (the table lists them)")
    else:
        _chart(result, png)
        console.print(f"wrote {png}")
    if args.json:
        write_json(result, args.json)
    return 0


def _speedup(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.4f}x"


def _ms(seconds: float) -> str:
    """Milliseconds in at most 7 characters, to 3 significant digits or better."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def _tables(result: dict) -> list[Table]:
    """What each configuration fused, then its time and error: two tables, each within 80 columns
    with the registered passes (test_ablate checks), where one would need about 110."""
    rows, cuda = result["rows"], not result["timing"]["indicative"]
    fused = Table(title=f"megafuse ablate: {result['config']} {result['target']} on {result['device']}, "
                        f"{result['batch']} x {result['tokens']} tokens: matches per pass, kernels per forward",
                  pad_edge=False)  # the outer padding: five passes and the kernels fit 80 columns
    fused.add_column("configuration", no_wrap=True)
    for name in result["passes"]:  # "mega_" over the rest
        fused.add_column(name.replace("_", "_\n", 1), justify="right", no_wrap=True)
    fused.add_column("kernels", justify="right", no_wrap=True)
    for row in rows:
        cells = [str(row["matches"][p]) if p in row["matches"] else "-" for p in result["passes"]]
        fused.add_row("\n".join(row["names"]), *cells, f"{row['kernels_per_forward']:g}")

    what = (f"step latency ({result['timing']['method']})" if cuda else
            "CPU: Triton-interpreter wall clock, not a speed-up")
    timed = Table(title=f"{what}; error vs eager")
    timed.add_column("configuration", no_wrap=True)
    timed.add_column("step ms\nmedian \\[min-max]" if cuda else "interpreter wall ms\nmedian \\[min-max]",
                     justify="right", no_wrap=True)
    if cuda:
        timed.add_column("speed-up\nvs none", justify="right", no_wrap=True)
    timed.add_column("max\n|err|", justify="right", no_wrap=True)
    timed.add_column("top-1\nagree", justify="right", no_wrap=True)
    for row in rows:
        low, high = row["step_spread_s"]
        cells = [f"{_ms(row['step_s'])} \\[{_ms(low)}-{_ms(high)}]"]  # (\[: a literal bracket, not markup)
        if cuda:
            cells.append(_speedup(row["speedup_vs_none"]) if row["speedup_resolved"] or not row["passes"]
                         else "unresolved")
        timed.add_row("\n".join(row["names"]), *cells, f"{row['error']['max_abs']:.1e}",
                      f"{row['error']['top1_agreement'] * 100:.0f}%")
    return [fused, timed]


def _chart(result: dict, path: str) -> None:
    """Horizontal bars of speed-up vs no passes, one per row (matplotlib, Agg canvas: no display);
    a row whose speed-up is not resolved gets no bar, and says so. CUDA timings only: on CPU there is
    no speed-up to draw (`_main` draws none)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result["rows"]
    labels = [" = ".join(r["names"]) for r in rows]
    shown = [not r["passes"] or r["speedup_resolved"] for r in rows]
    speedups = [(r["speedup_vs_none"] or 0.0) if ok else 0.0 for r, ok in zip(rows, shown)]
    fig = Figure(figsize=(8, 1.2 + 0.55 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = ["#9e9e9e" if not r["passes"] else "#1f77b4" for r in rows]
    bars = ax.barh(range(len(rows)), speedups, color=colors)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    for bar, value, row, ok in zip(bars, speedups, rows, shown):
        low, high = (t * 1e3 for t in row["step_spread_s"])
        label = _speedup(value) if ok else f"unresolved (fewer than {MIN_RUNS} runs, or within the spread of none)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {label}  ({row['step_s'] * 1e3:.2f} ms, {low:.2f}-{high:.2f})", va="center", fontsize=8)
    ax.set_xlim(0, max(speedups + [1.0]) * 1.35)
    ax.set_xlabel("speed-up vs no passes (step latency of one forward; higher is better)")
    ax.set_title(f"megafuse ablate: {result['config']} {result['target']} on {result['device']}, "
                 f"{result['batch']} x {result['tokens']} tokens\n({result['timing']['method']})", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
