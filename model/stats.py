"""Sizes of a configuration: parameters, activated parameters per token, cache bytes, and the bytes
one decode step must read (the floor of a memory-bound step).

Counts come from the module built on the meta device, so they always agree with the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import quant
from .cache import DEFAULT_PAGE_SIZE, pool_specs, row_codec
from .config import ModelConfig
from .transformer import Transformer, build_model


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_counts(cfg: ModelConfig, model: Transformer | None = None) -> dict:
    """Backbone, Engram tables (host-resident), routed experts, and activated per token."""
    model = model or build_model(cfg, device="meta")
    engram_tables = sum(b.engram.table.numel() for b in model.layers if b.engram is not None)
    routed = sum(_numel(b.moe.experts) for b in model.layers)
    total = _numel(model)
    backbone = total - engram_tables
    # A token runs k of E routed experts; everything else in the backbone runs for every token,
    # plus one row per Engram lookup (negligible, counted as the looked-up rows).
    routed_active = routed * cfg.n_active_experts // cfg.n_experts
    engram_rows = sum((cfg.engram_max_ngram - 1) * cfg.engram_heads * cfg.engram_head_dim
                      for b in model.layers if b.engram is not None)
    embed_rows = cfg.dim  # one embedding row, not the whole table
    activated = backbone - routed + routed_active - model.embed.weight.numel() + embed_rows + engram_rows
    return {
        "total": total,
        "backbone": backbone,
        "engram_tables": engram_tables,
        "routed_experts": routed,
        "activated_per_token": activated,
    }


def device_parameter_bytes(cfg: ModelConfig, model: Transformer | None = None) -> int:
    """Bytes of the parameters a GPU holds: everything but the Engram tables (host-resident)."""
    model = model or build_model(cfg, device="meta")
    tables = {id(b.engram.table) for b in model.layers if b.engram is not None}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in tables)


def global_kv_bytes_per_token(cfg: ModelConfig) -> float:
    """Sum over kv sources of (FP4 entry + MXFP4 index key) / ratio (docs/model.md section 6)."""
    per_entry = quant.row_bytes("global_fp4", cfg.head_dim) + quant.row_bytes("index_mxfp4", cfg.index_head_dim)
    return sum(per_entry / cfg.compress_ratios[s] for s in cfg.kv_source_layers)


def swa_bytes_per_request(cfg: ModelConfig) -> int:
    """Every layer keeps its last W SWA rows in FP8 (528 B per 512-dim row)."""
    return quant.row_bytes("swa_fp8", cfg.head_dim) * cfg.n_layers * cfg.window


def summary(cfg: ModelConfig) -> dict:
    model = build_model(cfg, device="meta")
    return {
        "config": cfg.name,
        "parameters": parameter_counts(cfg, model),
        "device_parameter_bytes": device_parameter_bytes(cfg, model),
        "global_kv_bytes_per_token": global_kv_bytes_per_token(cfg),
        "swa_bytes_per_request": swa_bytes_per_request(cfg),
        "roles": cfg.role_table(),
    }


# ---- what a decode step reads ---------------------------------------------------------------------

CACHE_KINDS = ("swa", "index_keys", "global_kv", "compressor")


@dataclass(frozen=True)
class DecodeReads:
    """Bytes one decode step of `batch` requests, each holding `context` tokens, must read at least
    (`decode_read_bytes`): weights as stored, the cache rows it reads, the head. Writes (each layer's
    new SWA row, entry and index key) are not counted."""

    batch: int
    context: int
    experts_per_layer: int      # routed experts read per MoE layer: min(E, batch x k), an upper bound past batch 1
    weights: dict[str, int]     # {"dense", "routed_experts", "embedding_rows", "engram_rows"}
    head: int                   # the vocab x D head weight, whole
    cache: dict[str, dict[str, int]]  # {layer role: {cache kind (CACHE_KINDS): bytes}}, over the batch

    @property
    def cache_total(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.cache.values())

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.head + self.cache_total

    def to_dict(self) -> dict:
        return {"batch": self.batch, "context": self.context, "experts_per_layer": self.experts_per_layer,
                "weights": dict(self.weights), "head": self.head,
                "cache": {role: dict(kinds) for role, kinds in self.cache.items()},
                "cache_total": self.cache_total, "total": self.total}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def decode_read_bytes(cfg: ModelConfig, batch: int, context: int, model: Transformer | None = None) -> DecodeReads:
    """The bytes a decode step of `batch` requests reads at least, each request holding `context`
    tokens (its new token at position `context`), counted as stored (each tensor's own dtype):

    weights   every parameter and buffer the step reads whole: attention (compressor and indexer
              included), norms, mHC, router, shared expert, Engram's projections (`dense`); of the
              routed experts, min(E, batch x k) per MoE layer: exactly k at batch 1, an upper bound on
              the distinct experts beyond (`routed_experts`); one embedding row per request
              (`embedding_rows`); of each Engram table the rows the batch looks up, R per request
              (`engram_rows`); the head, vocab x D (`head`).
    cache     per layer, over the batch, in the cache's row formats (model/cache.py `row_codec`):
              swa         the ring's min(W - 1, context) rows before the new one (every layer);
              index_keys  an index source (full, reindex) scores every visible entry of its kv
                          source, (context + 1) // ratio, the one this step completes included;
                          a reindex layer past L/2 scores inside the candidate blocks only, at most
                          candidate_blocks x candidate_block_size entries;
              global_kv   the attention reads the top-k entries, min(index_topk, visible), in every
                          layer of ratio > 0 (a reuse layer reads its top-k source's picks again);
              compressor  a ratio-2 kv source whose new token closes a group reads the group's
                          first token (k, gate) from its pending row.

    Padding rows of a bucket are not requests and read nothing here; the model's eager step reads
    more than this (every page a request can address), a fused one need not.
    """
    if batch < 1 or context < 0:
        raise ValueError(f"decode_read_bytes: batch must be >= 1 and context >= 0, got {batch} and {context}")
    model = model or build_model(cfg, device="meta")
    experts = min(cfg.n_experts, batch * cfg.n_active_experts)
    banks = [p for block in model.layers for p in block.moe.experts.parameters()]  # [E, ...] each
    tables = [block.engram for block in model.layers if block.engram is not None]
    read_in_part = {id(t) for t in (model.embed.weight, model.head.weight, *banks, *(e.table for e in tables))}
    weights = {
        "dense": sum(_nbytes(t) for t in (*model.parameters(), *model.buffers()) if id(t) not in read_in_part),
        "routed_experts": sum(experts * _nbytes(p[0]) for p in banks),
        "embedding_rows": min(cfg.vocab_size, batch) * _nbytes(model.embed.weight[0]),
        "engram_rows": sum(min(e.hasher.total_rows, batch * e.hasher.rows_per_token) * _nbytes(e.table[0])
                           for e in tables),
    }

    row = {kind: row_codec(cfg, kind).row_bytes for kind in ("swa", "global_kv", "index_keys")}
    pending = {p.layer: p.unit_bytes for p in pool_specs(cfg, DEFAULT_PAGE_SIZE) if p.kind == "compressor"}
    cache: dict[str, dict[str, int]] = {}
    for layer in range(cfg.n_layers):
        role = cfg.role(layer)
        reads = dict.fromkeys(CACHE_KINDS, 0)
        reads["swa"] = min(cfg.window - 1, context) * row["swa"]
        if role != "swa":
            ratio = cfg.compress_ratios[layer]
            visible = (context + 1) // ratio
            reads["global_kv"] = min(cfg.index_topk, visible) * row["global_kv"]
            if role in ("full", "reindex"):
                scored = visible
                if cfg.uses_candidates(layer):
                    scored = min(visible, cfg.candidate_blocks * cfg.candidate_block_size)
                reads["index_keys"] = scored * row["index_keys"]
            if role == "full" and ratio > 1 and (context + 1) % ratio == 0:
                reads["compressor"] = pending[layer]
        totals = cache.setdefault(role, dict.fromkeys(CACHE_KINDS, 0))
        for kind, nbytes in reads.items():
            totals[kind] += batch * nbytes
    return DecodeReads(batch, context, experts, weights, _nbytes(model.head.weight), cache)
