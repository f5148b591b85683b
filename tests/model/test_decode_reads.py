"""The bytes a decode step must read (model.stats.decode_read_bytes), against an independent count:
the parameters of the built model by name, and the row sizes of an allocated cache's pools."""

import pytest
import torch

from megafuse.model import CacheLayout, KVCache, build_model, preset
from megafuse.model.stats import CACHE_KINDS, decode_read_bytes


@pytest.fixture(scope="module")
def tiny():
    return build_model(preset("tiny"), seed=0)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _independent_weights(model, batch: int) -> dict[str, int]:
    """Every parameter and buffer by name: whole, or the rows / experts the batch reads of it."""
    cfg = model.cfg
    experts = min(cfg.n_experts, batch * cfg.n_active_experts)
    engram_rows = batch * (cfg.engram_max_ngram - 1) * cfg.engram_heads
    counted = {"dense": 0, "routed_experts": 0, "embedding_rows": 0, "engram_rows": 0, "head": 0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name == "embed.weight":
            counted["embedding_rows"] += batch * _bytes(t[0])
        elif name == "head.weight":
            counted["head"] += _bytes(t)
        elif ".moe.experts." in name:
            assert t.shape[0] == cfg.n_experts
            counted["routed_experts"] += experts * _bytes(t[0])
        elif name.endswith(".engram.table"):
            counted["engram_rows"] += engram_rows * _bytes(t[0])
        else:
            counted["dense"] += _bytes(t)
    return counted


def _independent_cache(cfg, batch: int, context: int) -> dict[str, int]:
    """Per cache kind, over the layers: rows read x the bytes of one row of the allocated pool."""
    cache = KVCache.allocate(cfg, CacheLayout.private(batch, context + 1))
    counted = dict.fromkeys(CACHE_KINDS, 0)
    for layer in range(cfg.n_layers):
        kv = cache.layer(cfg, layer)
        counted["swa"] += min(cfg.window - 1, context) * _bytes(kv.swa[0, 0])
        if cfg.role(layer) == "swa":
            continue
        ratio = cfg.compress_ratios[layer]
        visible = (context + 1) // ratio
        counted["global_kv"] += min(cfg.index_topk, visible) * _bytes(kv.global_kv[0, 0])
        if cfg.role(layer) in ("full", "reindex"):
            in_blocks = cfg.candidate_blocks * cfg.candidate_block_size if cfg.uses_candidates(layer) else visible
            counted["index_keys"] += min(visible, in_blocks) * _bytes(kv.index_keys[0, 0])
        if kv.compressor is not None and cfg.role(layer) == "full" and (context + 1) % ratio == 0:
            counted["compressor"] += _bytes(kv.compressor[0])
    return {kind: batch * n for kind, n in counted.items()}


@pytest.mark.parametrize("batch, context", [(1, 40), (2, 40), (3, 41), (32, 5)])
def test_the_decode_reads_equal_an_independent_count_of_the_model_and_its_cache(tiny, batch, context):
    reads = decode_read_bytes(tiny.cfg, batch, context)
    weights = _independent_weights(tiny, batch)
    assert {**reads.weights, "head": reads.head} == weights
    by_kind = {kind: sum(role[kind] for role in reads.cache.values()) for kind in CACHE_KINDS}
    assert by_kind == _independent_cache(tiny.cfg, batch, context)
    assert reads.total == sum(weights.values()) + sum(by_kind.values())
    assert decode_read_bytes(tiny.cfg, batch, context, tiny) == reads  # the built model counts as its meta build


def test_tiny_at_batch_2_and_context_40_reads_these_bytes(tiny):
    cfg = tiny.cfg  # fp32, quant="ref": SWA rows 66 B, global entries 36 B, index keys 17 B
    reads = decode_read_bytes(cfg, 2, 40)
    assert reads.experts_per_layer == 4  # 2 requests x top-2 of 8
    assert reads.weights == {"dense": 14_603_360, "routed_experts": 12 * 4 * 3 * 128 * 256 * 4,
                             "embedding_rows": 2 * 256 * 4, "engram_rows": 2 * 2 * (2 * 2) * 32 * 4}
    assert reads.head == 1024 * 256 * 4
    # per request: 7 ring rows in each of the 12 layers; the index keys of the 3 kv sources (ratio 2, 2
    # and 1: 20, 20 and 41 visible entries) and of layer 9 (reindex past L/2: 4 blocks x 2 entries);
    # 6 top-k entries in each of the 10 layers of ratio > 0
    assert reads.cache == {
        "swa": {"swa": 2 * 2 * 7 * 66, "index_keys": 0, "global_kv": 0, "compressor": 0},
        "full": {"swa": 2 * 3 * 7 * 66, "index_keys": 2 * (20 + 20 + 41) * 17, "global_kv": 2 * 3 * 6 * 36,
                 "compressor": 0},
        "reuse": {"swa": 2 * 6 * 7 * 66, "index_keys": 0, "global_kv": 2 * 6 * 6 * 36, "compressor": 0},
        "reindex": {"swa": 2 * 1 * 7 * 66, "index_keys": 2 * 8 * 17, "global_kv": 2 * 1 * 6 * 36, "compressor": 0}}
    assert reads.total == 14_603_360 + 9_437_184 * 2 + 2048 + 2048 + 1_048_576 + 18_434


def test_routed_experts_read_are_k_at_batch_1_and_at_most_every_expert():
    cfg = preset("tiny")
    assert [decode_read_bytes(cfg, b, 8).experts_per_layer for b in (1, 2, 3, 4, 64)] == [2, 4, 6, 8, 8]
    # at position 0 the ratio-2 sources have no entry yet and the top-k reads what is visible; the pending row is read
    # only when the new token closes a group (position 1)
    assert decode_read_bytes(cfg, 1, 0).cache["full"]["global_kv"] == 36  # the ratio-1 source's one entry
    assert decode_read_bytes(cfg, 1, 1).cache["full"]["compressor"] == 2 * 2 * 64 * 4
    assert decode_read_bytes(cfg, 1, 2).cache["full"]["compressor"] == 0
    with pytest.raises(ValueError, match="batch must be >= 1"):
        decode_read_bytes(cfg, 0, 8)
