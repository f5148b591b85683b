"""Gate chains written the ways clients write them, for the Mega-Gate pass tests."""

import torch
import torch.nn.functional as F
from torch import nn


class GateChain(nn.Module):
    """One spelling of the family: scoring x bias x renormalisation x scale x GEMM dtype."""

    def __init__(self, n_experts=24, hidden=64, k=3, score_func="sqrtsoftplus", bias=True, renorm="eps",
                 scale=1.5, gemm_dtype=torch.float32, weights_from="gather"):
        super().__init__()
        g = torch.Generator().manual_seed(n_experts * 1000 + hidden + k)
        self.weight = nn.Parameter(torch.randn(n_experts, hidden, generator=g) * hidden ** -0.5)
        self.bias = nn.Parameter(torch.randn(n_experts, generator=g) * 0.1) if bias else None
        self.k, self.score_func, self.renorm, self.scale = k, score_func, renorm, scale
        self.gemm_dtype, self.weights_from = gemm_dtype, weights_from

    def forward(self, u):
        logits = F.linear(u.to(self.gemm_dtype), self.weight.to(self.gemm_dtype)).float()
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores + self.bias if self.bias is not None else scores
        values, ids = torch.topk(choice, self.k, dim=-1)
        weights = values if self.weights_from == "values" else scores.gather(-1, ids)
        if self.renorm == "eps":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        elif self.renorm == "plain":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scale is not None:
            weights = weights * self.scale
        return weights, ids


class BiasInWeights(GateChain):
    """Near miss: the bias also enters the weights."""

    def forward(self, u):
        choice = F.linear(u, self.weight).sigmoid() + self.bias
        ids = torch.topk(choice, self.k, dim=-1).indices
        w = choice.gather(-1, ids)
        return w / w.sum(-1, keepdim=True), ids


class TopkOverTokens(GateChain):
    """Near miss: top-k over the token dimension (expert-choice routing)."""

    def forward(self, u):
        scores = F.linear(u, self.weight).sigmoid()
        ids = torch.topk(scores, self.k, dim=0).indices
        return scores.gather(0, ids), ids


class SoftmaxAfterTopk(GateChain):
    """Near miss: top-k over raw logits, then a softmax over the k values (no renormalisation)."""

    def forward(self, u):
        values, ids = torch.topk(F.linear(u, self.weight), self.k, dim=-1)
        return values.softmax(dim=-1), ids


class MixtralRouter(nn.Module):
    """Mixtral/Qwen-style: softmax over all experts, top-k of the probabilities, renormalised."""

    def __init__(self, n_experts=8, hidden=64, k=2):
        super().__init__()
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.k = k

    def forward(self, hidden_states):
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        return routing_weights.to(hidden_states.dtype), selected
