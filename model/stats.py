"""Sizes of a configuration: parameters, activated parameters per token, cache bytes.

Counts come from the module built on the meta device, so they always agree with the model.
"""

from __future__ import annotations

from . import quant
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
