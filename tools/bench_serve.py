"""`megafuse bench-serve`: the agentic workload through the engine, once per configuration.

Every configuration serves the same seeded workload (runtime/workload.py) in one process. `--scale`
sizes it: `full` is the workload docs/serving.md describes (first contexts of 5K-131K tokens: a GPU's), `small` scales every
token length by 0.01 over 4 sessions x 2 turns (the eager `tiny` on a CPU); `--sessions`, `--turns`,
`--system-prompt`, `--context` and `--tool-result` replace the scale's value, `--output-cap` clips
every output.

    no-prefix-cache    every turn prefills its whole context
    exact-replay       prefix cache, replay of L x W tokens on a hit, no trim (exact: docs/serving.md, invariant 1)
    bounded-replay     prefix cache, replay of W tokens, trimmed decoder (the seed's configuration)
    bounded-no-trim    prefix cache, replay of W tokens, every prefill row through the decoder
    bounded-no-graphs  bounded-replay with the compiled regions run without CUDA graphs
    bounded-no-passes  bounded-replay on the step compiled by plain torch.compile (passes "none")

The step is compiled with the passes (`--passes`, `--no-<pass>`) once per padded bucket
(`--buckets`) and, on a GPU, captured as CUDA graphs; configurations with the same passes share
the compiled step and its graphs, so compile and capture happen once (reported under "steps").
`--eager` runs the configurations on the uncompiled step (quick CPU runs). The last two compare
compiled steps, so under `--eager` the default set leaves them out (a line on stderr says so) and
naming them in `--configs` is an error.

Time is simulated from measured step times: the clock advances by each step's wall time (CUDA
events on a GPU), a turn arrives at its session's arrival or `think_time_s` after its previous
output ended, and an idle engine jumps to the next arrival. A step that compiles or captures a
bucket is run again before the clock takes its time, so compile and capture never count as
serving time. TTFT is first token - arrival; the time per output token is (last - first token) /
(outputs - 1); the output rate per user is its inverse, and per GPU the outputs over the whole
run's time.

Quality: when exact-replay runs beside other configurations, each context length of
`--quality-contexts` (default: the scale's) serves one prompt of that many tokens (it fills the
prefix cache), then the same prompt plus a tool result, greedy, keeping the logits of its outputs.
Each configuration's outputs are compared with exact replay's, token by token while their inputs
agree: per-token KL(exact || configuration) of the next-token distributions, and top-1 agreement.
No prefix cache with the trim measures the trim alone, bounded-no-trim bounded replay alone, and
bounded-replay both.

JSON (`--json PATH`, '-' for stdout): schema "megafuse.bench_serve/4", documented in docs/tools.md.

`--png PATH`: TTFT CDF per configuration; output tok/s per user against tok/s per GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
from rich.table import Table

from megafuse.model import CacheLayout
from megafuse.runtime import Engine
from megafuse.runtime.graphs import CompiledStep, default_buckets
from megafuse.runtime.workload import SCALES, AgenticWorkload

from . import common
from .output import ToolError, console, environment, write_json

CONFIGURATIONS = {
    "no-prefix-cache": dict(prefix_cache=False, swa_bounded_replay=True, trim_decoder=True),
    "exact-replay": dict(prefix_cache=True, swa_bounded_replay=False, trim_decoder=False),
    "bounded-replay": dict(prefix_cache=True, swa_bounded_replay=True, trim_decoder=True),
    "bounded-no-trim": dict(prefix_cache=True, swa_bounded_replay=True, trim_decoder=False),
    "bounded-no-graphs": dict(prefix_cache=True, swa_bounded_replay=True, trim_decoder=True, cuda_graphs=False),
    "bounded-no-passes": dict(prefix_cache=True, swa_bounded_replay=True, trim_decoder=True, passes="none"),
}
NEEDS_COMPILED = ("cuda_graphs", "passes")  # flags that only mean something for the compiled step
QUALITY_REFERENCE = "exact-replay"


@dataclasses.dataclass(frozen=True)
class QualityProbe:
    """Bounded against exact replay, per context length: a tool result of `suffix` tokens after a
    cached prompt of each context length, then `tokens` greedy outputs compared."""
    contexts: tuple[int, ...]
    suffix: int
    tokens: int


# small: past tiny's L x W = 96-token exact replay, so bounded replay has something to drop
QUALITY = {"full": QualityProbe(contexts=(2048, 8192, 32768), suffix=512, tokens=16),
           "small": QualityProbe(contexts=(128, 512), suffix=8, tokens=8)}

EXAMPLES = """examples:
  megafuse bench-serve --config tiny --scale small --eager
  megafuse bench-serve --config tiny --scale small --eager --configs bounded-replay --sessions 2 --json serve.json --png serve.png
  megafuse bench-serve --config flash-lite --device cuda --context 5000 32768 --output-cap 64 --json serve.json --png serve.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a preset, a config JSON or a checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload (default 0)")
    parser.add_argument("--workload", default="agentic", choices=("agentic",))
    scales = "; ".join(f"{name}: {AgenticWorkload.at_scale(name, vocab_size=1).describe()}" for name in SCALES)
    parser.add_argument("--scale", default="full", choices=tuple(SCALES),
                        help=f"the workload's size, every token length scaled alike (default full). {scales}. "
                             "The flags below replace the scale's value, in tokens as written")
    parser.add_argument("--sessions", type=common.in_range(at_least=1), metavar="N", help="sessions (default: the scale's)")
    parser.add_argument("--turns", type=common.in_range(at_least=1), metavar="N", help="turns a session (default: the scale's)")
    parser.add_argument("--system-prompt", type=common.in_range(at_least=0), metavar="TOKENS", help="the shared system prompt (default: the scale's)")
    parser.add_argument("--context", type=common.in_range(at_least=1), nargs=2, metavar=("LOW", "HIGH"),
                        help="first contexts, log-uniform in [LOW, HIGH] (default: the scale's)")
    parser.add_argument("--tool-result", type=common.in_range(at_least=1), nargs=2, metavar=("LOW", "HIGH"),
                        help="tool results, uniform in [LOW, HIGH] (default: the scale's)")
    parser.add_argument("--output-cap", type=common.in_range(at_least=1), metavar="TOKENS", help="clip every output length")
    parser.add_argument("--arrival-rate", type=common.in_range(float, above=0), default=0.5, help="sessions per second (default 0.5)")
    parser.add_argument("--think-time", type=common.in_range(float, at_least=0), default=1.0, metavar="S")
    parser.add_argument("--configs", help=f"comma-separated subset of {', '.join(CONFIGURATIONS)} (default: every "
                                          f"one; under --eager those that run uncompiled)")
    parser.add_argument("--quality-contexts", type=common.positive_ints, metavar="N,N,..",
                        help="context lengths of the quality comparison with exact replay (default: the scale's)")
    parser.add_argument("--slots", type=common.in_range(at_least=1), default=8, help="requests running at once (default 8)")
    parser.add_argument("--page-size", type=common.in_range(at_least=1), default=64)
    parser.add_argument("--token-budget", type=common.in_range(at_least=1), default=4096, help="rows per step (default 4096)")
    parser.add_argument("--prefill-probe", type=common.in_range(at_least=2), metavar="TOKENS",
                        help="also time one TOKENS-token prompt's prefill on an idle engine, trimmed and not")
    parser.add_argument("--buckets", type=common.positive_ints, metavar="N,N,..",
                        help="padded row counts of the compiled step (default: powers of two from 2, then the budget; each >= 2)")
    common.add_engine_step_arguments(parser)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--png", metavar="PATH")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _serve(engine: Engine, system, sessions, think_s, output_cap, device):
    """Run the workload through one engine; per-request times and the engine's stats."""
    stopwatch = common.Stopwatch(device)
    clock, pending, records = 0.0, [], {}  # pending: (arrival, session index, turn index, context)
    for i, s in enumerate(sessions):
        pending.append((s.arrival_s, i, 0, system))
    while pending or engine.waiting or engine.running:
        pending.sort(key=lambda p: p[0])
        if not (engine.waiting or engine.running) and pending[0][0] > clock:
            clock = pending[0][0]  # idle: jump to the next arrival
        while pending and pending[0][0] <= clock:
            arrival, i, k, context = pending.pop(0)
            turn = sessions[i].turns[k]
            prompt = context + turn.new_tokens
            n_out = min(turn.max_new_tokens, output_cap) if output_cap else turn.max_new_tokens
            rid = engine.add_request(prompt, n_out)
            records[rid] = {"session": i, "turn": k, "arrival": arrival, "prompt": prompt, "times": []}
        produced, seconds = stopwatch(engine.step)
        clock += seconds - engine.setup_s  # not compile/capture
        for rid, _ in produced:
            record = records[rid]
            record["times"].append(clock)
            request = engine.requests[rid]
            if request.finished and record["turn"] + 1 < len(sessions[record["session"]].turns):
                pending.append((clock + think_s, record["session"], record["turn"] + 1,
                                record["prompt"] + request.output))
    return records, engine.stats, clock


def _prefill_probe(engine, cfg, tokens: int, device) -> dict:
    """TTFT of one `tokens`-token prompt on an idle engine (no prefix cache), with and without the
    trim: the sum of its prefill steps' times (compile and capture taken off)."""
    prompt = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    stopwatch, out = common.Stopwatch(device), {"tokens": tokens}
    for name, trim in (("trim", True), ("no_trim", False)):
        served = engine(dict(prefix_cache=False, swa_bounded_replay=True, trim_decoder=trim))
        served.add_request(prompt, 1)
        total, steps = 0.0, 0
        while served.waiting or served.running:
            _, seconds = stopwatch(served.step)
            total += seconds - served.setup_s
            steps += 1
        out[f"{name}_ttft_s"], out["steps"] = total, steps
    out["trim_speedup"] = out["no_trim_ttft_s"] / out["trim_ttft_s"]
    return out


def _drain(engine: Engine) -> None:
    while engine.waiting or engine.running:
        engine.step()


def _quality(engine, cfg, probe: QualityProbe, names: list[str], seed: int) -> dict:
    """Per context length and configuration: the outputs after a prefix hit against exact replay's
    (module docstring). KL and top-1 are taken at the positions whose inputs agree with exact
    replay's (every output before them equal): later positions condition on other tokens."""
    out = {}
    for context in probe.contexts:
        g = torch.Generator().manual_seed(seed * 1_000_003 + context)
        prompt = torch.randint(0, cfg.vocab_size, (context + probe.suffix,), generator=g).tolist()
        served = {}
        for name in [QUALITY_REFERENCE] + [n for n in names if n != QUALITY_REFERENCE]:
            e = engine(CONFIGURATIONS[name], keep_logits=True)
            e.add_request(prompt[:context], 1)  # fills the prefix cache
            _drain(e)
            rid = e.add_request(prompt, probe.tokens)
            _drain(e)
            served[name] = e.requests[rid]
        exact = served.pop(QUALITY_REFERENCE)
        out[str(context)] = {name: _distance(exact, r) for name, r in served.items()}
    return out


def _distance(exact, other) -> dict:
    """Per-token KL(exact || other) and top-1 agreement over the outputs whose inputs agree."""
    kls, agree = [], 0
    for k, (le, lo) in enumerate(zip(exact.logits, other.logits)):
        if exact.output[:k] != other.output[:k]:
            break
        log_e, log_o = le.double().log_softmax(-1), lo.double().log_softmax(-1)
        kls.append(float((log_e.exp() * (log_e - log_o)).sum()))
        agree += int(le.argmax() == lo.argmax())
    return {"positions": len(kls), "kl_mean": sum(kls) / len(kls), "kl_max": max(kls), "top1": agree / len(kls)}


def _summary(records: dict, stats, makespan: float) -> dict:
    ttft = [r["times"][0] - r["arrival"] for r in records.values()]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in records.values() if len(r["times"]) > 1]
    outputs = sum(len(r["times"]) for r in records.values())
    per_user = [1 / t for t in tpot if t > 0]
    return {"ttft_s": {q: _percentile(ttft, v) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "tpot_s": {"p50": _percentile(tpot, 0.5), "p90": _percentile(tpot, 0.9)},
            "tokens_per_s_per_user": {"p50": _percentile(per_user, 0.5)},
            "tokens_per_s_per_gpu": outputs / makespan if makespan else None,
            "requests": len(records), "output_tokens": outputs, "makespan_s": makespan,
            "prefix_hit_rate": stats.hit_tokens / max(1, sum(len(r["prompt"]) for r in records.values())),
            "stats": dataclasses.asdict(stats), "ttft_all_s": ttft}


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in result["configurations"].items():
        ttft = sorted(c["ttft_all_s"])
        cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=name)
        rate.scatter([c["tokens_per_s_per_gpu"]], [c["tokens_per_s_per_user"]["p50"] or 0], label=name)
    cdf.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    rate.set(xlabel="output tok/s per GPU", ylabel="output tok/s per user (P50)", title="throughput")
    for ax in (cdf, rate):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"megafuse bench-serve: {result['config']} ({result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _quality_table(quality: dict) -> Table:
    table = Table(title=f"against {quality['reference']}: {quality['suffix']} new tokens after a cached context, "
                        f"then {quality['tokens']} greedy outputs; top-1 agreement and mean KL over the n positions "
                        f"whose inputs agree")
    table.add_column("configuration", no_wrap=True)
    by_context = quality["by_context"]
    for context in by_context:
        table.add_column(f"{context} tokens", justify="right")
    for name in next(iter(by_context.values())):
        cells = [by_context[c][name] for c in by_context]
        table.add_row(name, *(f"{d['top1']:.0%} of {d['positions']}, KL {d['kl_mean']:.1e}" for d in cells))
    return table


def _quality_probe(args: argparse.Namespace, names: list[str]) -> QualityProbe | None:
    """The scale's probe with --quality-contexts, when exact replay runs beside another configuration."""
    if QUALITY_REFERENCE not in names or len(names) < 2:
        if args.quality_contexts:
            raise ToolError(f"--quality-contexts compares configurations with {QUALITY_REFERENCE}: select it and "
                            f"at least one other in --configs")
        return None
    probe = QUALITY[args.scale]
    if args.quality_contexts:
        probe = dataclasses.replace(probe, contexts=tuple(sorted(set(args.quality_contexts))))
    return probe


def eager_configurations() -> list[str]:
    """The configurations the eager step can run: those that compare no compiled steps."""
    return [n for n, flags in CONFIGURATIONS.items() if not any(k in flags for k in NEEDS_COMPILED)]


def _configurations(args: argparse.Namespace) -> list[str]:
    """--configs, or every configuration the step can run. Under --eager the default leaves out
    those that compare compiled steps and says so on stderr; naming one in --configs is an error."""
    runnable = eager_configurations() if args.eager else list(CONFIGURATIONS)
    if args.configs is None:
        left_out = [n for n in CONFIGURATIONS if n not in runnable]
        if left_out:
            print(f"megafuse bench-serve: --eager runs the step uncompiled, so {', '.join(left_out)} (they compare "
                  f"compiled steps) are left out", file=sys.stderr)
        return runnable
    names = list(dict.fromkeys(n.strip() for n in args.configs.split(",") if n.strip()))
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown or not names:
        raise ToolError(f"--configs: unknown {unknown or 'empty'}; valid: {', '.join(CONFIGURATIONS)}")
    compiled_only = [n for n in names if n not in runnable]
    if compiled_only:
        raise ToolError(f"--eager runs the step uncompiled, but {', '.join(compiled_only)} compare compiled steps; "
                        f"valid with --eager: {', '.join(runnable)}")
    return names


def _workload(args: argparse.Namespace, vocab_size: int) -> AgenticWorkload:
    """The workload at --scale, with the lengths and counts given on the command line instead."""
    given = {"sessions": args.sessions, "turns": args.turns, "system_prompt": args.system_prompt,
             "context": args.context and tuple(args.context), "tool_result": args.tool_result and tuple(args.tool_result)}
    try:
        return AgenticWorkload.at_scale(args.scale, vocab_size=vocab_size, arrival_rate=args.arrival_rate,
                                        think_time_s=args.think_time, seed=args.seed,
                                        **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise ToolError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    names = _configurations(args)
    args.dtype = args.quant = None
    args.prompt_len, args.batch = 1, 1
    cfg, model = common.load_model(args)
    workload = _workload(args, cfg.vocab_size)
    system, sessions = workload.build()
    cap = args.output_cap
    longest = max(len(system) + sum(len(t.new_tokens) + (min(t.max_new_tokens, cap) if cap else t.max_new_tokens)
                                    for t in s.turns) for s in sessions)
    probe = args.prefill_probe
    if probe is not None and probe < 2:
        raise ToolError(f"--prefill-probe must be >= 2 tokens, got {probe}")
    quality = _quality_probe(args, names)
    needed = quality.contexts[-1] + quality.suffix + quality.tokens if quality else 0
    layout = CacheLayout.private(args.slots, max(longest, (probe or 0) + 1, needed), args.page_size)
    buckets = args.buckets or default_buckets(args.token_budget)
    options = common.engine_step_options(args)
    steps: dict[str, CompiledStep] = {}  # shared by the configurations with the same passes

    def engine(flags: dict, keep_logits: bool = False) -> Engine:
        flags = dict(flags, keep_logits=keep_logits)
        if args.eager:
            return Engine(model, layout=layout, token_budget=args.token_budget, passes=None, **flags)
        kind = "no-passes" if flags.pop("passes", None) == "none" else "passes"
        if kind not in steps:
            steps[kind] = CompiledStep(model, layout=layout, buckets=buckets, cuda_graphs=options["cuda_graphs"],
                                       passes=[] if kind == "no-passes" else options["passes"])
        steps[kind].cuda_graphs = options["cuda_graphs"] and flags.pop("cuda_graphs", True)
        return Engine(model, layout=layout, token_budget=args.token_budget, compiled=steps[kind], **flags)

    result = {"schema": "megafuse.bench_serve/4", "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant,
              "device": args.device, "workload": {"scale": args.scale} | dataclasses.asdict(workload) | {"output_cap": cap},
              "cache": dataclasses.asdict(layout),
              "step": {"mode": "eager" if args.eager else "compiled", "buckets": None if args.eager else list(buckets)},
              "steps": {}, "configurations": {}, "environment": environment()}
    for name in names:
        with common.step(f"serving {len(sessions)} sessions x {workload.turns} turns: {name}"):
            try:
                served = engine(CONFIGURATIONS[name])
            except ValueError as e:
                raise ToolError(str(e)) from None
            records, stats, makespan = _serve(served, system, sessions, args.think_time, cap, args.device)
        result["configurations"][name] = {"engine": CONFIGURATIONS[name]} | _summary(records, stats, makespan)
    if probe:
        with common.step(f"prefill probe: one {probe}-token prompt, trimmed and not"):
            result["prefill_probe"] = _prefill_probe(engine, cfg, probe, args.device)
    if quality:
        with common.step(f"quality: {len(names) - 1} configurations against {QUALITY_REFERENCE} at "
                         f"{', '.join(map(str, quality.contexts))} tokens of context"):
            result["quality"] = {"reference": QUALITY_REFERENCE} | dataclasses.asdict(quality) | {
                "by_context": _quality(engine, cfg, quality, names, args.seed)}
    for kind, step in steps.items():
        result["steps"][kind] = {"passes": step.passes, "counts": step.report().counts(),
                                 "graphs": dataclasses.asdict(step.stats)}
    table = Table(title=f"megafuse bench-serve: {cfg.name}, {args.scale} scale: {workload.describe()}")
    table.add_column("configuration", no_wrap=True)
    for col in ("TTFT P50", "TTFT P90", "TTFT P99", "TPOT P50", "tok/s per GPU", "hit rate", "replayed", "trimmed",
                "preempted", "evicted"):
        table.add_column(col, justify="right")

    for name, c in result["configurations"].items():
        t, s = c["ttft_s"], c["stats"]
        table.add_row(name, *(f"{t[q]:.3f} s" for q in ("p50", "p90", "p99")),
                      f"{c['tpot_s']['p50'] * 1e3:.1f} ms" if c["tpot_s"]["p50"] else "-",
                      f"{c['tokens_per_s_per_gpu']:.1f}", f"{c['prefix_hit_rate']:.0%}", str(s["replayed_tokens"]),
                      str(s["trimmed_tokens"]), str(s["preemptions"]), str(s["evictions"]))
    console.print(table)
    if quality:
        console.print(_quality_table(result["quality"]))
    for kind, step in result["steps"].items():
        g = step["graphs"]
        console.print(f"compiled step ({kind}: {', '.join(step['passes']) or 'plain torch.compile'}): {g['graphs']} "
                      f"graphs (one per kind of layer and the head; {g['graphs_from_cache']} from Inductor's cache, "
                      f"{g['compile_s']:.1f} s compiling), {g['buckets']} buckets first run in {g['first_run_s']:.1f} s, "
                      f"{g['captures']} captured in {g['capture_s']:.1f} s "
                      f"({g['graph_bytes'] / 2**30:.2f} GiB of graph memory); matches {step['counts']}")
    if probe:
        p = result["prefill_probe"]
        console.print(f"prefill probe: {probe} tokens in {p['steps']} steps: TTFT {p['trim_ttft_s']:.3f} s trimmed, "
                      f"{p['no_trim_ttft_s']:.3f} s untrimmed ({p['trim_speedup']:.2f}x)")
    if args.json:
        write_json(result, args.json)
    if args.png:
        _plot(result, args.png)
    return 0
