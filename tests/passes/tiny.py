"""The `tiny` model compiled with some passes, as the whole-model pass tests use it."""

import torch

from megafuse import passes
from megafuse.model import build_model, preset


def compile_tiny(enabled: list[str], tokens: int, dump_dir=None, **compile_kwargs):
    """tiny in fp32 without quantisation, a seeded [1, tokens] prompt, compiled (fullgraph) with the
    `enabled` passes and run once: (config, eager model, ids, compiled module, its logits)."""
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    fused = passes.compile(model, passes=enabled, dump_dir=dump_dir, fullgraph=True, **compile_kwargs)
    return cfg, model, ids, fused, fused(ids)
