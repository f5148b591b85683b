"""CSA2 attention: sliding window + compressed global KV chosen by a lightning indexer (MODEL.md section 4).

One layer, for the T new tokens at absolute `positions` (u = normalised sublayer input [B, T, D]):

    qr = q_norm(wq_a u)            q = RoPE(wq_b qr)                         [B, T, H, Dh]
    kv = FP8(RoPE(kv_norm(wkv u)))  this layer's SWA row (K = V)              [B, T, Dh]
    full:     compressor -> latent -> global entry FP4(RoPE(latent)) and index key MXFP4(RoPE(k_norm(wk latent)))
    full / reindex: indexer scores over the owner's index keys -> top-k entry ids (ascending, -1 = none)
    keys = [the query's window of SWA rows | the top-k global entries of its kv source]
    o    = softmax-with-sink(q . keys * Dh^-0.5) @ keys;  o = MXFP8(RoPE^-1(o));  out = wo_b(wo_a_grouped(o))

Everything a later layer reads (global entries, index keys, top-k, candidate blocks) is written to
`shared[layer]` by the layer that owns it; a layer reads `shared[cfg.kv_source(i)]` and
`shared[cfg.topk_source(i)]`. With a `LayerCache` the same code continues a sequence: the cache
supplies the older SWA rows, entries, index keys and the compressor's half-filled group, and is
updated in place; without one the forward is a one-shot prefill from position 0.

Top-k selections here break ties toward the lowest index (a stable sort), so a prefill and an
incremental decode of the same tokens choose the same entries even where scores tie exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import quant
from .config import ModelConfig
from .layers import RMSNorm, linear, weight
from .rope import apply_rope, rope_angles, rope_frequencies

NEG_INF = float("-inf")


@dataclass
class LayerCache:
    """Eager per-request decode state of one layer (all requests in a batch share positions)."""

    swa_rows: torch.Tensor  # [B, W, Dh] the last W SWA rows, oldest first
    swa_positions: torch.Tensor  # [W] their positions, -1 for slots not yet written
    global_entries: torch.Tensor | None = None  # [B, N, Dh] kv sources: every entry so far
    index_keys: torch.Tensor | None = None  # [B, N, index_head_dim]
    pending: torch.Tensor | None = None  # [B, P, 2, Dh] fp32 (k, gate) of a half-filled ratio-2 group


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


class Compressor(nn.Module):
    """Global-KV compressor of a kv source: one latent per `ratio` tokens (pre-RoPE, normalised).

    ratio 1: latent_t = norm(wkv u_t).
    ratio 2: latent_j = norm(sum_{i in {2j, 2j+1}} softmax_i(wgate u_i) * (wkv u_i)), the softmax
    over the group's 2 tokens per channel; wkv and wgate are fp32 weights and both projections run
    in fp32 (MODEL.md section 4); a half-filled trailing group waits in `pending`.
    """

    def __init__(self, cfg: ModelConfig, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.wkv = linear(cfg.dim, cfg.head_dim, dtype if ratio == 1 else torch.float32)
        self.wgate = linear(cfg.dim, cfg.head_dim, torch.float32) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, u: torch.Tensor, pending: torch.Tensor | None):
        """(latents [B, G, Dh], new pending [B, P', 2, Dh] or None) for the new tokens u [B, T, D]."""
        if self.ratio == 1:
            return self.norm(self.wkv(u)), None
        # (.float() on the weights: a model cast with .to(bf16) still projects in fp32, exactly widened)
        x = u.float()
        kg = torch.stack((F.linear(x, self.wkv.weight.float()), F.linear(x, self.wgate.weight.float())), dim=2)
        if pending is not None:
            kg = torch.cat((pending, kg), dim=1)
        n_groups = kg.shape[1] // self.ratio
        groups = kg[:, : n_groups * self.ratio].unflatten(1, (n_groups, self.ratio))  # [B, G, r, 2, Dh]
        k, g = groups[..., 0, :], groups[..., 1, :]
        latent = (torch.softmax(g, dim=2) * k).sum(dim=2).to(u.dtype)
        return self.norm(latent), kg[:, n_groups * self.ratio:]


class Indexer(nn.Module):
    """Lightning indexer: I[t, j] = sum_h w[t,h] relu(q_idx[t,h] . k_j), over visible entries j.

    Owners (kv sources) also hold the key projection `wk` + `k_norm`; reindex layers score
    against their owner's keys.
    """

    def __init__(self, cfg: ModelConfig, owns_keys: bool, dtype: torch.dtype):
        super().__init__()
        self.heads, self.head_dim, self.quant = cfg.index_heads, cfg.index_head_dim, cfg.quant
        self.wq = linear(cfg.q_lora_rank, cfg.index_heads * cfg.index_head_dim, dtype)
        self.weights_proj = linear(cfg.dim, cfg.index_heads, dtype)
        self.wk = linear(cfg.head_dim, cfg.index_head_dim, dtype) if owns_keys else None
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps) if owns_keys else None

    def _fp4(self, x: torch.Tensor) -> torch.Tensor:
        return quant.fake_quant_index_mxfp4(x) if self.quant == "ref" else x

    def keys(self, latents: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        return self._fp4(apply_rope(self.k_norm(self.wk(latents)), angles))

    def scores(self, u: torch.Tensor, qr: torch.Tensor, angles: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        q = self.wq(qr).unflatten(-1, (self.heads, self.head_dim))
        q = self._fp4(apply_rope(q, angles[:, :, None, :]))
        w = self.weights_proj(u).float() * (self.head_dim ** -0.5 * self.heads ** -0.5)
        logits = torch.relu(torch.einsum("bthd,bnd->bthn", q.float(), keys.float()))
        scores = torch.einsum("bth,bthn->btn", w, logits)
        return scores.masked_fill(~visible, NEG_INF)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.layer, self.role = cfg, layer, cfg.role(layer)
        self.ratio = cfg.compress_ratios[layer]
        H, Dh = cfg.n_heads, cfg.head_dim
        self.wq_a = linear(cfg.dim, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = linear(cfg.q_lora_rank, H * Dh, dtype)
        self.wkv = linear(cfg.dim, Dh, dtype)
        self.kv_norm = RMSNorm(Dh, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        group_width = H // cfg.o_groups * Dh
        self.wo_a = weight((cfg.o_groups, cfg.o_lora_rank, group_width), group_width, dtype)
        self.wo_b = linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, dtype)
        self.compressor = Compressor(cfg, self.ratio, dtype) if self.role == "full" else None
        self.indexer = Indexer(cfg, self.role == "full", dtype) if self.role in ("full", "reindex") else None
        self.register_buffer("rope_freqs", rope_frequencies(cfg, layer), persistent=False)

    # ---- pieces ---------------------------------------------------------------------------------

    def _quant(self, x: torch.Tensor, codec) -> torch.Tensor:
        return codec(x) if self.cfg.quant == "ref" else x

    def _window(self, rows: torch.Tensor, row_positions: torch.Tensor, n_new: int):
        """Each new query's W SWA rows: ([B, T, W, Dh], valid [T, W]).

        Rows are in position order and the new tokens are the last T, so query t's window is the
        W rows ending at it. Padding W-1 empty rows (position -1) in front makes every window a
        strided view (`unfold`), with no clamped index arithmetic for Inductor to simplify.
        """
        W = self.cfg.window
        first_new = rows.shape[1] - n_new
        padded = torch.cat((rows.new_zeros(rows.shape[0], W - 1, rows.shape[2]), rows), dim=1)
        padded_positions = torch.cat((row_positions.new_full((W - 1,), -1), row_positions))
        windows = padded.unfold(1, W, 1)[:, first_new:].transpose(-1, -2)  # [B, T, W, Dh]
        valid = padded_positions.unfold(0, W, 1)[first_new:] >= 0  # [T, W]
        return windows, valid

    def _publish_global(self, u, positions, angles_of, shared, cache):
        """Full layers: compress the new tokens and publish entries + index keys (cached ones first)."""
        latents, pending = self.compressor(u, None if cache is None else cache.pending)
        n_old = 0 if cache is None or cache.global_entries is None else cache.global_entries.shape[1]
        entry_pos = (n_old + torch.arange(latents.shape[1], device=u.device)) * self.ratio
        angles = angles_of(entry_pos)[None]
        entries = self._quant(apply_rope(latents, angles), quant.fake_quant_global_fp4)
        keys = self.indexer.keys(latents, angles)
        if cache is not None:
            if cache.global_entries is not None:
                entries = torch.cat((cache.global_entries, entries), dim=1)
                keys = torch.cat((cache.index_keys, keys), dim=1)
            cache.global_entries, cache.index_keys, cache.pending = entries, keys, pending
        shared[self.layer] = {"entries": entries, "index_keys": keys}

    def _publish_topk(self, u, qr, positions, angles, shared):
        owner = shared[self.cfg.kv_source(self.layer)]
        keys = owner["index_keys"]
        visible = visible_entries(positions, keys.shape[1], self.ratio)
        scores = self.indexer.scores(u, qr, angles, keys, visible)
        mine = shared.setdefault(self.layer, {})
        if self.layer == self.cfg.candidate_source_layer:
            mine["candidates"] = candidate_mask(scores, positions, self.ratio, self.cfg.candidate_blocks,
                                                self.cfg.candidate_block_size)
        if self.cfg.uses_candidates(self.layer):
            scores = scores.masked_fill(~shared[self.cfg.candidate_source_layer]["candidates"], NEG_INF)
        mine["topk"] = select_topk(scores, self.cfg.index_topk)

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, u: torch.Tensor, positions: torch.Tensor, shared: dict, cache: LayerCache | None = None):
        cfg = self.cfg
        B, T, _ = u.shape

        def angles_of(pos):
            return rope_angles(pos, self.rope_freqs)

        angles = angles_of(positions)[None]  # [1, T, rd/2]

        qr = self.q_norm(self.wq_a(u))
        q = apply_rope(self.wq_b(qr).unflatten(-1, (cfg.n_heads, cfg.head_dim)), angles[:, :, None, :])
        swa_row = self._quant(apply_rope(self.kv_norm(self.wkv(u)), angles), quant.fake_quant_swa_fp8)

        rows, row_positions = swa_row, positions
        if cache is not None:
            rows = torch.cat((cache.swa_rows, swa_row), dim=1)
            row_positions = torch.cat((cache.swa_positions, positions))
            cache.swa_rows, cache.swa_positions = rows[:, -cfg.window:], row_positions[-cfg.window:]
        keys, valid = self._window(rows, row_positions, T)
        valid = valid.expand(B, T, cfg.window)

        if self.role != "swa":
            if self.role == "full":
                self._publish_global(u, positions, angles_of, shared, cache)
            if self.role in ("full", "reindex"):
                self._publish_topk(u, qr, positions, angles, shared)
            entries = shared[cfg.kv_source(self.layer)]["entries"]
            topk = shared[cfg.topk_source(self.layer)]["topk"]  # [B, T, k]
            # A zero row after the last entry stands in for "no entry" (-1), so the gather is
            # defined even before the first entry exists (position 0 at ratio 2).
            entries = torch.cat((entries, entries.new_zeros(B, 1, entries.shape[-1])), dim=1)
            picked = torch.where(topk >= 0, topk, entries.shape[1] - 1)
            batch = torch.arange(B, device=u.device)[:, None, None]
            keys = torch.cat((keys, entries[batch, picked].to(keys.dtype)), dim=2)
            valid = torch.cat((valid, topk >= 0), dim=2)

        o = sparse_attention_with_sink(q, keys, valid, self.attn_sink, cfg.head_dim ** -0.5)
        # V carries each key's rotation; de-rotating at the query leaves a relative-position signal.
        o = apply_rope(o, angles[:, :, None, :], inverse=True)
        o = self._quant(o.to(u.dtype).flatten(-2).unflatten(-1, (cfg.o_groups, -1)), quant.fake_quant_mxfp8)
        z = torch.einsum("btgi,goi->btgo", o, self.wo_a)
        return self.wo_b(z.flatten(-2))
