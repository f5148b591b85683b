"""H200: one batched step of a full-depth preset, eager and compiled with the passes.

    python3 -m megafuse.tools.bench_step --config flash-lite --out results/step/bench.json
    python3 -m megafuse.tools.bench_step --config tiny --chunk 64 --decodes 4 --context 24 --dry-run   # CPU

The step a serving engine runs most under load: one prefill chunk of a new request (`--chunk`
tokens, final, decoder trimmed to its last W rows) together with one decode row for each of
`--decodes` running requests at `--context` tokens. Stages, each saved as it finishes:

1. build: the preset on the device, seeded weights; the bytes the weights take;
2. compiled: eager steps prefill the running requests (at most 4096 rows a step), so the measured
   step's decodes read real cache rows; then the step's two regions through `passes.compile`
   (fullgraph, static shapes, every pass): compile time (the first call), the pass counts, the
   CUDA-event median of `--repeat` steps and the peak memory allocated while they ran;
3. eager: the same on a fresh cache with `model.step` (after one untimed step);
4. compare: compiled against eager logits (max |error|, top-1 agreement). Under quant="ref" the
   two differ where a value sits on a rounding boundary of a fake-quantised format or index
   scores tie to the last bit (the top-k then picks other entries): compare quant="none" runs
   (`--quant none`) for agreement to fp rounding.

The measured step is the same batch each time (its cache writes rewrite the same rows).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import torch

from megafuse import passes
from megafuse.model import (CacheLayout, DecoderRegion, EncoderRegion, SequenceGroup, build_model, build_step,
                            page_table, resolve_config)
from megafuse.model.stats import device_parameter_bytes
from megafuse.tools.bench_common import Stages, default_out, require_cuda
from megafuse.tools.common import Stopwatch, median
from megafuse.tools.output import environment

PAGE_SIZE = 64
FILL_ROWS = 4096  # rows per eager fill step: the indexer's per-row key gather grows with rows x context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m megafuse.tools.bench_step", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="flash-lite", help="preset, config JSON or checkpoint dir (default flash-lite)")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens (default 4096)")
    parser.add_argument("--decodes", type=int, default=32, help="decode rows, one per running request (default 32)")
    parser.add_argument("--context", type=int, default=512, help="tokens each running request holds (default 512)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per side (default 5)")
    parser.add_argument("--quant", choices=("ref", "none"), help="override the config's quant mode")
    parser.add_argument("--out", help="results JSON (default results/step/bench.json)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, no timing claims: checks the stages run")
    args = parser.parse_args(argv)
    require_cuda(parser, args.dry_run)
    for name in ("chunk", "decodes", "context", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    device = "cpu" if args.dry_run else "cuda"
    out = args.out or default_out("step", args.dry_run)
    cfg = resolve_config(args.config)
    if args.quant:
        cfg = cfg.replace(quant=args.quant)
    D, C, N = args.decodes, args.context, args.chunk
    layout = CacheLayout.private(D + 1, max(N, C + 1), PAGE_SIZE)
    results = {"schema": "megafuse.bench_step/1", "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant,
               "step": {"prefill_chunk": N, "decodes": D, "decode_context": C,
                        "rows": N + D, "decoder_rows": min(N, cfg.window) + D},
               "cache_layout": vars(layout) | {"max_tokens": layout.max_tokens},
               "date": datetime.date.today().isoformat(), "environment": environment()}
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    stages = Stages(results, out, log)
    state: dict = {}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (C + 1,), generator=g).tolist() for _ in range(D)]
    prompts.append(torch.randint(0, cfg.vocab_size, (N,), generator=g).tolist())
    measured_plan = [(i, 1, True) for i in range(D)] + [(D, N, True)]

    def build():
        t0 = time.time()
        with torch.no_grad():
            state["model"] = build_model(cfg, seed=0, device=device)
        return {"seconds": round(time.time() - t0, 1), "weights_on_device_bytes": device_parameter_bytes(cfg)}

    def fresh_group():
        """Running requests prefilled to `context` tokens (eager); the new request not yet run."""
        group = SequenceGroup(cfg, layout, prompts, device)
        per_step = max(1, FILL_ROWS // C)
        with torch.no_grad():
            for first in range(0, D, per_step):
                group.step(state["model"].step, [(i, C, True) for i in range(first, min(D, first + per_step))], trim=True)
        return group

    def measured(group):
        """The measured step's batch (built once; each run rewrites the same cache rows)."""
        chunks = [group.sequences[i].chunk(n, final, trim=True) for i, n, final in measured_plan]
        return build_step(cfg, layout, chunks, page_table(layout, group.sequences), device=device)

    def timed(run, group, batch):
        """(first call's logits, its seconds, median step seconds, peak bytes while timing)."""
        with torch.no_grad():
            t0 = time.time()
            logits = run(batch, group.cache)
            if device == "cuda":
                torch.cuda.synchronize()
                first_s = time.time() - t0
                torch.cuda.reset_peak_memory_stats()
            else:
                first_s = time.time() - t0
            clock = Stopwatch(device)
            step_s = median([clock(run, batch, group.cache)[1] for _ in range(args.repeat)])
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
        return logits, first_s, step_s, peak

    def compiled():
        model = state["model"]
        encoder = passes.compile(EncoderRegion(model), fullgraph=True, dynamic=False)
        decoder = passes.compile(DecoderRegion(model), fullgraph=True, dynamic=False)
        group = fresh_group()
        logits, compile_s, step_s, peak = timed(lambda b, c: decoder(*encoder(b, c), b, c), group, measured(group))
        state["compiled_logits"] = logits
        state["cache_bytes"] = group.cache.nbytes()
        return {"compile_s": round(compile_s, 1), "step_s": step_s, "peak_allocated_bytes": peak,
                "counts": {"encoder": encoder.report.counts(), "decoder": decoder.report.counts()},
                "graphs": len(encoder.report.graphs) + len(decoder.report.graphs)}

    def eager():
        group = fresh_group()
        logits, _, step_s, peak = timed(state["model"].step, group, measured(group))
        state["eager_logits"] = logits
        return {"step_s": step_s, "peak_allocated_bytes": peak}

    def compare():
        got, ref = state["compiled_logits"].float(), state["eager_logits"].float()
        return {"max_abs_logits_error": (got - ref).abs().max().item(), "logits_abs_max": ref.abs().max().item(),
                "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                "speedup_compiled_vs_eager": results["eager"]["step_s"] / results["compiled"]["step_s"],
                "cache_bytes": state["cache_bytes"]}

    for name, fn in (("build", build), ("compiled", compiled), ("eager", eager), ("compare", compare)):
        stages.run(name, fn)
        if not results["stages"][name]["ok"] and name == "build":
            break
    log(f"wrote {out}")
    return 0 if all(s["ok"] for s in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
