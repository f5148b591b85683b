"""`megafuse generate`: token-id prompts in, generated token ids out, through the serving engine.

Prompts come from `--prompt 1,2,3` (repeatable), `--prompts FILE` (a JSON list of token-id lists)
or, without either, `--batch` random prompts of `--prompt-len` tokens. The engine (runtime.Engine)
runs them with continuous batching over the byte cache: decodes first, chunked prefill under
`--token-budget`, the prefix cache, bounded replay and the trimmed decoder unless turned off. The
step runs compiled with the passes (`--passes`, `--no-<pass>`), once per padded bucket, and on a
GPU as CUDA graphs (`--no-cuda-graphs`); `--eager` runs it uncompiled (no compile time). A request
the device cannot hold (the weights, the cache and the first step: `request_size`) is refused before
the model is built, and an allocation that fails anyway is a usage error naming the sizes.

`--world-size N` runs N ranks, one process each (runtime/distributed.py): data-parallel attention
(each rank its own engine, caches and prefix cache; sessions routed to ranks by SessionRouter) with
expert parallelism (each rank a contiguous shard of the routed experts, slots exchanged by
all-to-all), over gloo on CPUs and NCCL on GPUs (rank r on cuda:r). The step runs compiled or eager,
without CUDA graphs; a rank that fails ends the job with the rank and the reason named.

JSON (`--json PATH`, '-' for stdout): schema "megafuse.generate/3", documented in docs/tools.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rich.table import Table

import torch

from megafuse.model import CacheLayout
from megafuse.model.expert_parallel import expert_range, shard_experts
from megafuse.runtime import Engine, RequestError, SamplingParams
from megafuse.runtime.distributed import RankFailure, SessionRouter, launch, step_together

from . import common
from .output import ToolError, console, environment, tables_to_stderr, write_json

EXAMPLES = """examples:
  megafuse generate --config tiny --prompt 1,2,3 --prompt 4,5 --max-new-tokens 8 --eager
  megafuse generate --config proxy --device cuda --batch 8 --prompt-len 512   # compiled, CUDA graphs
  megafuse generate --config tiny --batch 4 --prompt-len 100 --json -      # compiled with the passes
  megafuse generate --config tiny --prompts prompts.json --temperature 0.8 --top-p 0.9 --seed 1 --eager
  megafuse generate --config tiny --prompt 1,2,3 --no-swa-bounded-replay --no-trim --eager   # exact mode
  megafuse generate --config tiny --batch 4 --eager --world-size 2   # 2 ranks: DP attention + EP experts
"""

PAGE_SIZE = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, prompt_len=16)
    parser.add_argument("--prompt", action="append", metavar="IDS", help="comma-separated token ids (repeatable)")
    parser.add_argument("--prompts", metavar="FILE", help="a JSON list of token-id lists")
    parser.add_argument("--max-new-tokens", type=common.in_range(at_least=1), default=16, metavar="N",
                        help="tokens per request (default 16)")
    parser.add_argument("--temperature", type=common.in_range(float, at_least=0), default=0.0,
                        help="0 = greedy (default)")
    parser.add_argument("--top-p", type=common.in_range(float, above=0, at_most=1), default=1.0,
                        help="the nucleus, in (0, 1] (default 1)")
    parser.add_argument("--token-budget", type=common.in_range(at_least=1), default=256,
                        help="rows per step (default 256)")
    parser.add_argument("--slots", type=common.in_range(at_least=1),
                        help="requests running at once (default: all of them)")
    parser.add_argument("--no-prefix-cache", action="store_true")
    parser.add_argument("--no-swa-bounded-replay", action="store_true", help="replay L x W tokens on a hit (exact)")
    parser.add_argument("--no-trim", action="store_true", help="run the decoder layers on every prefill row")
    common.add_engine_step_arguments(parser)
    parser.add_argument("--world-size", type=common.in_range(at_least=1), default=1, metavar="N",
                        help="ranks (processes): data-parallel attention + expert parallelism (default 1)")
    parser.add_argument("--rank-timeout", type=common.in_range(float, above=0), default=1800, metavar="S",
                        help="seconds a collective waits for the other ranks before the job fails; it must cover "
                             "the longest compile, which the other ranks wait out (default 1800)")
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


def _check_world(args: argparse.Namespace, cfg) -> None:
    if args.world_size > 1:
        if args.device == "cuda" and not (args.eager or args.no_cuda_graphs):
            raise ToolError("--world-size > 1 runs without CUDA graphs (the all-to-all waits on the host for the "
                            "routing's counts): add --no-cuda-graphs")
        if args.world_size > cfg.n_experts:
            raise ToolError(f"--world-size {args.world_size} exceeds the {cfg.n_experts} routed experts of "
                            f"{cfg.name}: every rank holds at least one")
        if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
            raise ToolError(f"--world-size {args.world_size} needs {args.world_size} GPUs; "
                            f"this machine has {torch.cuda.device_count()}")


def _layout(args: argparse.Namespace, prompts: list[list[int]]) -> CacheLayout:
    """A slot per running request (--slots, default one per prompt), each with room for the longest."""
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    return CacheLayout.private(args.slots or len(prompts), longest, PAGE_SIZE)


def request_size(cfg, args: argparse.Namespace, prompts: list[list[int]]) -> common.RequestSize:
    """What one rank holds at once, at least: the weights, the cache of `_layout` and the engine's
    first step, whose rows (min(--token-budget, the shortest prompt) or more: no prefix is cached
    yet) each score every entry a request's pages can hold. One rank's share: a lower bound for
    the job."""
    layout = _layout(args, prompts)
    rows = min(args.token_budget, min(len(p) for p in prompts))
    return common.RequestSize(
        f"{len(prompts)} request{'s' if len(prompts) > 1 else ''} of up to {layout.max_tokens} positions (prompt + --max-new-tokens "
        f"{args.max_new_tokens}, pages of {PAGE_SIZE}) in {layout.slots} slot{'s' if layout.slots > 1 else ''}, --token-budget {args.token_budget}",
        max(len(p) for p in prompts) + args.max_new_tokens, common.model_bytes(cfg), layout.nbytes(cfg),
        common.activation_bytes(cfg, rows, layout.max_tokens, 1, step="eager" if args.eager else "compiled"),
        "shorter prompts, fewer --slots or a smaller --token-budget")


def _serve(rank: int, world: int, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Build the model and engine of `rank` of `world`, serve the prompts routed to it, and return
    its outputs (by prompt index), stats, expert range and engine description."""
    size = request_size(common.resolve_model_config(args), args, prompts)
    cfg, model = common.load_model(args, size)
    experts = expert_range(cfg.n_experts, rank, world)
    if world > 1:
        shard_experts(model, rank, world)
    router = SessionRouter(world)
    layout = _layout(args, prompts)
    sampling = SamplingParams(args.temperature, args.top_p, args.seed)
    with common.out_of_memory_is_usage_error(size, args.device):
        try:
            engine = Engine(model, layout=layout, prefix_cache=not args.no_prefix_cache,
                            swa_bounded_replay=not args.no_swa_bounded_replay, trim_decoder=not args.no_trim,
                            token_budget=args.token_budget, **common.engine_step_options(args))
            ids = {i: engine.add_request(p, args.max_new_tokens, sampling) for i, p in enumerate(prompts)
                   if router.route(i, len(p) + args.max_new_tokens) == rank}  # each prompt is its own session
        except (RequestError, ValueError) as e:
            raise ToolError(str(e)) from None
        start, setup = time.perf_counter(), 0.0
        if world > 1:
            setup = step_together(engine)[1]
        else:
            while engine.waiting or engine.running:
                engine.step()
                setup += engine.setup_s
    seconds = time.perf_counter() - start - setup  # serving time: compile and capture are setup_s
    runner = engine.step_runner
    return {"outputs": {i: engine.requests[r].output for i, r in ids.items()},
            "stats": dataclasses.asdict(engine.stats) | {"setup_s": setup, "seconds": seconds},
            "experts": [experts.start, experts.stop],
            "engine": {"prefix_cache": engine.prefix_cache, "swa_bounded_replay": not args.no_swa_bounded_replay,
                       "trim_decoder": engine.trim, "token_budget": engine.token_budget,
                       "cache": dataclasses.asdict(layout),
                       "step": "eager" if runner is None else "compiled",
                       "passes": None if runner is None else runner.passes,
                       "cuda_graphs": runner is not None and runner.cuda_graphs,
                       "buckets": None if runner is None else list(runner.buckets),
                       "graphs": None if runner is None else dataclasses.asdict(runner.stats),
                       "counts": None if runner is None else runner.report().counts()}}


def _merged_stats(ranks: list[dict]) -> dict:
    """The ranks' stats summed; steps and seconds are the slowest rank's (the ranks step together)."""
    stats = {k: sum(r["stats"][k] for r in ranks) for k in ranks[0]["stats"]}
    stats["steps"] = max(r["stats"]["steps"] for r in ranks)
    stats["seconds"] = max(r["stats"]["seconds"] for r in ranks)
    return stats


def _main(args: argparse.Namespace) -> int:
    cfg = common.resolve_model_config(args)
    _check_world(args, cfg)
    prompts = _prompts(args, cfg)
    if not prompts:
        raise ToolError("no prompts given")
    if not all(prompts):
        raise ToolError(f"prompt {[len(p) for p in prompts].index(0)} is empty; a request needs at least one token")
    if args.world_size == 1 or args.device == "cpu":  # refused before any work starts; GPU ranks check their own
        common.check_fits(cfg, args.device, request_size(cfg, args, prompts))
    sampling = SamplingParams(args.temperature, args.top_p, args.seed)
    work = f"generating {args.max_new_tokens} tokens for {len(prompts)} request{'s' if len(prompts) > 1 else ''}"
    with common.step(work + (f" on {args.world_size} ranks" if args.world_size > 1 else "")):
        if args.world_size == 1:
            ranks = [_serve(0, 1, args, prompts)]
        else:
            try:
                ranks = launch(_serve, args.world_size, (args, prompts),
                               backend="nccl" if args.device == "cuda" else "gloo", timeout_s=args.rank_timeout)
            except RankFailure as e:
                raise ToolError(f"the {args.world_size}-rank job failed: {e}") from None
    outputs = [next(r["outputs"][i] for r in ranks if i in r["outputs"]) for i in range(len(prompts))]
    stats = _merged_stats(ranks)
    stats["output_tokens_per_s"] = sum(map(len, outputs)) / stats["seconds"]
    result = {
        "schema": "megafuse.generate/3", "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant,
        "device": args.device, "engine": ranks[0]["engine"], "sampling": dataclasses.asdict(sampling),
        "requests": [{"prompt_len": len(p), "output": o} for p, o in zip(prompts, outputs)],
        "stats": stats, "world_size": args.world_size,
        "ranks": [{"rank": n, "experts": r["experts"], "requests": sorted(r["outputs"]), "stats": r["stats"]}
                  for n, r in enumerate(ranks)],
        "environment": environment(),
    }
    table = Table(title=f"megafuse generate: {cfg.name} ({cfg.dtype}, quant={cfg.quant}, {args.device}"
                        + (f", {args.world_size} ranks" if args.world_size > 1 else "") + ")")
    columns = ("request",) + (("rank",) if args.world_size > 1 else ()) + ("prompt tokens", "output token ids")
    for col in columns:
        table.add_column(col)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        rank = (str(next(n for n, r in enumerate(ranks) if i in r["outputs"])),) if args.world_size > 1 else ()
        table.add_row(str(i), *rank, str(len(p)), " ".join(map(str, o)))
    console.print(table)
    console.print(", ".join(f"{k.replace('_', ' ')} {v:,.2f}" if isinstance(v, float) else f"{k.replace('_', ' ')} {v}"
                            for k, v in stats.items()))
    if args.json:
        write_json(result, args.json)
    return 0
