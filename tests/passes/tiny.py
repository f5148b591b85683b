"""The `tiny` model compiled with some passes, as the whole-model pass tests use it."""

import torch

from megafuse import passes
from megafuse.model import build_model, preset


def every_role_tiny(**changes):
    """`tiny` cut to 5 layers, one of each role (`proxy`'s layout): SWA-only, Full ratio 2 (with
    Engram), Full ratio 1 at L/2 (the decoder KV and candidate source), Reuse, Reindex with
    candidates. tiny's 12 layers compile in ~9 minutes on 2 CPU cores; these in about a third."""
    return preset("tiny").replace(n_layers=5, compress_ratios=(0, 2, 1, 1, 1), kv_source_layers=(1, 2),
                                  index_source_layers=(1, 2, 4), engram_layers=(1,), **changes)


def step_counts(cfg) -> tuple[dict, dict]:
    """What each pass matches in one bucket of the compiled step's two regions (`runtime.graphs`):
    (encoder, decoder). Every layer has two mHC seams, one gate, one attention and one MoE's routed
    experts, and each layer with its own indexer (roles full and reindex) an indexer step; the
    decoder region's head adds its collapse, and the encoder hands its last pre-mix to the decoder
    un-collapsed."""
    encoder = cfg.decoder_kv_layer + 1  # `Transformer.decoder_start`
    decoder = cfg.n_layers - encoder
    indexers = [cfg.role(i) in ("full", "reindex") for i in range(cfg.n_layers)]
    return ({"mega_mhc": 2 * encoder, "mega_gate": encoder, "mega_attention": encoder, "mega_moe": encoder,
             "mega_indexer": sum(indexers[:encoder])},
            {"mega_mhc": 2 * decoder + 1, "mega_gate": decoder, "mega_attention": decoder, "mega_moe": decoder,
             "mega_indexer": sum(indexers[encoder:])})


def compile_tiny(enabled: list[str], tokens: int, dump_dir=None, **compile_kwargs):
    """tiny's roles (`every_role_tiny`) in fp32 without quantisation, a seeded [1, tokens] prompt,
    compiled (fullgraph) with the `enabled` passes and run once: (config, eager model, ids,
    compiled module, its logits)."""
    cfg = every_role_tiny(quant="none")
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    fused = passes.compile(model, passes=enabled, dump_dir=dump_dir, fullgraph=True, **compile_kwargs)
    return cfg, model, ids, fused, fused(ids)
