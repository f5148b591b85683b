"""CSA2 attention: sliding window + compressed global KV chosen by a lightning indexer (docs/model.md section 4).

One layer, for the T new tokens at absolute `positions` (u = normalised sublayer input [B, T, D]):

    qr = q_norm(wq_a u)            q = RoPE(wq_b qr)                         [B, T, H, Dh]
    kv = FP8(RoPE(kv_norm(wkv u)))  this layer's SWA row (K = V)              [B, T, Dh]
    full:     compressor -> latent -> global entry FP4(RoPE(latent)) and index key MXFP4(RoPE(k_norm(wk latent)))
    full / reindex: indexer scores over the owner's index keys -> top-k entry ids (ascending, -1 = none)
    keys = [the query's window of SWA rows | the top-k global entries of its kv source]
    o    = softmax-with-sink(q . keys * Dh^-0.5) @ keys;  o = MXFP8(RoPE^-1(o));  out = wo_b(wo_a_grouped(o))

Two entry points share every piece of that maths:

- `forward(u [B, T, D], positions, shared)`: a one-shot prefill from position 0 of B equal-length
  sequences, with no cache. Global entries and index keys go to `shared[layer]` for later layers.
  This is the plain model the tests take as the reference.
- `step(u [1, N, D], rows, page_table, kv, selection)`: the rows of a flat batch mixing requests
  (`model/batch.py`), reading and writing the layer's pools of the byte cache (`model/cache.py`).
  The SWA window comes from the step's own rows and the request's ring; global entries and index
  keys are written to and read from the request's pages. Only the top-k and candidate blocks travel
  between layers: the step reads them as a `Selection` and returns what it publishes. It never reads
  the layer's index, so the layers of one kind trace to one graph.

In both, a layer reads the entries of `cfg.kv_source(i)` and the top-k of `cfg.topk_source(i)`.

Top-k selections here break ties toward the lowest index (a stable sort), so a prefill and an
incremental decode of the same tokens choose the same entries even where scores tie exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import quant
from .batch import Rows
from .cache import LayerCache, row_codec
from .config import ModelConfig
from .layers import RMSNorm, linear, weight
from .rope import apply_rope, rope_angles, rope_frequencies

NEG_INF = float("-inf")


class Selection(NamedTuple):
    """What a layer's step reads of earlier layers' indexers: the top-k of its top-k source [1, R, k]
    (None where the layer selects its own) and the candidate source's blocks (for the layers that
    score inside them, else None)."""

    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


def topk_lowest_index(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest along the last dim; ties go to the lowest index."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def pad_last(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """Append `width` columns of `value`, so a fixed-k top-k is defined for any row length."""
    return torch.cat((x, x.new_full((*x.shape[:-1], width), value)), dim=-1)


def visible_entries(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """[T, N] bool: entry j (covering tokens j*ratio ..) is visible at position p iff j < (p+1)//ratio."""
    entry = torch.arange(n_entries, device=positions.device)
    return entry[None, :] < torch.div(positions[:, None] + 1, ratio, rounding_mode="floor")


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k entry ids of scores [B, T, N] (-inf = not selectable), sorted ascending, -1 padded."""
    values, idx = topk_lowest_index(pad_last(scores, k, NEG_INF), k)
    valid = values > NEG_INF
    beyond = scores.shape[-1] + k  # sorts after every real id
    idx = torch.sort(torch.where(valid, idx, beyond), dim=-1).values
    return torch.where(idx == beyond, -1, idx)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """I[b, t, n] = sum_h w[b,t,h] relu(q[b,t,h] . k_n) in fp32, -inf where not visible: q [B, T, H, d],
    w [B, T, H] fp32, keys [B, N, d] shared by a sequence's queries or [B, T, N, d] per query."""
    per_query = "btnd" if keys.dim() == 4 else "bnd"
    logits = torch.relu(torch.einsum(f"bthd,{per_query}->bthn", q.float(), keys.float()))
    scores = torch.einsum("bth,bthn->btn", w, logits)
    return scores.masked_fill(~visible, NEG_INF)


def candidate_mask(scores: torch.Tensor, positions: torch.Tensor, ratio: int, n_blocks_kept: int,
                   block_size: int) -> torch.Tensor:
    """Two-level selection of the candidate source: [B, T, N] bool of the entries in kept blocks.

    Blocks of `block_size` entries score their max; the block holding the query's newest visible
    entry is pinned to +inf; the top `n_blocks_kept` blocks are kept, dropping -inf picks.
    """
    B, T, N = scores.shape
    n_blocks = -(-N // block_size)
    padded = pad_last(scores, n_blocks * block_size - N, NEG_INF)
    block_score = padded.unflatten(-1, (n_blocks, block_size)).amax(dim=-1)
    newest = torch.div(positions + 1, ratio, rounding_mode="floor") - 1
    pinned = torch.arange(n_blocks, device=scores.device)[None, :] == torch.div(newest, block_size, rounding_mode="floor")[:, None]
    block_score = torch.where(pinned, float("inf"), block_score)
    values, blocks = topk_lowest_index(pad_last(block_score, n_blocks_kept, NEG_INF), n_blocks_kept)
    kept = torch.zeros(B, T, n_blocks + n_blocks_kept, dtype=torch.bool, device=scores.device)
    kept = kept.scatter(-1, blocks, values > NEG_INF)
    return kept[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :N]


def sparse_attention_with_sink(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                               sink: torch.Tensor, scale: float) -> torch.Tensor:
    """o[b,t,h] = sum_j e^(s_j - m) K_j / (sum_j e^(s_j - m) + e^(sink_h - m)), K = V, in fp32.

    q [B, T, H, Dh], keys [B, T, J, Dh] (each query's own key rows), valid [B, T, J] bool,
    sink [H]. The max includes the sink, so a query with no valid key gets exactly 0.
    """
    keys = keys.float()
    s = torch.einsum("bthd,btjd->bthj", q.float(), keys) * scale
    s = s.masked_fill(~valid[:, :, None, :], NEG_INF)
    sink = sink.float()[None, None, :, None]
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sink - m)
    return torch.einsum("bthj,btjd->bthd", p / denom, keys)


def gather_entries(pool: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor,
                   entries: torch.Tensor) -> torch.Tensor:
    """Byte rows of entries [R, k] (ids >= 0) of each row's request: [R, k, row bytes].
    A page holds pool.shape[1] entries of this pool's source (model/cache.py)."""
    per_page = pool.shape[1]
    pages = page_table[slots[:, None], torch.div(entries, per_page, rounding_mode="floor")]
    return pool[pages, entries.remainder(per_page)]


def write_entries(pool: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor,
                  write: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[page of entry, offset] = rows where `write`, else into the scratch page (the last)."""
    per_page = pool.shape[1]
    pages = page_table[slots, torch.div(entries, per_page, rounding_mode="floor")]
    pool.index_put_((torch.where(write, pages, pool.shape[0] - 1), torch.where(write, entries.remainder(per_page), 0)),
                    rows)


class Compressor(nn.Module):
    """Global-KV compressor of a kv source: one latent per `ratio` tokens (pre-RoPE, normalised).

    ratio 1: latent_t = norm(wkv u_t).
    ratio 2: latent_j = norm(sum_{i in {2j, 2j+1}} softmax_i(wgate u_i) * (wkv u_i)), the softmax
    over the group's 2 tokens per channel; wkv and wgate are fp32 weights and both projections run
    in fp32 (docs/model.md section 4).
    """

    def __init__(self, cfg: ModelConfig, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        # ratio 1 projects with an FP8 GEMM; ratio 2 in fp32
        self.wkv = linear(cfg.dim, cfg.head_dim, dtype if ratio == 1 else torch.float32, ratio == 1 and cfg.quant == "ref")
        self.wgate = linear(cfg.dim, cfg.head_dim, torch.float32) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def _key_gate(self, u: torch.Tensor) -> torch.Tensor:
        """[..., 2, Dh] fp32 (k, gate) per token; (.float() on the weights: a model cast with
        .to(bf16) still projects in fp32, exactly widened)."""
        x = u.float()
        return torch.stack((F.linear(x, self.wkv.weight.float()), F.linear(x, self.wgate.weight.float())), dim=-2)

    def _combine(self, groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """groups [..., r, 2, Dh] (tokens of a group, oldest first) -> normalised latents [..., Dh]."""
        k, g = groups[..., 0, :], groups[..., 1, :]
        return self.norm((torch.softmax(g, dim=-2) * k).sum(dim=-2).to(dtype))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """Latents [B, G, Dh] of the complete groups of u [B, T, D] (a trailing half group waits)."""
        if self.ratio == 1:
            return self.norm(self.wkv(u))
        kg = self._key_gate(u)
        n_groups = kg.shape[1] // self.ratio
        return self._combine(kg[:, : n_groups * self.ratio].unflatten(1, (n_groups, self.ratio)), u.dtype)

    def step(self, u: torch.Tensor, rows: Rows, state: torch.Tensor | None) -> torch.Tensor:
        """Per-row latents [R, Dh] of u [R, D]: row r's latent is its group's when it completes one.

        Ratio 2: a row at odd position p pairs with p - 1, from this step when that row is here,
        else from `state` (the half group the request's previous step left). A request whose last
        row here opens a group leaves it in `state` (other rows write the scratch slot).
        """
        if self.ratio == 1:
            return self.norm(self.wkv(u))
        kg = self._key_gate(u)  # [R, 2, Dh]
        previous_here = (rows.positions - 1 >= rows.chunk_start)[:, None, None]
        previous = torch.where(previous_here, kg.roll(1, dims=0), state[rows.slots])
        opens = (rows.positions % 2 == 0) & (rows.positions == rows.chunk_end - 1)
        state.index_put_((torch.where(opens, rows.slots, state.shape[0] - 1),), kg)
        return self._combine(torch.stack((previous, kg), dim=1), u.dtype)


class Indexer(nn.Module):
    """Lightning indexer: I[t, j] = sum_h w[t,h] relu(q_idx[t,h] . k_j), over visible entries j.

    Owners (kv sources) also hold the key projection `wk` + `k_norm`; reindex layers score
    against their owner's keys.
    """

    def __init__(self, cfg: ModelConfig, owns_keys: bool, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim, self.quant = cfg.index_heads, cfg.index_head_dim, cfg.quant
        fp8 = cfg.quant == "ref"
        self.wq = linear(cfg.q_lora_rank, cfg.index_heads * cfg.index_head_dim, dtype, fp8)
        self.weights_proj = linear(cfg.dim, cfg.index_heads, dtype)  # a bf16 GEMM in the released model
        self.wk = linear(cfg.head_dim, cfg.index_head_dim, dtype, fp8) if owns_keys else None
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps) if owns_keys else None

    def _fp4(self, x: torch.Tensor) -> torch.Tensor:
        return quant.fake_quant_index_mxfp4(x) if self.quant == "ref" else x

    def key_values(self, latents: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Index keys before their MXFP4 rounding (what the cache encodes)."""
        return apply_rope(self.k_norm(self.wk(latents)), angles)

    def keys(self, latents: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        return self._fp4(self.key_values(latents, angles))

    def scores(self, u: torch.Tensor, qr: torch.Tensor, angles: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """[B, T, N] scores of queries (u, qr) [B, T, ..] against keys [B, N, d] shared by a
        sequence's queries, or [B, T, N, d] per query (a step's rows of different requests)."""
        q = self.wq(qr).unflatten(-1, (self.heads, self.head_dim))
        q = self._fp4(apply_rope(q, angles[:, :, None, :]))
        w = self.weights_proj(u).float() * (self.head_dim ** -0.5 * self.heads ** -0.5)
        return index_scores(q, w, keys, visible)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.layer, self.role = cfg, layer, cfg.role(layer)
        self.ratio = cfg.compress_ratios[layer]
        H, Dh, fp8 = cfg.n_heads, cfg.head_dim, cfg.quant == "ref"
        self.wq_a = linear(cfg.dim, cfg.q_lora_rank, dtype, fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, H * Dh, dtype, fp8)
        self.wkv = linear(cfg.dim, Dh, dtype, fp8)
        self.kv_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        group_width = H // cfg.o_groups * Dh
        self.wo_a = weight((cfg.o_groups, cfg.o_lora_rank, group_width), group_width, dtype)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dtype, fp8)
        self.compressor = Compressor(cfg, self.ratio, dtype) if self.role == "full" else None
        self.indexer = Indexer(cfg, self.role == "full", dtype) if self.role in ("full", "reindex") else None
        self.publishes_candidates = layer == cfg.candidate_source_layer
        self.uses_candidates = cfg.uses_candidates(layer)
        self.register_buffer("rope_freqs", rope_frequencies(cfg, layer), persistent=False)
        self.codecs = {kind: row_codec(cfg, kind) for kind in ("swa", "global_kv", "index_keys")}

    # ---- pieces shared by forward and step --------------------------------------------------------

    def _quant(self, x: torch.Tensor, codec) -> torch.Tensor:
        return codec(x) if self.cfg.quant == "ref" else x

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        return rope_angles(positions, self.rope_freqs)

    def _project(self, u: torch.Tensor, angles: torch.Tensor):
        """(qr, q [B, T, H, Dh] roped, this layer's SWA row before its FP8 rounding [B, T, Dh])."""
        cfg = self.cfg
        qr = self.q_norm(self.wq_a(u))
        q = apply_rope(self.wq_b(qr).unflatten(-1, (cfg.n_heads, cfg.head_dim)), angles[:, :, None, :])
        return qr, q, apply_rope(self.kv_norm(self.wkv(u)), angles)

    def _select(self, u, qr, positions, angles, keys, candidates=None) -> dict:
        """Score this layer's queries against its owner's index keys: what it publishes for later
        layers, {"topk": [B, T, k]} and, at the candidate source, "candidates". `candidates`: the
        candidate source's blocks, for the layers that score only inside them."""
        visible = visible_entries(positions, keys.shape[-2], self.ratio)
        scores = self.indexer.scores(u, qr, angles, keys, visible)
        published = {}
        if self.publishes_candidates:
            published["candidates"] = candidate_mask(scores, positions, self.ratio, self.cfg.candidate_blocks,
                                                     self.cfg.candidate_block_size)
        if self.uses_candidates:
            scores = scores.masked_fill(~candidates, NEG_INF)
        published["topk"] = select_topk(scores, self.cfg.index_topk)
        return published

    def _output(self, q, keys, valid, angles, dtype):
        """Attention over each query's keys [B, T, J, Dh], inverse RoPE, MXFP8, grouped WO-A, WO-B."""
        cfg = self.cfg
        o = sparse_attention_with_sink(q, keys, valid, self.attn_sink, cfg.head_dim ** -0.5)
        # V carries each key's rotation; de-rotating at the query leaves a relative-position signal.
        o = apply_rope(o, angles[:, :, None, :], inverse=True)
        o = self._quant(o.to(dtype).flatten(-2).unflatten(-1, (cfg.o_groups, -1)), quant.fake_quant_mxfp8)
        z = torch.einsum("btgi,goi->btgo", o, self.wo_a)
        return self.wo_b(z.flatten(-2))

    # ---- one-shot prefill -------------------------------------------------------------------------

    def _window(self, rows: torch.Tensor, n_new: int):
        """Each query's W SWA rows: ([B, T, W, Dh], valid [T, W]).

        Query t's window is the W rows ending at it. Padding W-1 empty rows in front makes every
        window a strided view (`unfold`), with no clamped index arithmetic for Inductor to simplify.
        """
        W = self.cfg.window
        padded = torch.cat((rows.new_zeros(rows.shape[0], W - 1, rows.shape[2]), rows), dim=1)
        windows = padded.unfold(1, W, 1).transpose(-1, -2)  # [B, T, W, Dh]
        position = torch.arange(n_new, device=rows.device)[:, None] - (W - 1) + torch.arange(W, device=rows.device)
        return windows, position >= 0

    def forward(self, u: torch.Tensor, positions: torch.Tensor, shared: dict):
        cfg = self.cfg
        B, T, _ = u.shape
        angles = self._angles(positions)[None]  # [1, T, rd/2]
        qr, q, swa_value = self._project(u, angles)
        keys, valid = self._window(self._quant(swa_value, quant.fake_quant_swa_fp8), T)
        valid = valid.expand(B, T, cfg.window)

        if self.role != "swa":
            if self.role == "full":
                latents = self.compressor(u)
                entry_angles = self._angles(torch.arange(latents.shape[1], device=u.device) * self.ratio)[None]
                shared[self.layer] = {
                    "entries": self._quant(apply_rope(latents, entry_angles), quant.fake_quant_global_fp4),
                    "index_keys": self.indexer.keys(latents, entry_angles)}
            if self.indexer is not None:
                candidates = shared.get(cfg.candidate_source_layer, {}).get("candidates")
                shared.setdefault(self.layer, {}).update(self._select(
                    u, qr, positions, angles, shared[cfg.kv_source(self.layer)]["index_keys"], candidates))
            entries = shared[cfg.kv_source(self.layer)]["entries"]
            topk = shared[cfg.topk_source(self.layer)]["topk"]  # [B, T, k]
            # A zero row after the last entry stands in for "no entry" (-1), so the gather is
            # defined even before the first entry exists (position 0 at ratio 2).
            entries = torch.cat((entries, entries.new_zeros(B, 1, entries.shape[-1])), dim=1)
            picked = torch.where(topk >= 0, topk, entries.shape[1] - 1)
            batch = torch.arange(B, device=u.device)[:, None, None]
            keys = torch.cat((keys, entries[batch, picked].to(keys.dtype)), dim=2)
            valid = torch.cat((valid, topk >= 0), dim=2)
        return self._output(q, keys, valid, angles, u.dtype)

    # ---- batched step over the byte cache ---------------------------------------------------------

    def _step_window(self, swa_value: torch.Tensor, rows: Rows, ring: torch.Tensor):
        """Each row's W SWA rows ([R, W, Dh], valid [R, W]) from this step's rows and the request's
        ring; then the ring takes each request's newest W rows of this step.

        Window slot j of the row at position p holds position q = p - W + 1 + j: this step's row
        (p - q) rows back when q >= chunk_start, else the ring's slot q mod W (written by an earlier
        step of the same request). Visible iff q >= max(swa_floor, 0).
        """
        W, codec, dtype = self.cfg.window, self.codecs["swa"], swa_value.dtype
        new = codec.encode(swa_value)  # [R, bytes]
        offset = torch.arange(W, device=new.device) - (W - 1)  # q - p
        q_pos = rows.positions[:, None] + offset
        here = q_pos >= rows.chunk_start[:, None]
        from_step = new[(torch.arange(new.shape[0], device=new.device)[:, None] + offset).clamp(min=0)]
        from_ring = ring[rows.slots[:, None], q_pos.remainder(W)]
        window = codec.decode(torch.where(here[..., None], from_step, from_ring), dtype)
        valid = (q_pos >= rows.swa_floor[:, None]) & (q_pos >= 0)
        newest = rows.positions >= rows.chunk_end - W  # older rows of a long chunk would collide
        ring.index_put_((torch.where(newest, rows.slots, ring.shape[0] - 1), rows.positions.remainder(W)), new)
        return window, valid

    def publish(self, u, rows, page_table, kv: LayerCache) -> None:
        """Full layers: write the entries and index keys completed by this step's new rows."""
        latents = self.compressor.step(u[0], rows, kv.compressor)  # [R, Dh]
        entry = torch.div(rows.positions, self.ratio, rounding_mode="floor")
        angles = self._angles(entry * self.ratio)
        completes = (rows.positions + 1) % self.ratio == 0
        write = completes & rows.writes_global
        for pool, value in ((kv.global_kv, self.codecs["global_kv"].encode(apply_rope(latents, angles))),
                            (kv.index_keys, self.codecs["index_keys"].encode(self.indexer.key_values(latents, angles)))):
            write_entries(pool, page_table, rows.slots, entry, write, value)

    def step(self, u: torch.Tensor, rows: Rows, page_table: torch.Tensor, kv: LayerCache, selection: Selection,
             publish: bool = True) -> tuple[torch.Tensor, dict]:
        """u [1, R, D] for the rows of a batched step; reads and writes the layer's pools `kv` (see the
        module doc). `selection`: the top-k (and candidate blocks) published by earlier layers that
        this one reads. Returns (output [1, R, D], what it publishes: `_select`'s dict, or {}).
        `publish=False`: a full layer's entries were written already (`publish`, from more rows)."""
        angles = self._angles(rows.positions)[None]
        qr, q, swa_value = self._project(u, angles)
        keys, valid = self._step_window(swa_value[0], rows, kv.swa)

        published = {}
        if self.role != "swa":
            if self.role == "full" and publish:
                self.publish(u, rows, page_table, kv)
            topk = selection.topk
            if self.indexer is not None:
                # every entry the request's pages can hold; visibility masks the rest
                index_keys = kv.index_keys[page_table[rows.slots]].flatten(1, 2)
                index_keys = self.codecs["index_keys"].decode(index_keys, u.dtype)
                published = self._select(u, qr, rows.positions, angles, index_keys[None], selection.candidates)
                topk = published["topk"]
            topk = topk[0]  # [R, k]
            entries = gather_entries(kv.global_kv, page_table, rows.slots, topk.clamp(min=0))
            keys = torch.cat((keys, self.codecs["global_kv"].decode(entries, keys.dtype)), dim=1)
            valid = torch.cat((valid, topk >= 0), dim=1)
        return self._output(q, keys[None], valid[None], angles, u.dtype), published
