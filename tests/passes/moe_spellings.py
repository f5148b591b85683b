"""Routed-expert chains written the ways clients write them, for the Mega-MoE spelling tests.

Every client takes (u [N, D], weights [N, k] fp32, ids [N, k] int64) and holds the experts as the
model does: w13 [E, 2F, D] ([w1 | w3] rows) and w2 [E, D, F], with the model's clamped SwiGLU
silu(min(g, limit)) * clamp(v, -limit, limit) unless a near miss changes it. `weight="before"`
multiplies the slot weight into the activation before the down projection (the model's and the
fused op's rounding point); `weight="after"` multiplies the down projection's output (HF's).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megafuse.model.moe import clamped_swiglu


class ExpertWeights(nn.Module):
    def __init__(self, n_experts=8, hidden=64, expert_dim=32, k=2, limit=10.0, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w13 = nn.Parameter((torch.randn(n_experts, 2 * expert_dim, hidden, generator=g) * hidden ** -0.5).to(dtype))
        self.w2 = nn.Parameter((torch.randn(n_experts, hidden, expert_dim, generator=g) * expert_dim ** -0.5).to(dtype))
        self.n_experts, self.k, self.limit = n_experts, k, limit

    def act(self, gate_up):
        """The model's clamped SwiGLU, in fp32 (fp64 where the spelling runs as the fp64 reference)."""
        if gate_up.dtype == torch.float64:
            g, v = gate_up.chunk(2, dim=-1)
            return F.silu(g.clamp(max=self.limit)) * v.clamp(-self.limit, self.limit)
        return clamped_swiglu(gate_up, self.limit)


class HFStyleGrouped(ExpertWeights):
    """The grouped dispatch spelled as HF's `grouped_mm_experts_forward` spells it (torch.sort, histc
    counts over the sorted ids, the inverse permutation by index_put of an arange), bf16 weights.
    `weight="after"` is HF's own placement; `act="bf16"` computes the SwiGLU in bf16 as HF's
    `_apply_gate` does on a bf16 GEMM output."""

    def __init__(self, weight="before", counts="histc", inverse="index_put", act="fp32", **kw):
        super().__init__(dtype=torch.bfloat16, **kw)
        self.weight, self.counts, self.inverse, self.act_dtype = weight, counts, inverse, act

    def forward(self, u, weights, ids):
        n, k = ids.shape
        flat_w, flat_ids = weights.reshape(-1), ids.reshape(-1)
        sorted_ids, perm = torch.sort(flat_ids)
        tokens = u[perm // k].to(torch.bfloat16)
        if self.counts == "histc":
            counts = torch.histc(sorted_ids.float(), bins=self.n_experts, min=0, max=self.n_experts - 1)
        else:
            counts = torch.zeros(self.n_experts, dtype=torch.int32).scatter_add(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate_up = torch._grouped_mm(tokens, self.w13.transpose(-2, -1), offs=offs)
        if self.act_dtype == "bf16":
            g, v = gate_up.chunk(2, dim=-1)
            act = F.silu(g.clamp(max=self.limit)) * v.clamp(-self.limit, self.limit)
        else:
            act = self.act(gate_up)
        w = flat_w[perm].unsqueeze(-1)
        if self.weight == "before":
            act = act * w
        down = torch._grouped_mm(act.to(torch.bfloat16), self.w2.transpose(-2, -1), offs=offs).float()
        if self.weight == "after":
            down = down * w
        if self.inverse == "index_put":
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.size(0))
        else:
            inv = torch.argsort(perm)
        return down[inv].view(n, k, -1).sum(dim=1).to(u.dtype)


class WhereLoop(ExpertWeights):
    """The reference loop: `for e in range(E): rows, slot = torch.where(ids == e); out[rows] += ...`.
    `accumulate`: "index_put" (out[rows] += y) or "index_add" (out.index_add_(0, rows, y))."""

    def __init__(self, weight="after", accumulate="index_put", **kw):
        super().__init__(**kw)
        self.weight, self.accumulate = weight, accumulate

    def forward(self, u, weights, ids):
        wide = torch.float64 if u.dtype == torch.float64 else torch.float32  # fp32, or fp64 as the reference
        out = torch.zeros(u.shape, dtype=wide)
        for e in range(self.n_experts):
            rows, slot = torch.where(ids == e)
            w = weights[rows, slot, None]
            act = self.act(u[rows].to(wide) @ self.w13[e].to(wide).t())
            if self.weight == "before":
                y = (act * w) @ self.w2[e].to(wide).t()
            else:
                y = w * (act @ self.w2[e].to(wide).t())
            if self.accumulate == "index_add":
                out.index_add_(0, rows, y)
            else:
                out[rows] += y
        return out.to(u.dtype)


class DenseMaskLoop(ExpertWeights):
    """Every expert on every token, masked: `hit = (ids == e).any(-1)`, the token's weight for e
    `(weights * (ids == e)).sum(-1)`, added in expert order."""

    def __init__(self, weight="after", **kw):
        super().__init__(**kw)
        self.weight = weight

    def forward(self, u, weights, ids):
        wide = torch.float64 if u.dtype == torch.float64 else torch.float32  # fp32, or fp64 as the reference
        out = torch.zeros(u.shape, dtype=wide)
        for e in range(self.n_experts):
            hit = (ids == e).any(-1)
            w = (weights * (ids == e)).sum(-1, keepdim=True)
            act = self.act(u.to(wide) @ self.w13[e].to(wide).t())
            if self.weight == "before":
                y = (act * w) @ self.w2[e].to(wide).t()
            else:
                y = w * (act @ self.w2[e].to(wide).t())
            out = out + torch.where(hit[:, None], y, 0.0)
        return out.to(u.dtype)
