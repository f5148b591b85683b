"""Attention chains for the MegaAttention pass tests: the model's own chain and near misses one
change away from it. Inputs are rows [B, T] of queries, each with its own key rows (K = V)."""

import torch
from torch import nn

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


class NoSinkInMax(AttentionChain):
    """Near miss: the max leaves the sink out (the sink only in the denominator)."""

    def attend(self, q, keys, valid):
        s, sink = _scores(self, q, keys, valid)
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp(s - m)
        return torch.einsum("bthj,btjd->bthd", p / (p.sum(-1, keepdim=True) + torch.exp(sink - m)), keys.float())


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

