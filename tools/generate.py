"""`megafuse generate`: token-id prompts in, generated token ids out, through the serving engine.

Prompts come from `--prompt 1,2,3` (repeatable), `--prompts FILE` (a JSON list of token-id lists)
or, without either, `--batch` random prompts of `--prompt-len` tokens. The engine (runtime.Engine)
runs them with continuous batching over the byte cache: decodes first, chunked prefill under
`--token-budget`, the prefix cache, bounded replay and the trimmed decoder unless turned off. The
step runs compiled with the passes (`--passes`, `--no-<pass>`), once per padded bucket, and on a
GPU as CUDA graphs (`--no-cuda-graphs`); `--eager` runs it uncompiled (no compile time).

JSON (`--json PATH`, '-' for stdout), schema "megafuse.generate/2":

    schema          "megafuse.generate/2"
    config, dtype, quant, device        str
    engine          {prefix_cache, swa_bounded_replay, trim_decoder: bool, token_budget: int,
                     cache: {slots, pages, page_size, max_pages}, step: "compiled" | "eager",
                     passes: [str] | null, cuda_graphs: bool, buckets: [int] | null,
                     graphs: {buckets, first_run_s, graphs, captures, capture_s, graph_bytes} | null,
                     counts: {pass: matches} | null}      (null: the eager step)
    sampling        {temperature, top_p, seed}
    requests        [{prompt_len: int, output: [int]}]
    stats           {steps, prefix_hits, hit_tokens, replayed_tokens, trimmed_tokens, preemptions,
                     evictions: int, setup_s: float (compile and capture), seconds: float (the rest),
                     output_tokens_per_s: float}
    environment     {date, python, torch, triton, device}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rich.table import Table

from megafuse.model import CacheLayout
from megafuse.runtime import Engine, RequestError, SamplingParams

from . import common
from .output import ToolError, console, environment, tables_to_stderr, write_json

EXAMPLES = """examples:
  megafuse generate --config tiny --prompt 1,2,3 --prompt 4,5 --max-new-tokens 8 --eager
  megafuse generate --config proxy --device cuda --batch 8 --prompt-len 512   # compiled, CUDA graphs
  megafuse generate --config tiny --batch 4 --prompt-len 100 --json -
  megafuse generate --config tiny --prompts prompts.json --temperature 0.8 --top-p 0.9 --seed 1
  megafuse generate --config tiny --prompt 1,2,3 --no-swa-bounded-replay --no-trim   # exact mode
"""

PAGE_SIZE = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, prompt_len=16)
    parser.add_argument("--prompt", action="append", metavar="IDS", help="comma-separated token ids (repeatable)")
    parser.add_argument("--prompts", metavar="FILE", help="a JSON list of token-id lists")
    parser.add_argument("--max-new-tokens", type=int, default=16, metavar="N", help="tokens per request (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--token-budget", type=int, default=256, help="rows per step (default 256)")
    parser.add_argument("--slots", type=int, help="requests running at once (default: all of them)")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--no-swa-bounded-replay", action="store_true", help="replay L x W tokens on a hit (exact)")
    parser.add_argument("--no-trim", action="store_true", help="run the decoder layers on every prefill row")
    common.add_engine_step_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")


def _prompts(args: argparse.Namespace, cfg) -> list[list[int]]:
    if args.prompt and args.prompts:
        raise ToolError("give prompts with --prompt or --prompts, not both")
    if args.prompts:
        data = json.loads(Path(args.prompts).read_text())
        if not isinstance(data, list) or not all(isinstance(p, list) for p in data):
            raise ToolError(f"{args.prompts}: expected a JSON list of token-id lists")
        return data
    if args.prompt:
        try:
            return [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt]
        except ValueError as e:
            raise ToolError(f"--prompt takes comma-separated integers: {e}") from None
    return common.random_ids(cfg, args.batch, args.prompt_len, args.seed, "cpu").tolist()


def main(args: argparse.Namespace) -> int:
    with tables_to_stderr(args.json == "-"):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    cfg, model = common.load_model(args)
    prompts = _prompts(args, cfg)
    if not prompts:
        raise ToolError("no prompts given")
    longest = max(len(p) for p in prompts) + max(args.max_new_tokens, 1)
    slots = args.slots or len(prompts)
    layout = CacheLayout.private(slots, longest, PAGE_SIZE)
    sampling = SamplingParams(args.temperature, args.top_p, args.seed)
    try:
        engine = Engine(model, layout=layout, prefix_cache=not args.no_prefix_cache,
                        swa_bounded_replay=not args.no_swa_bounded_replay, trim_decoder=not args.no_trim,
                        token_budget=args.token_budget, **common.engine_step_options(args))
        ids = [engine.add_request(p, args.max_new_tokens, sampling) for p in prompts]
    except (RequestError, ValueError) as e:
        raise ToolError(str(e)) from None
    with common.step(f"generating {args.max_new_tokens} tokens for {len(prompts)} requests"):
        start, setup = time.perf_counter(), 0.0
        while engine.waiting or engine.running:
            engine.step()
            setup += engine.setup_s
        seconds = time.perf_counter() - start - setup  # serving time: compile and capture are setup_s
    outputs = [engine.requests[i].output for i in ids]
    stats = dataclasses.asdict(engine.stats) | {
        "setup_s": setup, "seconds": seconds, "output_tokens_per_s": sum(map(len, outputs)) / seconds}
    runner = engine.step_runner
    result = {
        "schema": "megafuse.generate/2", "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant,
        "device": args.device,
        "engine": {"prefix_cache": engine.prefix_cache, "swa_bounded_replay": not args.no_swa_bounded_replay,
                   "trim_decoder": engine.trim, "token_budget": engine.token_budget,
                   "cache": dataclasses.asdict(layout),
                   "step": "eager" if runner is None else "compiled",
                   "passes": None if runner is None else runner.passes,
                   "cuda_graphs": runner is not None and runner.cuda_graphs,
                   "buckets": None if runner is None else list(runner.buckets),
                   "graphs": None if runner is None else dataclasses.asdict(runner.stats),
                   "counts": None if runner is None else runner.report().counts()},
        "sampling": dataclasses.asdict(sampling),
        "requests": [{"prompt_len": len(p), "output": o} for p, o in zip(prompts, outputs)],
        "stats": stats, "environment": environment(),
    }
    table = Table(title=f"megafuse generate: {cfg.name} ({cfg.dtype}, quant={cfg.quant}, {args.device})")
    for col in ("request", "prompt tokens", "output token ids"):
        table.add_column(col)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        table.add_row(str(i), str(len(p)), " ".join(map(str, o)))
    console.print(table)
    console.print(", ".join(f"{k.replace('_', ' ')} {v:,.2f}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                            for k, v in stats.items()))
    if args.json:
        write_json(result, args.json)
    return 0
