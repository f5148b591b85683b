"""The cache's row codecs: quant="none" rows keep every bit; quant="ref" rows are the quant module's."""

import pytest
import torch

from megafuse.model import CacheLayout, KVCache, preset
from megafuse.model.cache import row_codec


def test_raw_bf16_rows_keep_every_one_of_the_65536_bit_patterns():
    codec = row_codec(preset("tiny").replace(quant="none", dtype="bfloat16"), "swa")  # 64 values a row
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = patterns.view(torch.bfloat16).reshape(-1, 64)
    b = codec.encode(x)
    assert b.dtype == torch.uint8 and b.shape == (1024, 128) and codec.row_bytes == 128
    assert torch.equal(codec.decode(b, torch.bfloat16).view(torch.int16), x.view(torch.int16))
    # little-endian: the low byte first
    assert b[0, 0].item() == (patterns[0].item() & 0xFF)


def test_raw_fp32_rows_keep_random_bit_patterns():
    codec = row_codec(preset("tiny").replace(quant="none", dtype="float32"), "index_keys")  # 32 values
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (200, 32), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    assert torch.equal(codec.decode(codec.encode(x), torch.float32).view(torch.int32), bits)


def test_reference_rows_use_the_quant_formats_and_sizes():
    cfg = preset("tiny")  # quant ref, head_dim 64, index_head_dim 32
    assert {k: (row_codec(cfg, k).name, row_codec(cfg, k).row_bytes) for k in ("swa", "global_kv", "index_keys")} == {
        "swa": ("swa_fp8", 66), "global_kv": ("global_fp4", 36), "index_keys": ("index_mxfp4", 17)}
    flash = preset("flash")
    assert [row_codec(flash, k).row_bytes for k in ("swa", "global_kv", "index_keys")] == [528, 288, 68]
    with pytest.raises(ValueError, match="valid kinds: swa, global_kv, index_keys"):
        row_codec(cfg, "kv")


def test_a_page_holds_page_size_over_ratio_entries_of_each_source():
    cfg = preset("tiny")  # kv sources 2, 4 (ratio 2) and 6 (ratio 1)
    cache = KVCache.allocate(cfg, CacheLayout(slots=3, pages=5, page_size=8, max_pages=2))
    assert {s: tuple(p.shape) for s, p in cache.global_kv.items()} == {2: (6, 4, 36), 4: (6, 4, 36), 6: (6, 8, 36)}
    assert len(cache.swa) == cfg.n_layers and cache.swa[0].shape == (4, cfg.window, 66)
    assert set(cache.compressor) == {2, 4} and cache.compressor[2].shape == (4, 2, cfg.head_dim)
    with pytest.raises(ValueError, match="positive int"):
        CacheLayout(slots=0, pages=1, page_size=2, max_pages=1)


def test_a_private_layout_gives_each_slot_the_pages_its_tokens_need():
    layout = CacheLayout.private(slots=3, tokens=130, page_size=64)
    assert (layout.slots, layout.pages, layout.page_size, layout.max_pages, layout.max_tokens) == (3, 9, 64, 3, 192)
