"""`megafuse run`: build a model, prefill a prompt, greedily decode, and summarise.

This is the eager demo of the foundation; the compile-and-run comparison grows from it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.table import Table

from model.config import DTYPES, QUANT_MODES, resolve_config
from model.checkpoint import load_checkpoint
from model.stats import parameter_counts
from model.transformer import build_model

from .output import console, environment, write_json

EXAMPLES = """examples:
  megafuse run --config tiny                          # the demo: prefill 32 tokens, decode 16
  megafuse run --config tiny --prompt-len 64 --decode 32 --batch 2 --json run.json
  megafuse run --config proxy --device cuda --dtype bfloat16
  megafuse run --config ./checkpoint_dir              # a directory written by save_checkpoint
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="a preset (tiny, proxy, flash), a config JSON or a checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", choices=DTYPES, help="override the config's dtype")
    parser.add_argument("--quant", choices=QUANT_MODES, help="override the config's quant mode")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decode", type=int, default=16, metavar="N", help="greedy decode steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-' for stdout)")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(args: argparse.Namespace) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here; use --device cpu")
    for name in ("prompt_len", "batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.decode < 0:
        raise SystemExit(f"--decode must be >= 0, got {args.decode}")

    cfg = resolve_config(args.config)
    overrides = {k: v for k, v in (("dtype", args.dtype), ("quant", args.quant)) if v}
    cfg = cfg.replace(**overrides) if overrides else cfg
    with console.status(f"building {cfg.name} on {args.device}"):
        if Path(args.config).is_dir():
            model = load_checkpoint(args.config, device=args.device, cfg=cfg)
        else:
            model = build_model(cfg, seed=args.seed, device=args.device)
    params = parameter_counts(cfg, model)

    generator = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=generator).to(args.device)
    cache = model.new_cache(args.batch)
    with torch.no_grad():
        start = time.perf_counter()
        logits = model(prompt, cache)
        _sync(args.device)
        ttft = time.perf_counter() - start
        first_logits = logits[:, -1]
        token = logits[:, -1].argmax(-1, keepdim=True)
        generated, step_times = [token], []
        for _ in range(args.decode):
            start = time.perf_counter()
            logits = model(token, cache)
            _sync(args.device)
            step_times.append(time.perf_counter() - start)
            token = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(token)

    tokens = torch.cat(generated, dim=1).cpu()
    decode_s = sum(step_times)
    result = {
        "config": cfg.name,
        "dtype": cfg.dtype,
        "quant": cfg.quant,
        "device": args.device,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode,
        "parameters": params,
        "ttft_s": ttft,
        "prefill_tokens_per_s": args.batch * args.prompt_len / ttft,
        "decode_tokens_per_s": args.batch * args.decode / decode_s if args.decode else None,
        "timing_note": "wall clock, eager; indicative only on CPU",
        "first_logits": {
            "mean": first_logits.mean().item(),
            "std": first_logits.std().item(),
            "max_abs": first_logits.abs().max().item(),
            "finite": bool(torch.isfinite(first_logits).all()),
        },
        "generated": tokens.tolist(),
        "environment": environment(),
    }

    table = Table(title=f"megafuse run: {cfg.name} ({cfg.dtype}, quant={cfg.quant}, {args.device}, eager)", show_header=False)
    table.add_row("parameters", f"{params['total']:,} ({params['activated_per_token']:,} activated per token)")
    table.add_row("prompt", f"{args.batch} x {args.prompt_len} tokens")
    table.add_row("TTFT", f"{ttft * 1e3:.1f} ms ({result['prefill_tokens_per_s']:,.0f} tokens/s)")
    if args.decode:
        table.add_row("decode", f"{args.decode} steps, {decode_s / args.decode * 1e3:.1f} ms/step, "
                                f"{result['decode_tokens_per_s']:,.1f} tokens/s")
    fl = result["first_logits"]
    table.add_row("first-token logits", f"mean {fl['mean']:+.4f}  std {fl['std']:.4f}  max|.| {fl['max_abs']:.3f}  finite {fl['finite']}")
    table.add_row("generated (request 0)", " ".join(str(t) for t in result["generated"][0]))
    table.add_row("timing", result["timing_note"] if args.device == "cpu" else "wall clock with device sync, eager")
    if args.json != "-":
        console.print(table)
    if args.json:
        write_json(result, args.json)
    return 0 if fl["finite"] else 1
