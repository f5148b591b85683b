"""The DeepSeek-V4.1-Flash model as a plain eager PyTorch module (MODEL.md section 2).

    ids [B, T] --embed--> e [B, T, D] --repeat--> X [B, T, n, D]         pre = one_hot(0)
    for each layer:  (Engram layers) X = Engram(X, ids);   X, pre = Block(X, pre)
    y = RMSNorm(hc_pre(X, pre));   logits = y_fp32 @ W_head_fp32^T      [B, T, vocab] fp32

Block (V4.1, pre delayed by one sublayer; `hc_delayed=False` gives V4's own-pre form):

    (p_a, q_a, C_a) = coeffs_attn(X);  u = attn_norm(hc_pre(X, pre));  X = hc_post(Attn(u), X, q_a, C_a)
    (p_f, q_f, C_f) = coeffs_ffn(X);   u = ffn_norm(hc_pre(X, p_a));   X = hc_post(MoE(u), X, q_f, C_f)
    return X, p_f

`forward(ids)` is a one-shot prefill from position 0 and traces with `torch.compile(fullgraph=True)`.
`forward(ids, cache)` continues the sequence held by an eager `DecodeCache` (decode when T = 1,
chunked prefill when T > 1); both paths run the same layer code, which is what the tests compare.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import Attention, LayerCache
from .config import ModelConfig
from .engram import Engram
from .layers import RMSNorm, linear
from .mhc import HyperConnection, HyperHead, hc_post, hc_pre
from .moe import MoE

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class DecodeCache:
    """Everything a sequence needs to continue: per-layer caches, the length, recent token ids."""

    length: int
    layers: list[LayerCache]
    recent_ids: torch.Tensor  # [B, engram_max_ngram - 1] the newest ids, oldest first; -1 = before the start
    extra: dict = field(default_factory=dict)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer, self.delayed = layer, cfg.hc_delayed
        n, D = cfg.hc_mult, cfg.dim
        hc = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        self.engram = Engram(cfg, layer, dtype) if layer in cfg.engram_layers else None
        self.attn_hc = HyperConnection(n, D, **hc)
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, dtype)
        self.ffn_hc = HyperConnection(n, D, **hc)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.moe = MoE(cfg, dtype)

    def forward(self, streams, pre, ids, positions, shared, cache: LayerCache | None, recent_ids):
        if self.engram is not None:
            streams = self.engram(streams, ids, recent_ids)
        p_a, q_a, c_a = self.attn_hc(streams)
        u = self.attn_norm(hc_pre(streams, pre if self.delayed else p_a))
        streams = hc_post(self.attn(u, positions, shared, cache), streams, q_a, c_a)
        p_f, q_f, c_f = self.ffn_hc(streams)
        u = self.ffn_norm(hc_pre(streams, p_a if self.delayed else p_f))
        streams = hc_post(self.moe(u), streams, q_f, c_f)
        return streams, p_f


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        dtype = TORCH_DTYPES[cfg.dtype]
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.head = linear(cfg.dim, cfg.vocab_size, dtype)
        # V4.1 collapses with the last FFN site's pre; V4 computed a final pre of its own.
        self.head_hc = None if cfg.hc_delayed else HyperHead(cfg.hc_mult, cfg.dim, cfg.hc_eps, cfg.rms_norm_eps)

    def new_cache(self, batch: int) -> DecodeCache:
        cfg, p = self.cfg, self.embed.weight
        layers = [
            LayerCache(
                swa_rows=p.new_zeros(batch, cfg.window, cfg.head_dim),
                swa_positions=torch.full((cfg.window,), -1, dtype=torch.long, device=p.device),
            )
            for _ in range(cfg.n_layers)
        ]
        recent = torch.full((batch, cfg.engram_max_ngram - 1), -1, dtype=torch.long, device=p.device)
        return DecodeCache(0, layers, recent)

    def forward(self, ids: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        cfg = self.cfg
        B, T = ids.shape
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + T, device=ids.device)
        recent = None if cache is None else cache.recent_ids

        streams = self.embed(ids).unsqueeze(2).expand(B, T, cfg.hc_mult, cfg.dim).contiguous()
        pre = torch.zeros(B, T, cfg.hc_mult, device=ids.device)
        pre[..., 0] = 1.0  # the first collapse reads copy 0
        shared: dict = {}
        for i, block in enumerate(self.layers):
            streams, pre = block(streams, pre, ids, positions, shared, None if cache is None else cache.layers[i], recent)

        if self.head_hc is not None:
            pre = self.head_hc(streams)
        y = self.norm(hc_pre(streams, pre))
        logits = y.float() @ self.head.weight.float().t()
        if cache is not None:
            cache.length += T
            keep = cache.recent_ids.shape[1]
            cache.recent_ids = torch.cat((cache.recent_ids, ids), dim=1)[:, -keep:]
        return logits


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """Construct with seeded weights directly on `device` (use "meta" for shapes only)."""
    device = torch.device(device)
    if device.type != "meta":
        torch.manual_seed(seed)
    with device:
        model = Transformer(cfg)
    return model.eval()
