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

Row formats follow the config's `quant` (docs/model.md section 6):

| quant | SWA row (K = V) | global KV row | index key row |
|---|---|---|---|
| `ref` | `swa_fp8`: 528 B at Dh = 512 | `global_fp4`: 288 B | `index_mxfp4`: 68 B at 128 dims |
| `none` | the model dtype's raw bits (fp32: 4 B per value, bf16: 2 B) | same | same |

so `decode(encode(x))` is exactly the value the plain forward uses in both modes: the fake-quant
value under `ref`, x itself under `none`.

Sizes: `pool_specs(cfg, page_size)` lists every pool once (what one slot or one page of it holds);
`KVCache.allocate` builds the pools from it and `CacheLayout.for_budget` sizes a layout from it, so
a layout's `nbytes` is what allocating it takes:

    nbytes = (slots + 1) x bytes_per_slot + (pages + 1) x bytes_per_page      (+1: the scratch)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from . import quant
from .config import ModelConfig

# Bytes per value of the raw (quant="none") row format, and the integer type of the same width
# whose bits are split into bytes: same-size views only, which every backend traces.
_RAW_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}

# Token positions per page (a multiple of every compress ratio, 1 and 2): CacheLayout.private's default
# and the runtime engine's default layout's.
DEFAULT_PAGE_SIZE = 64


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


class PoolSpec(NamedTuple):
    """One pool of the cache: its kind, the layer it serves (its own for "swa", its kv source's for
    the rest), what its first dimension counts ("slot" or "page") and the shape and dtype of one."""

    kind: str
    layer: int
    unit: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def unit_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def pool_specs(cfg: ModelConfig, page_size: int) -> list[PoolSpec]:
    """Every pool of `cfg`'s cache, swa by layer, then each kv source's (module docstring)."""
    check_page_size(cfg, page_size)
    swa_bytes = row_codec(cfg, "swa").row_bytes
    kv_bytes, key_bytes = row_codec(cfg, "global_kv").row_bytes, row_codec(cfg, "index_keys").row_bytes
    specs = [PoolSpec("swa", layer, "slot", (cfg.window, swa_bytes), torch.uint8) for layer in range(cfg.n_layers)]
    for source in cfg.kv_source_layers:
        ratio = cfg.compress_ratios[source]
        specs += [PoolSpec("global_kv", source, "page", (page_size // ratio, kv_bytes), torch.uint8),
                  PoolSpec("index_keys", source, "page", (page_size // ratio, key_bytes), torch.uint8)]
        if ratio > 1:  # (k, gate) of a group's first token while its second has not arrived
            specs.append(PoolSpec("compressor", source, "slot", (2, cfg.head_dim), torch.float32))
    return specs


def bytes_per_slot(cfg: ModelConfig) -> int:
    """What one request slot holds: its SWA ring in every layer and its compressors' pending rows."""
    return sum(p.unit_bytes for p in pool_specs(cfg, DEFAULT_PAGE_SIZE) if p.unit == "slot")


def bytes_per_page(cfg: ModelConfig, page_size: int) -> int:
    """What one page holds: `page_size` positions of every kv source's global KV and index keys."""
    return sum(p.unit_bytes for p in pool_specs(cfg, page_size) if p.unit == "page")


def check_page_size(cfg: ModelConfig, page_size: int) -> None:
    """A page holds whole compressed entries of every kv source: page_size / ratio of each."""
    ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layers})
    if not isinstance(page_size, int) or page_size < 1 or any(page_size % r for r in ratios):
        raise ValueError(f"CacheLayout.page_size={page_size!r} must be a positive multiple of every kv source's "
                         f"compress ratio ({', '.join(map(str, ratios))})")


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
    def private(cls, slots: int, tokens: int, page_size: int = DEFAULT_PAGE_SIZE) -> "CacheLayout":
        """Room for `slots` requests of up to `tokens` positions each, every one on pages of its own."""
        max_pages = -(-tokens // page_size)
        return cls(slots=slots, pages=slots * max_pages, page_size=page_size, max_pages=max_pages)

    @classmethod
    def for_budget(cls, cfg: ModelConfig, budget_bytes: int, *, slots: int, max_tokens: int,
                   page_size: int = DEFAULT_PAGE_SIZE) -> "CacheLayout":
        """The most pages `budget_bytes` holds once `slots` request slots are taken, shared by the
        requests (a page pool, as the engine runs one); one request addresses up to `max_tokens`
        positions, or the whole pool where that is less. The scratch slot and page come out of the
        budget too:

            pages = (budget - (slots + 1) x bytes_per_slot - bytes_per_page) // bytes_per_page
        """
        for name, value in (("budget_bytes", budget_bytes), ("slots", slots), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CacheLayout.for_budget: {name} must be a positive int, got {value!r}")
        per_slot, per_page = bytes_per_slot(cfg), bytes_per_page(cfg, page_size)
        fixed = (slots + 1) * per_slot + per_page
        pages = (budget_bytes - fixed) // per_page
        if pages < 1:
            raise ValueError(f"a cache budget of {budget_bytes:,} bytes holds no page of {cfg.name}: {slots} slots "
                             f"(+1 scratch) take {per_slot:,} bytes each, a page of {page_size} positions {per_page:,} "
                             f"(+1 scratch page); the smallest budget is {fixed + per_page:,} bytes")
        return cls(slots=slots, pages=pages, page_size=page_size, max_pages=min(pages, -(-max_tokens // page_size)))

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
        check_page_size(cfg, self.page_size)

    def nbytes(self, cfg: ModelConfig) -> int:
        """Bytes `KVCache.allocate(cfg, self)` takes, scratch slot and page included."""
        return (self.slots + 1) * bytes_per_slot(cfg) + (self.pages + 1) * bytes_per_page(cfg, self.page_size)


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
        units = {"slot": layout.slots + 1, "page": layout.pages + 1}  # + the scratch slot and page
        pools: dict[str, dict[int, torch.Tensor]] = {"swa": {}, "global_kv": {}, "index_keys": {}, "compressor": {}}
        for spec in pool_specs(cfg, layout.page_size):
            pools[spec.kind][spec.layer] = torch.zeros((units[spec.unit], *spec.shape), dtype=spec.dtype,
                                                       device=device)
        return cls(layout=layout, swa=list(pools["swa"].values()), global_kv=pools["global_kv"],
                   index_keys=pools["index_keys"], compressor=pools["compressor"])

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
