"""Attention chains for the MegaAttention pass tests: the model's own chain, the same function with
the other form of the max, and near misses one change away from it. Inputs are rows [B, T] of
queries, each with its own key rows (K = V). Attentions written outside the project, in many
spellings: attention_spellings.py."""

import torch
from torch import nn

from megafuse.model import quant
from megafuse.model.attention import sparse_attention_with_sink
from megafuse.model.rope import apply_rope

NEG_INF = float("-inf")


class AttentionChain(nn.Module):
    """`Attention._output` before WO-A: sparse attention with the sink, inverse RoPE, the cast."""

    def __init__(self, heads=4, head_dim=32, out_dtype=torch.float32):
        super().__init__()
        self.sink = nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(heads)))
        self.scale, self.out_dtype = head_dim ** -0.5, out_dtype

    def attend(self, q, keys, valid):
        return sparse_attention_with_sink(q, keys, valid, self.sink, self.scale)

    def derotate(self, o, angles):
        return apply_rope(o, angles[:, :, None, :], inverse=True)

    def forward(self, q, keys, valid, angles):
        return self.derotate(self.attend(q, keys, valid), angles).to(self.out_dtype)


def _scores(module, q, keys, valid):
    s = torch.einsum("bthd,btjd->bthj", q.float(), keys.float()) * module.scale
    return s.masked_fill(~valid[:, :, None, :], NEG_INF), module.sink[None, None, :, None]


class PlainMaxChain(AttentionChain):
    """The max leaves the sink out (m = max_j s_j, the sink only in the denominator): m cancels, the
    same function as the model's (but NaN for a query without a valid key, where the model's is 0)."""

    def attend(self, q, keys, valid):
        s, sink = _scores(self, q, keys, valid)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        return torch.einsum("bthj,btjd->bthd", p / (p.sum(-1, keepdim=True) + torch.exp(sink - m)), keys.float())


class NoSink(AttentionChain):
    """Near miss: no sink at all, a plain softmax over the keys."""

    def attend(self, q, keys, valid):
        s, _ = _scores(self, q, keys, valid)
        return torch.einsum("bthj,btjd->bthd", s.softmax(-1), keys.float())


class NoSinkInDenominator(AttentionChain):
    """Near miss: the sink in the max only: a plain softmax shifted by the sink."""

    def attend(self, q, keys, valid):
        s, sink = _scores(self, q, keys, valid)
        m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
        p = torch.exp(s - m)
        return torch.einsum("bthj,btjd->bthd", p / p.sum(-1, keepdim=True), keys.float())


def _softmax_with_sink(s, sink, dim):
    m = torch.maximum(s.amax(dim=dim, keepdim=True), sink)
    p = torch.exp(s - m)
    return p / (p.sum(dim, keepdim=True) + torch.exp(sink - m))


class SoftmaxOverHeads(AttentionChain):
    """Near miss: the softmax runs over the heads instead of the keys."""

    def attend(self, q, keys, valid):
        s, sink = _scores(self, q, keys, valid)
        return torch.einsum("bthj,btjd->bthd", _softmax_with_sink(s, sink, -2), keys.float())


class ValuesNotKeys(AttentionChain):
    """Near miss: the values are another tensor than the keys (here the keys negated)."""

    def attend(self, q, keys, valid):
        s, sink = _scores(self, q, keys, valid)
        return torch.einsum("bthj,btjd->bthd", _softmax_with_sink(s, sink, -1), -keys.float())


class RopeOnHead(AttentionChain):
    """Near miss: the inverse RoPE rotates the first rope_dim dims, not the last."""

    def derotate(self, o, angles):
        rd = 2 * angles.shape[-1]
        return torch.cat((apply_rope(o[..., :rd], angles[:, :, None, :], inverse=True), o[..., rd:]), dim=-1)


class ForwardRope(AttentionChain):
    """Near miss: the output's tail is rotated forward (+angle), not back."""

    def derotate(self, o, angles):
        return apply_rope(o, angles[:, :, None, :])


class RopedQChain(AttentionChain):
    """The chain from q before its RoPE (`Attention._project` rotates q, then `_output` attends)."""

    def q_angles(self, angles):
        return angles

    def forward(self, q, keys, valid, angles):
        return super().forward(apply_rope(q, self.q_angles(angles)[:, :, None, :]), keys, valid, angles)


class RopedQOtherAngles(RopedQChain):
    """Near miss for the q RoPE only: q is rotated by other angles than the output is rotated back by."""

    def q_angles(self, angles):
        return angles * 2


class AttentionChainMxfp8(AttentionChain):
    """The chain under quant="ref": the cast output through MXFP8 in WO-A's group layout."""

    groups = 2

    def forward(self, q, keys, valid, angles):
        o = super().forward(q, keys, valid, angles)
        return self.quantise(o.flatten(-2).unflatten(-1, (self.groups, -1)))

    def quantise(self, x):
        return quant.fake_quant_mxfp8(x)


class FloorScaleMxfp8(AttentionChainMxfp8):
    """Near miss: the MXFP8 scale rounds the exponent down (2^floor(log2(amax / 448))), which
    saturates a block's largest values instead of covering them."""

    def quantise(self, x):
        blocks = x.float().unflatten(-1, (-1, 32))
        ratio = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448.0
        scale = (((ratio.view(torch.int32) >> 23) & 0xFF) << 23).view(torch.float32)
        values = (blocks / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
        return (values * scale).flatten(-2).to(x.dtype)


# ---- HF transformers' DeepseekV4 attention: its own functions, dense [batch, heads, queries, keys] ----

class HFDenseChain(nn.Module):
    """`DeepseekV4Attention.forward` between the projections, through transformers' own code:
    `eager_attention_forward` (one key head broadcast over the query heads, an additive mask, the
    sink as the softmax's last column) and `apply_rotary_pos_emb(.., cos, -sin)` on the output.
    Inputs: q [B, H, T, D], kv [B, 1, S, D], allowed bool [B or 1, 1, T, S], angles [1, T, rd / 2]."""

    def __init__(self, heads=4, head_dim=32):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(heads)))
        self.num_key_value_groups = heads  # read by eager_attention_forward (one key head)

    def forward(self, q, kv, allowed, angles):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)  # as HF's mask functions make it
        o, _ = hf.eager_attention_forward(self, q, kv, kv, mask, scaling=q.shape[-1] ** -0.5)
        cos, sin = self.factors(angles, q.dtype)
        return hf.apply_rotary_pos_emb(o.transpose(1, 2), cos, sin).transpose(1, 2)

    def factors(self, angles, dtype):
        """(cos, -sin) as HF's rotary embedding makes them (times its attention scaling, 1)."""
        return (angles.cos() * 1.0).to(dtype), -(angles.sin() * 1.0).to(dtype)


class HFCompressedChain(HFDenseChain):
    """A compressed layer of HF's DeepseekV4 (CSA / HCA): the sliding window's keys joined with
    `entries` compressed ones, and the mask with the compressor's block bias, built as HF builds it
    (`-inf` everywhere, 0 scattered at the indexer's picks, -1 for none, then cut back; or the
    causal bias, zeros filled with -inf past each query's last closed block).
    Inputs: q, kv [B, 1, S + entries, D], allowed [B or 1, 1, T, S], picks [B, T, k] long, angles."""

    def __init__(self, heads=4, head_dim=32, entries=4, bias="scatter"):
        super().__init__(heads, head_dim)
        self.entries, self.bias = entries, bias

    def forward(self, q, kv, allowed, picks, angles):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
        B, T, C = q.shape[0], q.shape[2], self.entries
        window = torch.where(allowed, 0.0, torch.finfo(torch.float32).min).expand(B, -1, -1, -1)
        if self.bias == "scatter":
            safe = torch.where(picks >= 0, picks, torch.full_like(picks, C))
            block = kv.new_full((B, 1, T, C + 1), NEG_INF).scatter_(-1, safe.unsqueeze(1), 0.0)[..., :C]
        else:  # "causal": entry n visible to query t from t >= 2 n + 1
            closed = torch.arange(C, device=q.device).view(1, 1, 1, -1) >= (torch.arange(T, device=q.device) + 1).view(1, 1, -1, 1) // 2
            block = kv.new_zeros((B, 1, T, C)).masked_fill(closed, NEG_INF)
        mask = torch.cat([window, block.to(window.dtype)], dim=-1)
        o, _ = hf.eager_attention_forward(self, q, kv, kv, mask, scaling=q.shape[-1] ** -0.5)
        cos, sin = self.factors(angles, q.dtype)
        return hf.apply_rotary_pos_emb(o.transpose(1, 2), cos, sin).transpose(1, 2)


class HFBiasedChain(HFCompressedChain):
    """Near miss: the compressed entries get a learned bias (finite, not 0 or -inf) beside the mask."""

    def __init__(self, heads=4, head_dim=32, entries=4):
        super().__init__(heads, head_dim, entries)
        self.entry_bias = nn.Parameter(torch.linspace(-1.0, 1.0, entries))

    def forward(self, q, kv, allowed, picks, angles):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
        B, T = q.shape[0], q.shape[2]
        window = torch.where(allowed, 0.0, torch.finfo(torch.float32).min).expand(B, -1, T, -1)
        mask = torch.cat([window, self.entry_bias.view(1, 1, 1, -1).expand(B, 1, T, -1)], dim=-1)
        o, _ = hf.eager_attention_forward(self, q, kv, kv, mask, scaling=q.shape[-1] ** -0.5)
        cos, sin = self.factors(angles, q.dtype)
        return hf.apply_rotary_pos_emb(o.transpose(1, 2), cos, sin).transpose(1, 2)


class HFForwardRope(HFDenseChain):
    """Near miss: the output's tail rotated with (cos, +sin), forward."""

    def factors(self, angles, dtype):
        return angles.cos().to(dtype), angles.sin().to(dtype)


class HFSinkKept(HFDenseChain):
    """Near miss: the softmax's first column dropped instead of the sink's (the last)."""

    def forward(self, q, kv, allowed, angles):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
        k = kv.expand(-1, q.shape[1], -1, -1)
        s = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5 + torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        x = torch.cat([s, self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)], dim=-1)
        o = torch.softmax(x, dim=-1)[..., 1:] @ k
        cos, sin = self.factors(angles, q.dtype)
        return hf.apply_rotary_pos_emb(o, cos, sin)
