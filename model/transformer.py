"""The DeepSeek-V4.1-Flash model as a plain eager PyTorch module (docs/model.md section 2).

    ids [B, T] --embed--> e [B, T, D] --repeat--> X [B, T, n, D]         pre = one_hot(0)
    for each layer:  (Engram layers) X = Engram(X, ids);   X, pre = Block(X, pre)
    y = RMSNorm(hc_pre(X, pre));   logits = head_logits(y, W_head)      [B, T, vocab] fp32

Block (V4.1, pre delayed by one sublayer; `hc_delayed=False` gives V4's own-pre form):

    (p_a, q_a, C_a) = coeffs_attn(X);  u = attn_norm(hc_pre(X, pre));  X = hc_post(Attn(u), X, q_a, C_a)
    (p_f, q_f, C_f) = coeffs_ffn(X);   u = ffn_norm(hc_pre(X, p_a));   X = hc_post(MoE(u), X, q_f, C_f)
    return X, p_f

Two ways to run it, over the same layers:

- `forward(ids [B, T])`: a one-shot prefill from position 0, no cache; traces with
  `torch.compile(fullgraph=True)`. The plain model every other path is checked against.
- `step(batch, cache)`: one batched step of a serving engine (`model/batch.py`): a flat batch of
  rows mixing prefill chunks and decodes of different requests, reading and writing the byte cache
  (`model/cache.py`). It runs as two regions a runtime compiles and captures separately:
  `encoder_region` (layers 0..L/2 on every row) and `decoder_region` (layers > L/2 and the head on
  the decoder rows: docs/model.md Decision 2). Logits come back for the decoder rows only.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention, Selection
from .batch import Rows, StepBatch
from .cache import KVCache, LayerCache
from .config import ModelConfig
from .engram import Engram
from .layers import RMSNorm, linear
from .mhc import HyperConnection, HyperHead, Residual, hc_post, hc_pre
from .moe import MoE


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

    def _attention_site(self, streams, pre, engram):
        """(streams after Engram, the attention input u, the site's coefficients p_a, q_a, c_a)."""
        if self.engram is not None:
            streams = engram(self.engram, streams)
        p_a, q_a, c_a = self.attn_hc(streams)
        u = self.attn_norm(hc_pre(streams, pre if self.delayed else p_a))
        return streams, u, p_a, q_a, c_a

    def _ffn_site(self, streams, p_a) -> tuple[Residual, torch.Tensor]:
        """(the residual with the FFN's hc_post pending, p_f): the next layer applies that post."""
        p_f, q_f, c_f = self.ffn_hc(streams)
        u = self.ffn_norm(hc_pre(streams, p_a if self.delayed else p_f))
        return Residual(streams, self.moe(u), q_f, c_f), p_f

    def forward(self, streams, pre, ids, positions, shared):
        streams, u, p_a, q_a, c_a = self._attention_site(streams, pre, lambda engram, x: engram(x, ids))
        residual, p_f = self._ffn_site(hc_post(self.attn(u, positions, shared), streams, q_a, c_a), p_a)
        return residual.resolve(), p_f

    @staticmethod
    def _engram_rows(rows: Rows):
        return lambda engram, x: engram.inject(x, engram.lookup_windows(rows.ngram_ids[None]))

    def step(self, residual: Residual, pre, rows: Rows, page_table, kv: LayerCache, selection: Selection):
        """One layer of a batched step: (residual with this layer's FFN post pending, p_f, what its
        indexer publishes). It starts with the previous layer's pending post (`Residual`)."""
        streams, u, p_a, q_a, c_a = self._attention_site(residual.resolve(), pre, self._engram_rows(rows))
        attended, published = self.attn.step(u, rows, page_table, kv, selection)
        return (*self._ffn_site(hc_post(attended, streams, q_a, c_a), p_a), published)

    def step_trimmed(self, residual: Residual, pre, batch: StepBatch, kv: LayerCache, selection: Selection):
        """The kv layer under `trim_kv_layer`: its compressor and index keys see every row; its
        query, attention and FFN only the decoder rows (as `step`, for those rows)."""
        streams, u, p_a, q_a, c_a = self._attention_site(residual.resolve(), pre, self._engram_rows(batch.rows))
        self.attn.publish(u, batch.rows, batch.page_table, kv)
        keep = batch.decoder_index
        streams, u, p_a, q_a, c_a = (t[:, keep] for t in (streams, u, p_a, q_a, c_a))
        if keep.numel() == 0:  # a non-final chunk: nothing more to run (the bucket fixes this branch)
            return Residual(streams), p_a, {}
        attended, published = self.attn.step(u, batch.decoder, batch.page_table, kv, selection, publish=False)
        return (*self._ffn_site(hc_post(attended, streams, q_a, c_a), p_a), published)


# aten::mm.dtype (bf16/fp16 inputs, fp32 accumulation and output) exists on CUDA and XPU only.
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


def head_logits(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits [..., vocab] of y [..., D] against the head's weight [vocab, D] as stored.

    The products of two bf16 values are exact in fp32, so both forms below compute the exact
    products with fp32 accumulation and differ only in the order of the sums (docs/model.md
    section 2). On CUDA (and XPU), a bf16 model reads its bf16 weight directly (`mm.dtype`, tensor
    cores); elsewhere, and for fp32 / fp64 models, both operands are widened to fp32 first, the CPU
    having no `mm.dtype`. A torch without `mm.dtype` takes the widened form everywhere.
    """
    # the fp32 form would cast the whole vocab x D weight at every step and multiply on CUDA cores
    if (_MM_OUT_DTYPE and y.device.type in ("cuda", "xpu") and y.dtype == weight.dtype
            and weight.dtype in (torch.bfloat16, torch.float16)):
        return torch.mm(y.flatten(0, -2), weight.t(), out_dtype=torch.float32).unflatten(0, y.shape[:-1])
    return y.float() @ weight.float().t()


def run_eagerly(function, *args):
    """How the regions run their layers and head unless told otherwise: call them. A runtime passes
    a `run` of the same signature that compiles each distinct kind of layer once (runtime/graphs.py)."""
    return function(*args)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        dtype = getattr(torch, cfg.dtype)  # config.DTYPES are torch dtype names
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(cfg, i, dtype) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.head = linear(cfg.dim, cfg.vocab_size, dtype)
        # V4.1 collapses with the last FFN site's pre; V4 computed a final pre of its own.
        self.head_hc = None if cfg.hc_delayed else HyperHead(cfg.hc_mult, cfg.dim, cfg.hc_eps, cfg.rms_norm_eps)

    @property
    def decoder_start(self) -> int:
        """The first layer of the decoder region (layers > L/2, docs/model.md Decision 2)."""
        return self.cfg.decoder_kv_layer + 1

    def _embed(self, ids: torch.Tensor):
        """(streams [B, T, n, D], pre [B, T, n] = one_hot(0): the first collapse reads copy 0)."""
        B, T = ids.shape
        streams = self.embed(ids).unsqueeze(2).expand(B, T, self.cfg.hc_mult, self.cfg.dim).contiguous()
        pre = torch.zeros(B, T, self.cfg.hc_mult, device=ids.device)
        pre[..., 0] = 1.0
        return streams, pre

    def logits(self, residual: Residual, pre) -> torch.Tensor:
        """The head: the last pending post, the collapse, the final norm, the projection to fp32 logits."""
        streams = residual.resolve()
        if self.head_hc is not None:
            pre = self.head_hc(streams)
        y = self.norm(hc_pre(streams, pre))
        return head_logits(y, self.head.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] fp32 of a one-shot prefill of ids [B, T] from position 0."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        streams, pre = self._embed(ids)
        shared: dict = {}
        for block in self.layers:
            streams, pre = block(streams, pre, ids, positions, shared)
        return self.logits(Residual(streams), pre)

    def _selection(self, block: Block, shared: dict) -> Selection:
        """What `block` reads of the top-k and candidates published so far (`shared[layer]`)."""
        attn, cfg = block.attn, self.cfg
        if attn.role == "swa":
            return Selection()
        return Selection(None if attn.indexer is not None else shared[cfg.topk_source(block.layer)]["topk"],
                         shared[cfg.candidate_source_layer]["candidates"] if attn.uses_candidates else None)

    def _layer(self, run, function, block: Block, residual, pre, rows, cache: KVCache, shared: dict):
        """Run `function` (Block.step or Block.step_trimmed) of `block` through `run`; its index's
        pools and selection are resolved here, outside the layer, and what it publishes is kept."""
        residual, pre, published = run(function, block, residual, pre, *rows, cache.layer(self.cfg, block.layer),
                                       self._selection(block, shared))
        if published:
            shared[block.layer] = published
        return residual, pre

    def encoder_region(self, batch: StepBatch, cache: KVCache, run=run_eagerly):
        """Layers 0..L/2 on every row (with `trim_kv_layer`, layer L/2 only writes its global KV
        from every row); returns (residual, pre, shared) of the decoder rows only."""
        rows, trim_kv_layer = batch.rows, self.cfg.trim_kv_layer
        streams, pre = self._embed(rows.ids[None])
        residual, shared = Residual(streams), {}
        for block in self.layers[: self.decoder_start - trim_kv_layer]:
            residual, pre = self._layer(run, Block.step, block, residual, pre, (rows, batch.page_table), cache, shared)
        keep = batch.decoder_index
        # The decoder reads the top-k and candidate blocks the encoder's index sources published.
        shared = {layer: {name: value[:, keep] for name, value in published.items()}
                  for layer, published in shared.items()}
        if trim_kv_layer:
            residual, pre = self._layer(run, Block.step_trimmed, self.layers[self.decoder_start - 1], residual, pre,
                                        (batch,), cache, shared)
            return residual, pre, shared
        return residual.rows(keep), pre[:, keep], shared

    def decoder_region(self, residual: Residual, pre, shared: dict, batch: StepBatch, cache: KVCache,
                       run=run_eagerly) -> torch.Tensor:
        """Layers > L/2 and the head on the decoder rows: logits [M, vocab] fp32."""
        for block in self.layers[self.decoder_start:]:
            residual, pre = self._layer(run, Block.step, block, residual, pre, (batch.decoder, batch.page_table),
                                        cache, shared)
        return run(Transformer.logits, self, residual, pre)[0]

    def step(self, batch: StepBatch, cache: KVCache, encoder=None, decoder=None) -> torch.Tensor:
        """One batched step (both regions): logits [M, vocab] of the decoder rows, in order.
        A step without decoder rows (only non-final prefill chunks) skips the decoder region.
        encoder / decoder: the regions to run in place of the methods (compiled `EncoderRegion` /
        `DecoderRegion` modules take the same arguments)."""
        encoded = (encoder or self.encoder_region)(batch, cache)
        if batch.decoder_index.numel() == 0:
            return encoded[1].new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return (decoder or self.decoder_region)(*encoded, batch, cache)


class EncoderRegion(nn.Module):
    """`model.encoder_region` as a module, so it compiles (and is captured) on its own."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, batch: StepBatch, cache: KVCache):
        return self.model.encoder_region(batch, cache)


class DecoderRegion(nn.Module):
    """`model.decoder_region` as a module, so it compiles (and is captured) on its own."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, residual: Residual, pre, shared: dict, batch: StepBatch, cache: KVCache):
        return self.model.decoder_region(residual, pre, shared, batch, cache)


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    """Construct with seeded weights directly on `device` (use "meta" for shapes only)."""
    device = torch.device(device)
    if device.type != "meta":
        torch.manual_seed(seed)
    with device:
        model = Transformer(cfg)
    return model.eval()
