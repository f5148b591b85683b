"""MoE gate and experts against independent per-token references."""

import pytest
import torch
import torch.nn.functional as F

from megafuse.model import preset
from megafuse.model.moe import MoE, route


def _gate_inputs(seed, N=64, D=32, E=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g), torch.randn(E, D, generator=g) / D ** 0.5


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_bias_changes_selection_but_not_weights(score_func):
    u, W = _gate_inputs(0)
    bias = torch.zeros(16)
    bias[3] = 5.0  # forces expert 3 into every selection
    w0, i0 = route(u, W, None, score_func=score_func, k=4, renorm=True, scale=1.5)
    w1, i1 = route(u, W, bias, score_func=score_func, k=4, renorm=True, scale=1.5)
    assert (i1 == 3).any(-1).all() and not (i0 == 3).any(-1).all()
    # The weights are the *unbiased* scores of whatever was chosen.
    scores = {"sqrtsoftplus": lambda l: F.softplus(l).sqrt(), "sigmoid": torch.sigmoid,
              "softmax": lambda l: l.softmax(-1)}[score_func](u @ W.t())
    raw = scores.gather(-1, i1)
    assert torch.allclose(w1, raw / raw.sum(-1, keepdim=True) * 1.5, rtol=1e-6)


def test_weights_sum_to_the_scale_and_follow_top_scores():
    u, W = _gate_inputs(1)
    w, idx = route(u, W, None, score_func="sqrtsoftplus", k=3, renorm=True, scale=1.5)
    assert torch.allclose(w.sum(-1), torch.full((64,), 1.5), atol=1e-6)
    ref = torch.topk(F.softplus(u @ W.t()).sqrt(), 3, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, ref.sort(-1).values)
    # Without renormalisation the weights are the raw top scores.
    w_plain, _ = route(u, W, None, score_func="sigmoid", k=3, renorm=False, scale=1.0)
    assert torch.allclose(w_plain, torch.topk(torch.sigmoid(u @ W.t()), 3).values)


def _moe_reference(moe: MoE, u: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert, in fp32: the definition of the layer."""
    weights, idx = moe.gate(u)
    out = torch.zeros(u.shape[0], u.shape[1])
    lim = moe.experts.limit
    for t in range(u.shape[0]):
        x = u[t].float()
        for w, e in zip(weights[t], idx[t]):
            w13 = moe.experts.w13[e].float()
            g, v = (w13 @ x).chunk(2)
            a = F.silu(g.clamp(max=lim)) * v.clamp(-lim, lim) * w
            out[t] += moe.experts.w2[e].float() @ a
        sg, sv = (moe.shared.w13.weight.float() @ x).chunk(2)
        out[t] += moe.shared.w2.weight.float() @ (F.silu(sg.clamp(max=lim)) * sv.clamp(-lim, lim))
    return out


def test_fp32_dispatch_equals_per_token_reference():
    cfg = preset("tiny").replace(quant="none")
    torch.manual_seed(0)
    moe = MoE(cfg, torch.float32)
    u = torch.randn(24, cfg.dim) * 3  # large enough that the +-10 clamps engage
    assert torch.allclose(moe(u), _moe_reference(moe, u), atol=1e-4, rtol=1e-4)


def test_grouped_bf16_dispatch_equals_fp32_dispatch():
    cfg = preset("tiny").replace(quant="none")
    torch.manual_seed(1)
    moe32 = MoE(cfg, torch.float32)
    moe16 = MoE(cfg, torch.bfloat16)
    moe16.load_state_dict({k: v.to(moe16.state_dict()[k].dtype) for k, v in moe32.state_dict().items()})
    u = torch.randn(40, cfg.dim).bfloat16()
    w, idx = moe16.gate(u)
    grouped = moe16.experts(u, w, idx)
    ref = moe16.experts._gathered(u, w.flatten(), idx.flatten(), idx.shape[1]).view(40, -1, cfg.dim).sum(1)
    rel = (grouped.float() - ref).norm() / ref.norm()
    assert rel < 1e-2
