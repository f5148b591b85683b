"""`megafuse run`: compile the batched step with the passes, prefill and decode incrementally, compare with eager.

What it does, in order:

1. builds the model (`--config`: preset, config JSON or checkpoint directory) and a random prompt
   per request, [B, T], from `--seed`; a byte cache (model/cache.py) with B request slots. A run
   the device cannot hold (weights, cache and the prefill step: `request_size`) is refused first;
2. eager reference: one prefill step of the B prompts, then `--decode N` greedy decode steps of B
   rows each, through the model's batched step (`model.step`: model/batch.py), timed;
3. compiles the engine's step (runtime.graphs.CompiledStep, without CUDA graphs) with the enabled
   passes: one graph per kind of layer and one for the head, each serving every layer of its kind
   and both the prefill step ([B*T] rows) and the decode step ([B] rows, at least 2: a padding row
   joins a single request); a warm-up prefill + decode on a cache of its own compiles them. A
   second run finds them in Inductor's caches (`graph.graphs_from_cache`);
4. runs the compiled regions on a fresh cache: the prefill, then every decode step incrementally
   (one new row per request, reading the cache; the sequence is never re-run). Decode steps are
   teacher-forced with eager's greedy tokens, so both sides see the same inputs at every step (a
   single divergence cannot cascade); the compiled side's own greedy choice is its argmax there;
5. compares logits over the prompt and every decoded step (max abs error, cosine, top-1
   agreement), prints TTFT, per-token latency and tokens/s for both, and the pass report;
6. exits with status 1 when the max abs logits error exceeds `--tolerance` (or a logit is not
   finite), else 0. The default depends on the dtype and the quantisation (`DEFAULT_TOLERANCE`):
   under quant="ref" every MXFP8 / FP8 / FP4 rounding turns a last-bit difference before it (a
   fused kernel sums in another order than eager) into a whole grid step (1/8 of the value for
   e4m3) when the value sits that close to a rounding boundary; on tiny one such flip moves the
   logits by up to ~0.2 (docs/mega_attention.md). quant="none" has no roundings to flip, so its fp32
   default is tight.

The prefill runs without the decoder trim, so the comparison covers every prompt position.

JSON (`--json PATH`, '-' for stdout): schema "megafuse.run/2", documented in docs/tools.md.
"""

from __future__ import annotations

import argparse

import torch
from rich.table import Table

from megafuse.model import CacheLayout, SequenceGroup
from megafuse.model.stats import parameter_counts
from megafuse.runtime.graphs import CompiledStep

from . import common
from .common import Stopwatch, compare_logits, median, merge_metrics, step
from .output import console, environment, tables_to_stderr, write_json

EXAMPLES = """examples:
  megafuse run --config tiny --decode 4               # all passes, 8-token prompt, 4 decode steps (make run)
  megafuse run --config tiny --passes none            # plain Inductor against eager
  megafuse run --config tiny --no-mega-mhc --decode 4 --json run.json
  megafuse run --config tiny --quant none --tolerance 1e-4
  megafuse run --config proxy --device cuda --prompt-len 64 --decode 16
  megafuse run --config ./checkpoint_dir              # a directory written by save_checkpoint

Both sides run the model's batched step over the byte cache: a prefill step, then one incremental
decode step per token (teacher-forced with eager's greedy tokens, so both see the same inputs).
"""

# (dtype, quant) -> max abs logits error: measured margins, see step 6 of the module doc
DEFAULT_TOLERANCE = {("float64", "ref"): 0.5,  # float64 is quant="ref" only (config.validate)
                     ("float32", "none"): 1e-3, ("float32", "ref"): 0.5,
                     ("bfloat16", "none"): 0.5, ("bfloat16", "ref"): 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, prompt_len=8)
    parser.add_argument("--decode", type=common.in_range(at_least=0), default=8, metavar="N",
                        help="greedy decode steps (default 8)")
    common.add_pass_arguments(parser)
    parser.add_argument("--tolerance", type=common.in_range(float, at_least=0), metavar="TOL",
                        help="max abs logits error allowed before exit status 1 (default: "
                             + ", ".join(f"{v:g} for {d} quant={q}" for (d, q), v in DEFAULT_TOLERANCE.items())
                             + "; loose under quant=ref because fake quantisation moves a value by a whole "
                               "grid step when a last-bit difference crosses a rounding boundary)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")


PAGE_SIZE = 64  # token positions per cache page (model/cache.py)


def _generate(run, group: SequenceGroup, steps: int, clock: Stopwatch, forced: torch.Tensor | None = None,
              min_rows: int = 1):
    """Prefill every sequence of `group`, then `steps` decode steps of one row each: prompt logits
    [B, T, V], per-step logits [B, V], greedy tokens [B, steps + 1], TTFT and step times. With
    `forced` [B, steps], step k feeds forced[:, k] instead of the previous greedy token (teacher
    forcing: pass the greedy tokens of another run). Steps of fewer than `min_rows` rows are padded."""
    B, T = len(group.sequences), len(group.sequences[0].tokens)
    pad = {"rows": max(B, min_rows), "decoder_rows": max(B, min_rows)}
    (_, prompt_logits), ttft = clock(group.step, run, [(i, T, True) for i in range(B)],
                                     rows=max(B * T, min_rows), decoder_rows=max(B * T, min_rows))
    prompt_logits = torch.stack(prompt_logits)
    tokens = [prompt_logits[:, -1].argmax(-1)]
    step_logits, step_s = [], []
    for k in range(steps):
        fed = tokens[-1] if forced is None else forced[:, k]
        for seq, token in zip(group.sequences, fed.tolist()):
            seq.tokens.append(token)
        (_, logits), seconds = clock(group.step, run, [(i, 1, True) for i in range(B)], **pad)
        step_logits.append(torch.cat(logits))
        step_s.append(seconds)
        tokens.append(step_logits[-1].argmax(-1))
    return prompt_logits, step_logits, torch.stack(tokens, dim=1), ttft, step_s


def _timing(ttft: float, step_s: list[float], batch: int) -> dict:
    per_token = median(step_s)
    return {"ttft_s": ttft, "step_s": step_s, "per_token_s": per_token,
            "tokens_per_s": batch / per_token if per_token else None}


def request_size(cfg, batch: int, prompt_len: int, decode: int, layout: CacheLayout) -> common.RequestSize:
    """What a run holds at once, at least: the weights, one cache of `layout` and the eager
    reference's prefill step, whose batch x prompt_len rows each score every entry a request's
    pages can hold and keep their logits."""
    rows = batch * prompt_len
    return common.RequestSize(
        f"--batch {batch} x {prompt_len + decode} positions (--prompt-len {prompt_len} + --decode {decode})",
        prompt_len + decode, common.model_bytes(cfg), layout.nbytes(cfg),
        common.activation_bytes(cfg, rows, layout.max_tokens, rows, step="eager"),
        "a smaller --batch, --prompt-len or --decode")


def main(args: argparse.Namespace) -> int:
    with tables_to_stderr(args.json == "-"):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    names = common.selected_passes(args)
    B, T, N = args.batch, args.prompt_len, args.decode
    L = T + N
    layout = CacheLayout.private(B, L, PAGE_SIZE)
    size = request_size(common.resolve_model_config(args), B, T, N, layout)
    cfg, model = common.load_model(args, size)
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[cfg.dtype, cfg.quant]
    clock = Stopwatch(args.device)
    prompts = common.random_ids(cfg, B, T, args.seed, args.device).tolist()
    buckets = {"prefill": [B * T, B * T]} | ({"decode": [B, B]} if N else {})

    def group():
        return SequenceGroup(cfg, layout, prompts, args.device)

    header = Table(title=f"megafuse run: {cfg.name} ({cfg.dtype}, quant={cfg.quant}, {args.device})", show_header=False)
    params = parameter_counts(cfg, model)
    header.add_row("parameters", f"{params['total']:,}")
    header.add_row("passes", ", ".join(names) or "none (plain Inductor)")
    header.add_row("prompt / decode", f"{B} x {T} tokens, {N} greedy steps")
    header.add_row("compiled step", f"each kind of layer of {cfg.n_layers} and the head compiled once, for "
                   + " and ".join(f"{k} [{max(v[0], 2)} rows]" for k, v in buckets.items()))
    console.print(header)

    with torch.no_grad(), common.out_of_memory_is_usage_error(size, args.device):
        # 1. eager reference (one warm-up prefill first, so TTFT does not time one-off set-up)
        with step(f"eager: prefill {B}x{T} and {N} incremental decode steps"):
            group().step(model.step, [(i, T, True) for i in range(B)])
            eager = group()
            prompt_ref, steps_ref, eager_tokens, eager_ttft, eager_step_s = _generate(model.step, eager, N, clock)

        # 2. compile the step: a warm-up prefill and decode compiles each kind of layer once
        compiled = CompiledStep(model, layout=layout, passes=names,
                                buckets=tuple(sorted({max(rows, 2) for rows, _ in buckets.values()})))
        with step(f"compiling each kind of layer with {', '.join(names) or 'no passes'}"):
            _, compile_s = clock(_generate, compiled.run, group(), min(N, 1), clock, eager_tokens[:, :1], 2)

        # 3. compiled prefill and incremental decode, teacher-forced with eager's tokens
        with step(f"compiled: prefill and {N} incremental decode steps"):
            prompt_got, steps_got, compiled_tokens, ttft, step_s = _generate(compiled.run, group(), N, clock,
                                                                             eager_tokens[:, :N], 2)

    # 4. compare
    prompt_metrics = compare_logits(prompt_ref, prompt_got)
    step_metrics = []
    for k, (ref, got) in enumerate(zip(steps_ref, steps_got), start=1):
        m = compare_logits(ref, got)
        m.update(step=k, eager_token=ref.argmax(-1).tolist(), compiled_token=got.argmax(-1).tolist())
        step_metrics.append(m)
    overall = merge_metrics([prompt_metrics] + step_metrics)
    passed = overall["finite"] and overall["max_abs"] <= tolerance
    report = compiled.report()
    cache = group().cache
    result = {
        "schema": "megafuse.run/2",
        "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant, "device": args.device,
        "batch": B, "prompt_len": T, "decode_steps": N, "seed": args.seed, "seq_len": L,
        "passes": names,
        "parameters": params,
        "cache": {"page_size": layout.page_size, "pages": layout.pages, "slots": layout.slots, "bytes": cache.nbytes()},
        "graph": {"buckets": buckets, "compile_s": compile_s, "graphs_compiled": len(report.graphs),
                  "graphs_from_cache": sum(g.cached for g in report.graphs),
                  "graph_blocks": [g.blocks for g in report.graphs],
                  "note": "one graph per kind of layer and one for the head, each serving both buckets; decode "
                          "steps read the byte cache, one row per request (the sequence is never re-run)"},
        "counts": report.counts(),
        "report": report.to_dict(),
        "comparison": {"prompt": prompt_metrics, "steps": step_metrics, "overall": overall,
                       "tolerance": tolerance, "passed": passed},
        "timing": {
            "method": common.timing_method(args.device), "indicative": args.device != "cuda",
            "eager": _timing(eager_ttft, eager_step_s, B),
            "compiled": _timing(ttft, step_s, B),
        },
        "generated": {"eager": eager_tokens.cpu().tolist(), "compiled": compiled_tokens.cpu().tolist()},
        "exit_status": 0 if passed else 1,
        "environment": environment(),
    }
    _print(result, report)
    if args.json:
        write_json(result, args.json)
    return result["exit_status"]


def _fmt_metrics(m: dict) -> list[str]:
    return [str(m["positions"]), f"{m['max_abs']:.3e}", f"{m['cosine_min']:.8f}", f"{m['top1_agreement'] * 100:.1f}%"]


def _print(result: dict, report) -> None:
    console.print(report.table())
    graph = result["graph"]
    console.print(f"counts above: per step, over {graph['graphs_compiled']} graphs (one per kind of layer and the "
                  f"head; {graph['graphs_from_cache']} from Inductor's cache), each counted once per layer that runs it")
    comparison = result["comparison"]
    table = Table(title="compiled vs eager logits, same inputs (decode teacher-forced with eager's tokens)")
    for col in ("", "positions", "max |err|", "cosine min", "top-1", "next token\neager/compiled"):
        table.add_column(col, justify="right" if col else "left")
    gen = result["generated"]
    table.add_row("prompt", *_fmt_metrics(comparison["prompt"]), f"{gen['eager'][0][0]} / {gen['compiled'][0][0]}")
    for m in comparison["steps"]:
        table.add_row(f"step {m['step']}", *_fmt_metrics(m), f"{m['eager_token'][0]} / {m['compiled_token'][0]}")
    table.add_row("[bold]all[/bold]", *_fmt_metrics(comparison["overall"]), "(request 0)")
    console.print(table)

    timing = result["timing"]
    times = Table(title="timing, " + ("wall clock: indicative only on CPU (Triton runs in its interpreter)"
                                      if timing["indicative"] else "CUDA events"))
    for col in ("", "eager\n(batched step)", "compiled\n(batched step)"):
        times.add_column(col, justify="right" if col else "left")
    e, c = timing["eager"], timing["compiled"]
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f} ms"
    rate = lambda r: "-" if r is None else f"{r:,.1f}"
    times.add_row("compile (first call)", "-", f"{result['graph']['compile_s']:.1f} s")
    times.add_row("TTFT", ms(e["ttft_s"]), ms(c["ttft_s"]))
    times.add_row("per-token latency", ms(e["per_token_s"]), ms(c["per_token_s"]))
    times.add_row("tokens/s", rate(e["tokens_per_s"]), rate(c["tokens_per_s"]))
    console.print(times)
    overall = comparison["overall"]
    verdict = "[green]PASS[/green]" if comparison["passed"] else "[red]FAIL[/red]"
    console.print(f"{verdict}: max |logits error| {overall['max_abs']:.3e} "
                  f"{'<=' if comparison['passed'] else '>'} tolerance {comparison['tolerance']:g}"
                  f"{'' if overall['finite'] else ' (non-finite logits)'}; top-1 agreement "
                  f"{overall['top1_agreement'] * 100:.1f}% over {overall['positions']} positions; exit status "
                  f"{result['exit_status']}")
