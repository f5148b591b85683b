"""The batched step's input: a flat token batch mixing prefill chunks and decodes of many requests.

A step runs N rows, the tokens of several requests laid end to end (each request's rows contiguous
and in position order, no padding between requests); rows past the last request are padding up to
the bucket size, write only the cache's scratch slot and page, and are never attended. The step
runs in two regions (docs/model.md Decision 2):

    encoder region   layers 0 .. L/2 on every row (layer L/2 writes the decoder's global KV)
    decoder region   layers > L/2 and the head on the decoder rows only: all rows, or only the last
                     W rows of a final prefill chunk (the trim), or none for a non-final chunk

`StepBatch` holds one `Rows` per region plus the gather that takes the encoder's output rows to
the decoder's. Each field is a tensor, so one compiled graph (and one CUDA graph) serves every step
of the same bucket sizes. `build_step` makes a StepBatch from `Chunk`s; `Sequence` is the small
per-request bookkeeping the tests and `megafuse run` use to drive the model (the runtime's planner
does the same with a page pool and a prefix cache).

Visibility (docs/model.md sections 4 and 8): a row at position p sees the SWA rows of positions
`max(swa_floor, p - W + 1) .. p`; in the encoder region `swa_floor` is the replay start (tokens
before it were not recomputed, so their SWA rows do not exist), in the decoder region the first
position the decoder layers ran on. Rows below `cached` are replayed: their global KV, index keys
and compressor entries are already in the request's pages, which they read and never write.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence as Seq

import torch

from .cache import CacheLayout, KVCache
from .config import ModelConfig

DECODER_MODES = ("all", "tail", "none")


@dataclass
class Rows:
    """Per-row metadata of one region's rows (all tensors [R] on the model's device)."""

    ids: torch.Tensor  # int64 token id
    positions: torch.Tensor  # int64 absolute position
    slots: torch.Tensor  # int64 request slot of the cache (padding: the scratch slot)
    chunk_start: torch.Tensor  # int64 position of the request's first row in this region
    chunk_end: torch.Tensor  # int64 one past the position of the request's last row in this step
    swa_floor: torch.Tensor  # int64 the lowest position whose SWA row this row may see
    writes_global: torch.Tensor  # bool: writes global KV, index keys, compressor entries
    ngram_ids: torch.Tensor  # int64 [R, K + 1] ids at p-K .. p for Engram, -1 before position 0

    def __len__(self) -> int:
        return self.ids.shape[0]


@dataclass
class StepBatch:
    rows: Rows  # every row: the encoder region
    decoder: Rows  # the decoder rows (layers > L/2 and the head)
    decoder_index: torch.Tensor  # int64 [M]: which encoder row each decoder row continues
    page_table: torch.Tensor  # int64 [slots + 1, max_pages]; unused entries: the scratch page
    n_real: int = field(default=0, compare=False)  # rows that are not padding (host bookkeeping)
    n_real_decoder: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Chunk:
    """One request's rows in a step: the tokens at positions [start, start + len(ids))."""

    slot: int
    start: int
    ids: Seq[int]
    history: Seq[int] = ()  # the ids just before `start`, oldest first (the last K are used)
    replay_start: int = 0  # encoder SWA floor: the first position recomputed after a prefix hit
    cached: int = 0  # positions below this already have global KV in the request's pages
    decoder: str = "all"  # "all", "tail" (the last W rows: the trim) or "none" (non-final chunk)
    decoder_floor: int = 0  # decoder SWA floor for decoder="all" (a "tail" chunk sets its own)

    def decoder_positions(self, window: int) -> range:
        end = self.start + len(self.ids)
        if self.decoder == "all":
            return range(self.start, end)
        if self.decoder == "tail":
            return range(max(self.start, end - window), end)
        return range(0)


def _check(cfg: ModelConfig, layout: CacheLayout, chunks: Seq[Chunk]) -> None:
    seen = set()
    for i, c in enumerate(chunks):
        where = f"chunk {i} (slot {c.slot})"
        if not 0 <= c.slot < layout.slots:
            raise ValueError(f"{where}: slot must lie in 0..{layout.slots - 1}")
        if c.slot in seen:
            raise ValueError(f"{where}: two chunks of one step share a slot")
        seen.add(c.slot)
        if len(c.ids) == 0:
            raise ValueError(f"{where}: a chunk needs at least one token")
        bad = [t for t in c.ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids {bad[:5]} lie outside 0..{cfg.vocab_size - 1}")
        if c.decoder not in DECODER_MODES:
            raise ValueError(f"{where}: decoder={c.decoder!r}; valid: {', '.join(DECODER_MODES)}")
        if not 0 <= c.replay_start <= c.start:
            raise ValueError(f"{where}: replay_start {c.replay_start} must lie in 0..start={c.start}")
        if c.cached < 0:
            raise ValueError(f"{where}: cached must be >= 0, got {c.cached}")
        need = min(c.start, cfg.engram_max_ngram - 1)
        if len(c.history) < need:
            raise ValueError(f"{where}: history holds {len(c.history)} ids; Engram needs the {need} before start")
        end = c.start + len(c.ids)
        if end > layout.max_tokens:
            raise ValueError(f"{where}: position {end - 1} is past what {layout.max_pages} pages of "
                             f"{layout.page_size} tokens hold ({layout.max_tokens} tokens)")


def build_step(cfg: ModelConfig, layout: CacheLayout, chunks: Seq[Chunk], page_table: torch.Tensor,
               rows: int | None = None, decoder_rows: int | None = None,
               device: str | torch.device = "cpu") -> StepBatch:
    """The StepBatch of `chunks`, padded to `rows` / `decoder_rows` (default: no padding)."""
    layout.check(cfg)
    _check(cfg, layout, chunks)
    W, K = cfg.window, cfg.engram_max_ngram - 1
    expected = (layout.slots + 1, layout.max_pages)
    if tuple(page_table.shape) != expected:
        raise ValueError(f"page_table has shape {tuple(page_table.shape)}; this layout needs {expected}")
    enc: dict[str, list] = {f.name: [] for f in fields(Rows)}
    dec: dict[str, list] = {f.name: [] for f in fields(Rows)}
    decoder_index: list[int] = []
    for c in chunks:
        end = c.start + len(c.ids)
        context = list(c.history)[-K:] if K else []
        context = [-1] * (K - len(context)) + context + list(c.ids)  # positions start-K .. end-1
        tail = c.decoder_positions(W)
        decoder_floor = tail.start if c.decoder == "tail" else c.decoder_floor
        for j, token in enumerate(c.ids):
            p = c.start + j
            row = dict(ids=token, positions=p, slots=c.slot, chunk_end=end,
                       writes_global=p >= c.cached, ngram_ids=context[j: j + K + 1])
            enc_row = len(enc["ids"])
            for name, value in row.items():
                enc[name].append(value)
            enc["chunk_start"].append(c.start)
            enc["swa_floor"].append(c.replay_start)
            if p in tail:
                decoder_index.append(enc_row)
                for name, value in row.items():
                    dec[name].append(value)
                dec["chunk_start"].append(tail.start)
                dec["swa_floor"].append(max(decoder_floor, c.replay_start))
    n_real, m_real = len(enc["ids"]), len(decoder_index)
    rows = n_real if rows is None else rows
    decoder_rows = m_real if decoder_rows is None else decoder_rows
    if rows < n_real or decoder_rows < m_real:
        raise ValueError(f"the step has {n_real} rows ({m_real} through the decoder); the bucket holds "
                         f"{rows} ({decoder_rows})")
    if decoder_rows > rows:
        raise ValueError(f"decoder_rows={decoder_rows} exceeds rows={rows}")
    # Padding: a one-token request at position 0 in the scratch slot (it sees only itself).
    pad = dict(ids=0, positions=0, slots=layout.scratch_slot, chunk_start=0, chunk_end=1, swa_floor=0,
               writes_global=False, ngram_ids=[-1] * K + [0])
    for table, size in ((enc, rows), (dec, decoder_rows)):
        for name, value in pad.items():
            table[name].extend([value] * (size - len(table[name])))
    decoder_index += [rows - 1 if rows > n_real else 0] * (decoder_rows - m_real)

    def tensors(table):
        def tensor(name, values):
            dtype = torch.bool if name == "writes_global" else torch.int64
            return torch.tensor(values, dtype=dtype, device=device).reshape(len(values), *([K + 1] if name == "ngram_ids" else []))
        return Rows(**{name: tensor(name, values) for name, values in table.items()})

    return StepBatch(tensors(enc), tensors(dec), torch.tensor(decoder_index, dtype=torch.int64, device=device),
                     page_table.to(device), n_real, m_real)


@dataclass
class Sequence:
    """One request's bookkeeping for driving the step by hand: tokens, progress, pages, floors.

    `chunk(n)` hands out the next n tokens as a Chunk and advances. Pages are the caller's: assign
    `pages` (tokens [k * page_size, (k + 1) * page_size) live in pages[k]) before the first chunk.
    """

    slot: int
    tokens: list[int]
    window: int
    pages: list[int] = field(default_factory=list)
    done: int = 0  # positions already run
    prefilled: bool = False  # a final chunk ran: later chunks are decodes
    cached: int = 0  # positions whose global KV was in the pages before this request ran
    replay_start: int = 0
    decoder_floor: int = 0

    def resume_from_cache(self, hit: int, replay: int) -> None:
        """A prefix hit: pages hold the global KV of positions < hit; recompute the last `replay`."""
        if not 0 <= hit <= len(self.tokens) or self.done:
            raise ValueError(f"a hit of {hit} tokens needs a fresh sequence of at least {hit} tokens")
        self.cached, self.replay_start = hit, hit - min(replay, hit)
        self.done = self.decoder_floor = self.replay_start

    def chunk(self, n: int, final: bool, trim: bool) -> Chunk:
        """The next n tokens; `final` ends the prefill (decodes are final one-token chunks)."""
        if n < 1 or self.done + n > len(self.tokens):
            raise ValueError(f"cannot take {n} tokens: {len(self.tokens) - self.done} are not yet run")
        if self.prefilled:  # a decode continues the decoder rows its prefill left
            decoder = "all"
        else:
            decoder = ("tail" if trim else "all") if final else ("none" if trim else "all")
        c = Chunk(self.slot, self.done, self.tokens[self.done: self.done + n], self.tokens[: self.done],
                  self.replay_start, self.cached, decoder, self.decoder_floor)
        self.done += n
        self.prefilled = self.prefilled or final
        if decoder == "tail":
            self.decoder_floor = c.decoder_positions(self.window).start
        return c


def page_table(layout: CacheLayout, sequences: Seq[Sequence]) -> torch.Tensor:
    """[slots + 1, max_pages] with each sequence's pages and the scratch page everywhere else."""
    table = torch.full((layout.slots + 1, layout.max_pages), layout.scratch_page, dtype=torch.int64)
    for s in sequences:
        if len(s.pages) > layout.max_pages:
            raise ValueError(f"slot {s.slot}: {len(s.pages)} pages exceed the table's {layout.max_pages}")
        table[s.slot, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int64)
    return table


class SequenceGroup:
    """Sequences in slots 0.. of one cache, each with private pages, stepped together by hand.

    The smallest driver of the batched step (the tests and `megafuse run` use it; the runtime's
    planner does the same with a page pool, a scheduler and a prefix cache). `step(run, plan)` runs
    one step through `run(batch, cache)` (the model's `step`, or compiled regions) and returns each
    planned sequence's logits, [its decoder rows, vocab], in plan order.
    """

    def __init__(self, cfg: ModelConfig, layout: CacheLayout, prompts: Seq[Seq[int]],
                 device: str | torch.device = "cpu"):
        if len(prompts) > layout.slots or len(prompts) * layout.max_pages > layout.pages:
            raise ValueError(f"{len(prompts)} sequences need {len(prompts)} slots and "
                             f"{len(prompts) * layout.max_pages} pages; the layout has {layout.slots} and {layout.pages}")
        self.cfg, self.layout, self.device = cfg, layout, device
        self.cache = KVCache.allocate(cfg, layout, device)
        self.sequences = [Sequence(i, list(p), cfg.window, pages=list(range(i * layout.max_pages, (i + 1) * layout.max_pages)))
                          for i, p in enumerate(prompts)]

    def step(self, run, plan: Seq[tuple[int, int, bool]], trim: bool = False, rows: int | None = None,
             decoder_rows: int | None = None) -> tuple[StepBatch, list[torch.Tensor]]:
        """plan: (sequence index, tokens, final) per request of this step."""
        chunks = [self.sequences[i].chunk(n, final, trim) for i, n, final in plan]
        batch = build_step(self.cfg, self.layout, chunks, page_table(self.layout, self.sequences), rows,
                           decoder_rows, self.device)
        logits = run(batch, self.cache)
        sizes = [len(c.decoder_positions(self.cfg.window)) for c in chunks]
        return batch, list(torch.split(logits[: sum(sizes)], sizes))
