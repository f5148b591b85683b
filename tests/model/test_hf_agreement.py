"""Agreement with HF transformers' DeepseekV4 where the math coincides (identical weights, fp32).

V4 (HF) and V4.1 (ours) share the router, the mHC coefficient function, the post map in its
non-delayed form, and interleaved partial RoPE. HF is a test-only client: nothing in megafuse
imports it.
"""

import pytest
import torch
from torch import nn

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

from megafuse.model import preset  # noqa: E402
from megafuse.model.mhc import hc_pre, mhc_coefficients  # noqa: E402
from megafuse.model.moe import route  # noqa: E402
from megafuse.model.rope import apply_rope, rope_angles, rope_frequencies  # noqa: E402
from megafuse.model.transformer import Block  # noqa: E402

ATOL = 1e-5
D, N_HC = 64, 4


def _hf_config(**overrides):
    base = dict(vocab_size=128, hidden_size=D, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, head_dim=32, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
                hc_mult=N_HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, o_groups=1, o_lora_rank=16,
                index_n_heads=2, index_head_dim=32, index_topk=4, sliding_window=8,
                compress_ratios=[0, 0], partial_rotary_factor=16 / 32)
    base.update(overrides)
    return DeepseekV4Config(**base)


# HF's router takes its score function from ACT2FN, which has no softmax.
@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid"])
def test_router_matches_hf_top_k_router(score_func):
    torch.manual_seed(0)
    router = hf.DeepseekV4TopKRouter(_hf_config(scoring_func=score_func))
    nn.init.normal_(router.weight, std=D ** -0.5)
    router.e_score_correction_bias.normal_(std=0.1)
    u = torch.randn(37, D)
    _, hf_w, hf_idx = router(u)
    w, idx = route(u, router.weight, router.e_score_correction_bias, score_func=score_func, k=2,
                   renorm=True, scale=router.routed_scaling_factor)
    order_hf, order = hf_idx.argsort(-1), idx.argsort(-1)
    assert torch.equal(hf_idx.gather(-1, order_hf), idx.gather(-1, order))
    assert torch.allclose(hf_w.gather(-1, order_hf), w.gather(-1, order), atol=ATOL)


def _hf_hyper_connection(seed):
    torch.manual_seed(seed)
    hc = hf.DeepseekV4HyperConnection(_hf_config())
    nn.init.normal_(hc.fn, std=0.1 / (N_HC * D) ** 0.5)
    nn.init.normal_(hc.base, std=1.0)
    nn.init.uniform_(hc.scale, 0.5, 1.5)
    return hc


def test_mhc_coefficients_and_collapse_match_hf_hyper_connection():
    hc = _hf_hyper_connection(1)
    X = torch.randn(2, 5, N_HC, D)
    hf_post, hf_comb, hf_collapsed = hc(X)
    pre, post, comb = mhc_coefficients(X, hc.fn, hc.base, hc.scale, 20, 1e-6, 1e-6)
    assert torch.allclose(post, hf_post, atol=ATOL)
    assert torch.allclose(comb, hf_comb, atol=ATOL)
    assert torch.allclose(hc_pre(X, pre), hf_collapsed, atol=ATOL)


class _LinearSublayer(nn.Module):
    """Stands in for attention / MoE so the test isolates the mHC plumbing of a block."""

    def __init__(self, proj: nn.Linear, returns_tuple: bool):
        super().__init__()
        self.proj, self.returns_tuple = proj, returns_tuple

    def forward(self, x, *args, **kwargs):
        y = torch.tanh(self.proj(x))
        return (y, None) if self.returns_tuple else y


def test_non_delayed_block_matches_hf_decoder_layer_mhc():
    """Our Block with hc_delayed=False is V4's layer: own pre per site, post + C^T mix."""
    torch.manual_seed(2)
    hf_layer = hf.DeepseekV4DecoderLayer(_hf_config(), layer_idx=0)
    for site in (hf_layer.attn_hc, hf_layer.ffn_hc):
        nn.init.normal_(site.fn, std=0.1 / (N_HC * D) ** 0.5)
        nn.init.normal_(site.base, std=1.0)
        nn.init.uniform_(site.scale, 0.5, 1.5)
    for norm in (hf_layer.input_layernorm, hf_layer.post_attention_layernorm):
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    attn_proj, ffn_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
    hf_layer.self_attn = _LinearSublayer(attn_proj, returns_tuple=True)
    hf_layer.mlp = _LinearSublayer(ffn_proj, returns_tuple=False)

    cfg = preset("tiny").replace(dim=D, hc_delayed=False, rms_norm_eps=1e-6, quant="none")
    block = Block(cfg, layer=0, dtype=torch.float32)
    for ours, theirs in ((block.attn_hc, hf_layer.attn_hc), (block.ffn_hc, hf_layer.ffn_hc)):
        ours.load_state_dict(theirs.state_dict())
    block.attn_norm.weight.data.copy_(hf_layer.input_layernorm.weight)
    block.ffn_norm.weight.data.copy_(hf_layer.post_attention_layernorm.weight)
    block.attn = _LinearSublayer(attn_proj, returns_tuple=False)
    block.moe = _LinearSublayer(ffn_proj, returns_tuple=False)

    X = torch.randn(2, 6, N_HC, D)
    expected = hf_layer(X)
    got, _ = block(X, None, None, None, {})
    assert torch.allclose(got, expected, atol=ATOL)
    # ... and the delayed (V4.1) block is a different function of the same weights.
    block.delayed = True
    delayed, _ = block(X, torch.full((2, 6, N_HC), 0.25), None, None, {})
    assert (delayed - expected).abs().max() > 1e-3


def test_interleaved_partial_rope_and_inverse_match_hf():
    cfg = preset("tiny").replace(quant="none")  # rope_dim 16 of head_dim 64, theta 10000 at layer 0
    freqs = rope_frequencies(cfg, 0)
    hf_cfg = _hf_config(head_dim=cfg.head_dim, partial_rotary_factor=cfg.rope_dim / cfg.head_dim)
    rotary = hf.DeepseekV4RotaryEmbedding(hf_cfg)
    x = torch.randn(2, 9, 3, cfg.head_dim)  # [B, T, H, Dh]
    positions = torch.arange(9)[None].expand(2, 9)
    cos, sin = rotary(x, positions, layer_type="main")
    assert torch.allclose(rotary.main_inv_freq, freqs, rtol=1e-6)
    expected = hf.apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)
    angles = rope_angles(torch.arange(9), freqs)[None, :, None, :]
    assert torch.allclose(apply_rope(x, angles), expected, atol=ATOL)
    # the inverse rotation is HF's rotation by -angle
    inverse = hf.apply_rotary_pos_emb(x, cos, -sin, unsqueeze_dim=2)
    assert torch.allclose(apply_rope(x, angles, inverse=True), inverse, atol=ATOL)
