"""Manifold-constrained hyper-connections (mHC), single-pass V4.1 form (docs/model.md section 3).

The residual is n = hc_mult streams X [.., n, D]. Each sublayer site s owns `fn_s [(2+n)n, nD]`,
`base_s [(2+n)n]` and `scale_s [3]` (all fp32), from which it derives, per token:

    X --flatten--> x [nD] --rms--> r       m = (x @ fn^T) * r = [m_pre n | m_post n | m_comb n*n]
    pre  = sigmoid(m_pre * scale0 + base_pre) + eps            collapses X into the sublayer input
    post = 2 * sigmoid(m_post * scale1 + base_post)            expands the sublayer output
    comb = Sinkhorn(softmax(m_comb * scale2 + base_comb))      mixes the residual streams

    hc_pre(X, pre)          = sum_k pre[k] X[k]
    hc_post(y, X, post, C)  = X'[j] = post[j] y + sum_i C[i, j] X[i]      (C^T X: sum over the first index)

The functions here are the one reference of this math: the model calls them, and the fused
mHC kernel's reference calls them too.
"""

from typing import NamedTuple

import torch
from torch import nn

from .layers import rms_normalize


def sinkhorn(comb_logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then `iters` alternating normalisations, starting and ending on columns.

    Exactly the reference truncation: softmax over j (+eps), divide by column sums, then iters-1
    rounds of (rows, columns), each sum + eps. It is not iterated to convergence.
    """
    comb = torch.softmax(comb_logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_coefficients(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """(pre [.., n], post [.., n], comb [.., n, n]) in fp32 from streams [.., n, D]."""
    n = streams.shape[-2]
    x = streams.flatten(-2).float()
    # r scales the projection instead of the input: one scalar per token, over all n*D values.
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mix = (x @ fn.float().t()) * r
    m_pre, m_post, m_comb = mix.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.float().split([n, n, n * n])
    pre = torch.sigmoid(m_pre * scale[0] + b_pre) + hc_eps
    post = 2 * torch.sigmoid(m_post * scale[1] + b_post)
    comb_logits = (m_comb * scale[2] + b_comb).unflatten(-1, (n, n))
    return pre, post, sinkhorn(comb_logits, sinkhorn_iters, hc_eps)


def hc_pre(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse [.., n, D] -> [.., D] with weights pre [.., n], in fp32, cast to the stream dtype."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_post(output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[j] = post[j] * y + sum_i comb[i, j] X[i]; y [.., D], X [.., n, D] -> [.., n, D]."""
    mixed = torch.einsum("...ij,...id->...jd", comb, streams.float())
    return (post.unsqueeze(-1) * output.float().unsqueeze(-2) + mixed).to(streams.dtype)


class Residual(NamedTuple):
    """The streams with the last sublayer's `hc_post` still to apply: X' = hc_post(output, X, post, comb)
    (only X where no sublayer ran yet). A layer's step ends before that post and the next layer's
    step starts with it, so the seam between two layers (post, coefficients, collapse, norm) lies
    inside one traced layer: a runtime that compiles each layer on its own keeps it whole."""

    streams: torch.Tensor
    output: torch.Tensor | None = None
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None

    def resolve(self) -> torch.Tensor:
        return self.streams if self.output is None else hc_post(self.output, self.streams, self.post, self.comb)

    def rows(self, index: torch.Tensor) -> "Residual":
        """The same pending residual for the rows `index` of dim 1."""
        return Residual(*(None if t is None else t[:, index] for t in self))


class HyperConnection(nn.Module):
    """The parameters of one mHC site and the coefficient function that reads them."""

    def __init__(self, n: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        width = (2 + n) * n
        # Small fn keeps the mixes near the base; base favours each stream staying itself (comb
        # near identity after Sinkhorn) and moderate pre/post gates, so activations stay tame.
        self.fn = nn.Parameter(torch.randn(width, n * dim, dtype=torch.float32) * (0.1 / (n * dim) ** 0.5))
        base = torch.zeros(width, dtype=torch.float32)
        base[n * 2:] = (torch.eye(n) * 2.0).flatten()
        self.base = nn.Parameter(base)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.sinkhorn_iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps

    def forward(self, streams: torch.Tensor):
        return mhc_coefficients(streams, self.fn, self.base, self.scale, self.sinkhorn_iters,
                                self.hc_eps, self.norm_eps)


class HyperHead(nn.Module):
    """V4's final collapse weights (non-delayed mode only): pre = sigmoid(x @ fn^T * r * scale + base) + eps."""

    def __init__(self, n: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.fn = nn.Parameter(torch.randn(n, n * dim, dtype=torch.float32) * (0.1 / (n * dim) ** 0.5))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        x = rms_normalize(streams.flatten(-2), self.norm_eps)
        return torch.sigmoid(x @ self.fn.float().t() * self.scale + self.base) + self.hc_eps
