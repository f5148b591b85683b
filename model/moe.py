"""MoE: router (gate), routed experts in a fixed-shape dispatch, shared expert (docs/model.md section 5).

    scores  = score_func(u_fp32 @ W_gate^T)                     [N, E]   sqrtsoftplus | sigmoid | softmax
    idx     = topk(scores + bias, k)                            the bias steers selection only
    weights = scores[idx] / (sum + 1e-20) * route_scale         unbiased scores, renormalised
    expert  = w2( silu(min(w1 u, 10)) * clamp(w3 u, -10, 10) * weight )    the weight enters before w2
    y       = sum over the k routed experts + shared expert(u)

Dispatch is fixed-shape (no data-dependent Python control flow, so it traces with fullgraph):
the N*k (token, expert) slots are sorted by expert and run as one grouped GEMM per projection
(`torch._grouped_mm`, bf16 weights), or - for fp32 weights, which `_grouped_mm` does not take -
as a batched GEMM over each slot's gathered expert weights (fine at the tiny CPU sizes it serves).
Neither computes every expert on every token.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import linear, weight
from .quant import fake_quant_mxfp8

RENORM_EPS = 1e-20


def score(logits: torch.Tensor, score_func: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """score_func(logits) in fp32, each op's result rounded to `dtype` the way torch runs an op in
    that dtype (computed in fp32, its result rounded once): a bf16 sqrt(softplus) rounds twice."""
    def rounded(x):
        return x.to(dtype).float()

    if score_func == "sqrtsoftplus":
        return rounded(torch.sqrt(rounded(F.softplus(logits))))
    if score_func == "sigmoid":
        return rounded(torch.sigmoid(logits))
    if score_func == "softmax":
        return rounded(torch.softmax(logits, dim=-1))
    raise ValueError(f"unknown score_func {score_func!r}; valid: sqrtsoftplus, sigmoid, softmax")


def route(u: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, *, score_func: str,
          k: int, renorm: bool, scale: float, renorm_eps: float = RENORM_EPS,
          logits_dtype: torch.dtype = torch.float32, score_dtype: torch.dtype = torch.float32,
          choice_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] fp32, expert ids [N, k]) for tokens u [N, D]. The reference of the gate.

    `renorm_eps=0.0` renormalises without an eps (w / sum w); `scale=1.0` is "no scale".
    The dtypes say where a router written in a lower precision rounds, computing in fp32 otherwise:
    `logits_dtype=torch.bfloat16` rounds the logits as a bf16 GEMM writes them, `score_dtype` each
    scoring op's result (see `score`), `choice_dtype` the biased choice the top-k ranks.
    """
    logits = (u.float() @ gate_weight.float().t()).to(logits_dtype).float()
    scores = score(logits, score_func, score_dtype)
    choice = scores if bias is None else scores + bias.float()
    idx = torch.topk(choice.to(choice_dtype), k, dim=-1).indices
    weights = scores.gather(-1, idx)
    if renorm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + renorm_eps)
    return weights * scale, idx


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(v, -limit, limit) on [.., 2F] = [g | v], in fp32."""
    g, v = gate_up.float().chunk(2, dim=-1)
    return F.silu(g.clamp(max=limit)) * v.clamp(-limit, limit)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.k, self.score_func = cfg.n_active_experts, cfg.score_func
        self.renorm, self.scale = cfg.route_norm, cfg.route_scale
        self.weight = weight((cfg.n_experts, cfg.dim), cfg.dim, torch.float32)
        # A selection bias comparable to the spread of the scores, so it really moves choices.
        self.bias = nn.Parameter(torch.randn(cfg.n_experts, dtype=torch.float32) * 0.05)

    def forward(self, u: torch.Tensor):
        return route(u, self.weight, self.bias, score_func=self.score_func, k=self.k,
                     renorm=self.renorm, scale=self.scale)


def sum_slots(out: torch.Tensor, choices: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """[N, D] in dtype: fp32 slot outputs [N * k, D] (token-major) summed over each token's k experts."""
    n_tokens, k = choices
    return out.view(n_tokens, k, out.shape[-1]).sum(dim=1).to(dtype)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        E, D, F_ = cfg.n_experts, cfg.dim, cfg.expert_dim
        self.limit = cfg.swiglu_limit
        # FP8 GEMMs: under quant="ref" both projections read MXFP8-rounded inputs (docs/model.md Decision 5)
        self.mxfp8_inputs = cfg.quant == "ref"
        self.w13 = weight((E, 2 * F_, D), D, dtype)  # [w1 | w3] rows, nn.Linear layout (out, in)
        self.w2 = weight((E, D, F_), F_, dtype)

    @classmethod
    def holding(cls, w13: torch.Tensor, w2: torch.Tensor, limit: float, mxfp8_inputs: bool = False) -> "Experts":
        """Experts over the given weights, without a config: what a fused op's reference runs the
        model's own dispatch with (lowering/mega_moe.py)."""
        experts = cls.__new__(cls)
        nn.Module.__init__(experts)
        experts.limit, experts.mxfp8_inputs, experts.w13, experts.w2 = limit, mxfp8_inputs, w13, w2
        return experts

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_mxfp8(x) if self.mxfp8_inputs else x

    def forward(self, u: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = self.slot_outputs(u, weights.flatten(), idx.flatten(), idx.shape[1])
        return sum_slots(out, idx.shape, u.dtype)

    def slot_outputs(self, u: torch.Tensor, slot_weight: torch.Tensor, slot_expert: torch.Tensor,
                     k: int = 1) -> torch.Tensor:
        """fp32 [S, D]: slot s is token u[s // k] through expert slot_expert[s], times slot_weight[s].
        A slot's output depends on its own token, expert and weight only (expert parallelism runs
        each slot on the rank holding its expert and sums them back home)."""
        u = self._fp8(u)
        if self.w13.dtype == torch.bfloat16:
            return self._grouped(u, slot_weight, slot_expert, k)
        return self._gathered(u, slot_weight, slot_expert, k)

    def shard(self, experts: range) -> "Experts":
        """The experts `experts` (a contiguous range of ids) alone, renumbered from 0: their weights
        copied, the rest of the module shared."""
        part = copy.copy(self)
        part._parameters = {name: nn.Parameter(p[experts.start:experts.stop].clone(), requires_grad=False)
                            for name, p in self._parameters.items()}
        return part

    def _grouped(self, u, slot_weight, slot_expert, k):
        order = torch.argsort(slot_expert, stable=True)
        tokens = u[order // k].to(self.w13.dtype)
        counts = torch.zeros(self.w13.shape[0], dtype=torch.int32, device=u.device)
        counts = counts.scatter_add(0, slot_expert, torch.ones_like(slot_expert, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate_up = torch._grouped_mm(tokens, self.w13.transpose(-2, -1), offs=offsets)
        act = clamped_swiglu(gate_up, self.limit) * slot_weight[order, None]
        down = torch._grouped_mm(self._fp8(act).to(self.w2.dtype), self.w2.transpose(-2, -1), offs=offsets)
        return down.float()[torch.argsort(order)]

    def _gathered(self, u, slot_weight, slot_expert, k):
        tokens = u.float().repeat_interleave(k, dim=0)
        gate_up = torch.bmm(self.w13[slot_expert].float(), tokens.unsqueeze(-1)).squeeze(-1)
        act = self._fp8(clamped_swiglu(gate_up, self.limit) * slot_weight[:, None])
        return torch.bmm(self.w2[slot_expert].float(), act.unsqueeze(-1)).squeeze(-1)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.limit = cfg.swiglu_limit
        fp8 = cfg.quant == "ref"
        self.w13 = linear(cfg.dim, 2 * cfg.expert_dim, dtype, fp8)
        self.w2 = linear(cfg.expert_dim, cfg.dim, dtype, fp8)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w13(u), self.limit).to(u.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg, dtype)
        self.shared = SharedExpert(cfg, dtype) if cfg.n_shared_experts else None

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        flat = u.flatten(0, -2)
        weights, idx = self.gate(flat)
        y = self.experts(flat, weights, idx).view_as(u)
        if self.shared is not None:
            y = y + self.shared(u)
        return y
