"""The decode cache in its storage formats: byte rows in SWA rings and paged global pools.

One cache serves the eager tests, `megafuse run` and the serving runtime. It holds bytes, never
dense values: the model encodes every row it writes and decodes every row it reads with plain
torch ops (index, scatter, bit manipulation), so `torch.compile` traces both and a fused attention
kernel can later take the decode in.

    swa[layer]         [slots + 1, W, swa bytes]          a ring of W rows per request slot; the row
                                                          of position p lives at slot p mod W
    global_kv[src]     [pages + 1, page_size / ratio, kv bytes]   compressed global KV of kv source `src`
    index_keys[src]    [pages + 1, page_size / ratio, key bytes]  the indexer keys of the same entries
    compressor[src]    [slots + 1, 2, head_dim] fp32      (k, gate) of a ratio-2 group's first token
                                                          while its second has not arrived

A page is a block of `page_size` token positions, the same block in every kv source's pools: page
k of a request holds the entries of its tokens [k * page_size, (k + 1) * page_size), that is
`page_size / ratio` entries of a source compressing `ratio` tokens into one. So entry e of a source
lives in page `page_table[slot, e // (page_size / ratio)]` at offset `e % (page_size / ratio)`, and
a prefix of whole pages is a prefix of every source at once (what the prefix cache shares). The
page table travels with each step (`model.batch.StepBatch`), pages are handed out by whoever drives
the model (a test, `megafuse run`, the runtime's page pool), and a page may be shared by several
requests (a prefix hit) as long as none of them writes it. The last slot and the last page
are scratch: padding rows and rows that must not write (replayed tokens) write there, so every
step scatters with fixed shapes and no data-dependent branch.

Row formats follow the config's `quant` (MODEL.md section 6):

| quant | SWA row (K = V) | global KV row | index key row |
|---|---|---|---|
| `ref` | `swa_fp8`: 528 B at Dh = 512 | `global_fp4`: 288 B | `index_mxfp4`: 68 B at 128 dims |
| `none` | the model dtype's raw bits (fp32: 4 B per value, bf16: 2 B) | same | same |

so `decode(encode(x))` is exactly the value the plain forward uses in both modes: the fake-quant
value under `ref`, x itself under `none`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import quant
from .config import ModelConfig

# Bytes per value of the raw (quant="none") row format, and the integer type of the same width
# whose bits are split into bytes: same-size views only, which every backend traces.
_RAW_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


@dataclass(frozen=True)
class RowCodec:
    """One cache row format: `encode(x [..., dim]) -> uint8 [..., row_bytes]` and back."""

    name: str
    row_bytes: int
    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def _raw_codec(dim: int, dtype: torch.dtype) -> RowCodec:
    """Rows of `dtype` values stored bit for bit, little-endian, as `dim * itemsize` bytes."""
    int_type, bits = _RAW_INT[dtype], torch.finfo(dtype).bits
    width = bits // 8
    # Every intermediate stays in [0, 2^bits) of an integer type twice as wide, so no backend sees a
    # signed overflow (int32 for bf16's 16 bits, int64 for fp32's 32).
    wide = torch.int32 if bits == 16 else torch.int64

    def shifts(device: torch.device) -> torch.Tensor:
        # made on the device at each call: a CPU constant would be a host-to-device copy, which
        # a CUDA graph cannot capture
        return torch.arange(0, bits, 8, dtype=wide, device=device)

    def encode(x: torch.Tensor) -> torch.Tensor:
        unsigned = x.to(dtype).view(int_type).to(wide) & ((1 << bits) - 1)
        parts = (unsigned[..., None] >> shifts(x.device)) & 0xFF  # [..., dim, width], low byte first
        return parts.to(torch.uint8).flatten(-2)

    def decode(b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        unsigned = (b.unflatten(-1, (dim, width)).to(wide) << shifts(b.device)).sum(-1, dtype=wide)
        signed = torch.where(unsigned >= 1 << (bits - 1), unsigned - (1 << bits), unsigned)
        return signed.to(int_type).view(dtype).to(out_dtype)

    return RowCodec(f"raw {dtype}".replace("torch.", ""), dim * width, encode, decode)


def _quant_codec(format_name: str, dim: int) -> RowCodec:
    encode = getattr(quant, f"encode_{format_name}")
    decode = getattr(quant, f"decode_{format_name}")
    return RowCodec(format_name, quant.row_bytes(format_name, dim), encode, lambda b, dtype: decode(b, dtype))


def row_codec(cfg: ModelConfig, kind: str) -> RowCodec:
    """The codec of one cache kind ("swa", "global_kv" or "index_keys") under cfg.quant / cfg.dtype."""
    dims = {"swa": ("swa_fp8", cfg.head_dim), "global_kv": ("global_fp4", cfg.head_dim),
            "index_keys": ("index_mxfp4", cfg.index_head_dim)}
    if kind not in dims:
        raise ValueError(f"unknown cache kind {kind!r}; valid kinds: {', '.join(dims)}")
    format_name, dim = dims[kind]
    if cfg.quant == "ref":
        return _quant_codec(format_name, dim)
    return _raw_codec(dim, getattr(torch, cfg.dtype))


@dataclass(frozen=True)
class CacheLayout:
    """How much a cache holds: request slots, pages per pool, entries per page, page-table width."""

    slots: int
    pages: int
    page_size: int  # token positions per page (a multiple of every compress ratio)
    max_pages: int  # pages one request can address: at most max_pages * page_size tokens

    def __post_init__(self):
        for name in ("slots", "pages", "page_size", "max_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def private(cls, slots: int, tokens: int, page_size: int = 64) -> "CacheLayout":
        """Room for `slots` requests of up to `tokens` positions each, every one on pages of its own."""
        max_pages = -(-tokens // page_size)
        return cls(slots=slots, pages=slots * max_pages, page_size=page_size, max_pages=max_pages)

    @property
    def scratch_slot(self) -> int:
        return self.slots

    @property
    def scratch_page(self) -> int:
        return self.pages

    @property
    def max_tokens(self) -> int:
        """The longest sequence one request can hold."""
        return self.max_pages * self.page_size

    def check(self, cfg: ModelConfig) -> None:
        ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layers})
        if any(self.page_size % r for r in ratios):
            raise ValueError(f"CacheLayout.page_size={self.page_size} must be a multiple of every kv source's "
                             f"compress ratio ({', '.join(map(str, ratios))})")


class LayerCache(NamedTuple):
    """The pools one layer's step reads and writes: its SWA ring and its kv source's global KV,
    index keys and compressor state (None where it has none). A layer's step takes these tensors,
    never the layer's index, so every layer of one kind runs one compiled graph."""

    swa: torch.Tensor
    global_kv: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    compressor: torch.Tensor | None = None


@dataclass
class KVCache:
    """Byte pools of one model; see the module docstring for the layout."""

    layout: CacheLayout
    swa: list[torch.Tensor]
    global_kv: dict[int, torch.Tensor]
    index_keys: dict[int, torch.Tensor]
    compressor: dict[int, torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelConfig, layout: CacheLayout, device: str | torch.device = "cpu") -> "KVCache":
        """Zeroed pools (zero bytes decode to 0.0 in every format)."""
        layout.check(cfg)
        swa_bytes = row_codec(cfg, "swa").row_bytes
        kv_bytes, key_bytes = row_codec(cfg, "global_kv").row_bytes, row_codec(cfg, "index_keys").row_bytes
        slots, pages = layout.slots + 1, layout.pages + 1

        def zeros(*shape, dtype=torch.uint8):
            return torch.zeros(shape, dtype=dtype, device=device)

        sources = cfg.kv_source_layers
        return cls(
            layout=layout,
            swa=[zeros(slots, cfg.window, swa_bytes) for _ in range(cfg.n_layers)],
            global_kv={s: zeros(pages, layout.page_size // cfg.compress_ratios[s], kv_bytes) for s in sources},
            index_keys={s: zeros(pages, layout.page_size // cfg.compress_ratios[s], key_bytes) for s in sources},
            compressor={s: zeros(slots, 2, cfg.head_dim, dtype=torch.float32)
                        for s in sources if cfg.compress_ratios[s] > 1},
        )

    def layer(self, cfg: ModelConfig, layer: int) -> LayerCache:
        """The pools layer `layer` of `cfg` reads and writes."""
        source = cfg.kv_source(layer)
        return LayerCache(self.swa[layer], self.global_kv.get(source), self.index_keys.get(source),
                          self.compressor.get(source))

    def clear(self) -> None:
        """Zero every pool in place (a cache reused by a new engine: captured graphs keep its addresses)."""
        for t in [*self.swa, *self.global_kv.values(), *self.index_keys.values(), *self.compressor.values()]:
            t.zero_()

    def nbytes(self) -> dict[str, int]:
        """Bytes held per kind (scratch slot and page included)."""
        def total(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        return {"swa": total(self.swa), "global_kv": total(self.global_kv.values()),
                "index_keys": total(self.index_keys.values()), "compressor": total(self.compressor.values())}

    def page_bytes(self, page: int) -> bytes:
        """Every pool's bytes of one page, concatenated (for read-only checks: hash before and after)."""
        parts = [self.global_kv[s][page] for s in sorted(self.global_kv)]
        parts += [self.index_keys[s][page] for s in sorted(self.index_keys)]
        return b"".join(p.contiguous().cpu().numpy().tobytes() for p in parts)
