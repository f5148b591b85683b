"""`megafuse run`: compile a model with the passes, run prefill + greedy decode, compare with eager.

What it does, in order:

1. builds the model (`--config`: preset, config JSON or checkpoint directory) and a random prompt
   [B, T] from `--seed`;
2. eager reference: prefill with a `DecodeCache`, then `--decode N` greedy steps of the model's
   own incremental decode (`model(token, cache)`), timed;
3. compiles the one-shot forward with the enabled passes (`passes.compile(..., fullgraph=True,
   dynamic=False)`) as ONE static graph over the whole sequence, [B, L] with L = T + N;
4. runs it for the prompt and for every decode step. The model is causal, so a position's logits
   depend only on the tokens up to it: the sequence graph takes the tokens known so far, right-
   padded with PAD_ID, and the step reads its position. Decode steps are teacher-forced with the
   eager model's greedy tokens, so both models see the same inputs at every step (a single
   divergence cannot cascade); the compiled model's own greedy choice is its argmax there;
5. compares logits over the prompt and every decoded step (max abs error, cosine, top-1
   agreement), prints TTFT, per-token latency and tokens/s for both, and the pass report;
6. exits with status 1 when the max abs logits error exceeds `--tolerance` (or a logit is not
   finite), else 0.

Why one padded static graph: the cache-based decode is eager-only code, so compiled decode re-runs
the full sequence; growing the prefix by one token per step would recompile every step with static
shapes, and `dynamic=True` takes ~2x longer to compile on CPU and still recompiles on the model's
shape guards (measured on `tiny`: 257 s, then 207 s again at the next length). One static graph
compiles once and serves prefill and every step. Its costs, stated in the output: compiled TTFT
and per-token latency are those of a full forward over L positions (not of an incremental decode
step), which is what re-running the sequence costs anyway.

JSON (`--json PATH`, '-' for stdout), schema "megafuse.run/1":

    schema          "megafuse.run/1"
    config, dtype, quant, device        str
    batch, prompt_len, decode_steps, seed, seq_len        int   (seq_len = prompt_len + decode_steps)
    passes          [str]   enabled passes, registry order
    parameters      {total, backbone, engram_tables, routed_experts, activated_per_token}
    graph           {shape: [B, L], dynamic: false, note: str, compile_s: float (first call,
                     compile included), graphs_compiled: int}
    counts          {pass: matches}   == report.counts
    report          CompileReport.to_dict(): {passes, graphs, counts,
                     per_pass: {pass: {matches: [{op, node, spec, replaced, sources}],
                                       rejections: [{anchor, reason, source}], time_s}}}
    comparison      {prompt: M, steps: [M + {step: k, eager_token: [B], compiled_token: [B]}],
                     overall: M, tolerance: float, passed: bool}
                    M = {positions, max_abs, cosine_min, cosine_mean, top1_agreement, finite}
    timing          {method: str, indicative: bool,
                     eager:    {ttft_s, step_s: [N], per_token_s, tokens_per_s},
                     compiled: {ttft_s, step_s: [N], per_token_s, tokens_per_s, note: str}}
                                    per_token_s = median step time (null without decode); tokens_per_s = batch / per_token_s
    generated       {eager: [B][N+1], compiled: [B][N+1]}   first token + one per step
    exit_status     0 | 1
    environment     {date, python, torch, triton, device}
"""

from __future__ import annotations

import argparse

import torch
from rich.table import Table

from megafuse.model.stats import parameter_counts

from . import common
from .common import PAD_ID, Stopwatch, compare_logits, median, merge_metrics, step
from .output import console, environment, tables_to_stderr, write_json

EXAMPLES = """examples:
  megafuse run --config tiny                          # all passes, 8-token prompt, 8 decode steps (make run)
  megafuse run --config tiny --passes none            # plain Inductor against eager
  megafuse run --config tiny --no-mega-mhc --decode 4 --json run.json
  megafuse run --config tiny --quant none --tolerance 1e-4
  megafuse run --config proxy --device cuda --prompt-len 64 --decode 16
  megafuse run --config ./checkpoint_dir              # a directory written by save_checkpoint

Decode with the compiled model re-runs the whole sequence per token through ONE static graph of
prompt + decode positions (right-padded, the model is causal), teacher-forced with eager's greedy
tokens: one compile, and both models see the same inputs at every step.
"""

DEFAULT_TOLERANCE = {"float32": 5e-2, "bfloat16": 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, prompt_len=8)
    parser.add_argument("--decode", type=int, default=8, metavar="N", help="greedy decode steps (default 8)")
    common.add_pass_arguments(parser)
    parser.add_argument("--tolerance", type=float, metavar="TOL",
                        help="max abs logits error allowed before exit status 1 (default: "
                             + ", ".join(f"{v:g} for {k}" for k, v in DEFAULT_TOLERANCE.items())
                             + "; loose because fake quantisation moves a value by a whole grid step when "
                               "a rounding boundary flips)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")


def _eager_generate(model, prompt: torch.Tensor, steps: int, clock: Stopwatch):
    """Prefill with a cache and `steps` greedy incremental decode steps: logits, tokens, times."""
    cache = model.new_cache(prompt.shape[0])
    prompt_logits, ttft = clock(model, prompt, cache)
    token = prompt_logits[:, -1].argmax(-1, keepdim=True)
    tokens, step_logits, step_s = [token], [], []
    for _ in range(steps):
        logits, seconds = clock(model, token, cache)
        step_logits.append(logits[:, -1])
        step_s.append(seconds)
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return prompt_logits, step_logits, torch.cat(tokens, dim=1), ttft, step_s


def _padded(sequence: torch.Tensor, known: int) -> torch.Tensor:
    """The sequence graph's input when `known` tokens are known: the rest is PAD_ID."""
    ids = sequence.clone()
    ids[:, known:] = PAD_ID
    return ids


def _timing(ttft: float, step_s: list[float], batch: int) -> dict:
    per_token = median(step_s)
    return {"ttft_s": ttft, "step_s": step_s, "per_token_s": per_token,
            "tokens_per_s": batch / per_token if per_token else None}


def main(args: argparse.Namespace) -> int:
    with tables_to_stderr(args.json == "-"):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    names = common.selected_passes(args)
    common.check_sizes(args, prompt_len=1, batch=1, decode=0)
    cfg, model = common.load_model(args)
    B, T, N = args.batch, args.prompt_len, args.decode
    L = T + N
    tolerance = args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[cfg.dtype]
    clock = Stopwatch(args.device)
    prompt = common.random_ids(cfg, B, T, args.seed, args.device)

    header = Table(title=f"megafuse run: {cfg.name} ({cfg.dtype}, quant={cfg.quant}, {args.device})", show_header=False)
    params = parameter_counts(cfg, model)
    header.add_row("parameters", f"{params['total']:,}")
    header.add_row("passes", ", ".join(names) or "none (plain Inductor)")
    header.add_row("prompt / decode", f"{B} x {T} tokens, {N} greedy steps")
    header.add_row("compiled graph", f"one static graph over [{B}, {L}] = prompt + decode positions (right-padded)")
    console.print(header)

    with torch.no_grad():
        # 1. eager reference (one warm-up forward first, so TTFT does not time one-off set-up)
        with step(f"eager: prefill {B}x{T} and {N} incremental decode steps"):
            model(prompt)
            prompt_ref, steps_ref, eager_tokens, eager_ttft, eager_step_s = _eager_generate(model, prompt, N, clock)
        # teacher forcing: the whole sequence both models see, prompt + eager's greedy tokens
        sequence = torch.cat([prompt, eager_tokens[:, :N]], dim=1)

        # 2. compile: the first call of the static sequence graph
        fused = common.compile_model(model, names, args.device)
        with step(f"compiling the sequence graph [{B}, {L}] with {', '.join(names) or 'no passes'}"):
            _, compile_s = clock(fused, _padded(sequence, T))

        # 3. compiled prefill and teacher-forced decode
        with step(f"compiled: prefill and {N} decode steps (each a full forward over {L} positions)"):
            logits, ttft = clock(fused, _padded(sequence, T))
            prompt_got = logits[:, :T]
            compiled_tokens = [prompt_got[:, -1].argmax(-1, keepdim=True)]
            steps_got, step_s = [], []
            for k in range(1, N + 1):
                logits, seconds = clock(fused, _padded(sequence, T + k))
                steps_got.append(logits[:, T + k - 1])
                step_s.append(seconds)
                compiled_tokens.append(steps_got[-1].argmax(-1, keepdim=True))
        compiled_tokens = torch.cat(compiled_tokens, dim=1)

    # 4. compare
    prompt_metrics = compare_logits(prompt_ref, prompt_got)
    step_metrics = []
    for k, (ref, got) in enumerate(zip(steps_ref, steps_got), start=1):
        m = compare_logits(ref, got)
        m.update(step=k, eager_token=ref.argmax(-1).tolist(), compiled_token=got.argmax(-1).tolist())
        step_metrics.append(m)
    overall = merge_metrics([prompt_metrics] + step_metrics)
    passed = overall["finite"] and overall["max_abs"] <= tolerance
    report = fused.report
    result = {
        "schema": "megafuse.run/1",
        "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant, "device": args.device,
        "batch": B, "prompt_len": T, "decode_steps": N, "seed": args.seed, "seq_len": L,
        "passes": names,
        "parameters": params,
        "graph": {"shape": [B, L], "dynamic": False, "compile_s": compile_s, "graphs_compiled": len(report.graphs),
                  "note": "one static graph over prompt + decode positions; each call right-pads the known "
                          "tokens with PAD_ID (the model is causal) and reads its positions"},
        "counts": report.counts(),
        "report": report.to_dict(),
        "comparison": {"prompt": prompt_metrics, "steps": step_metrics, "overall": overall,
                       "tolerance": tolerance, "passed": passed},
        "timing": {
            "method": common.timing_method(args.device), "indicative": args.device != "cuda",
            "eager": _timing(eager_ttft, eager_step_s, B),
            "compiled": {**_timing(ttft, step_s, B),
                         "note": f"each call is a full forward over {L} positions (prefill included): decode "
                                 "re-runs the sequence, there is no compiled incremental decode"},
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
    if result["graph"]["graphs_compiled"] != 1:  # a guard failed: the report sums every graph
        console.print(f"[yellow]note:[/yellow] {result['graph']['graphs_compiled']} graphs were compiled "
                      "(a recompile); the counts above add up all of them")
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
    for col in ("", "eager\n(cache decode)", f"compiled\n(full {result['seq_len']}-position forward)"):
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
