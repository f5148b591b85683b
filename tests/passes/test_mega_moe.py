"""Mega-MoE pass: the model's MoE block fuses once per block in both forms (with and without MXFP8),
the unfused ops are gone, the outputs equal the unfused compile's within rounding, and near misses
stay unfused with the reason."""

import pytest
import torch
import torch.nn.functional as F

from megafuse import passes
from megafuse.model import preset
from megafuse.model.moe import MoE, Experts, clamped_swiglu, sum_slots
from tests.marks import slow_beyond
from tests.passes.post_grad import fuse

FORMS = slow_beyond([(torch.float32, "none"), (torch.bfloat16, "none"), (torch.float32, "ref"),
                     (torch.bfloat16, "ref")], fast=2)


def _moe(dtype, quant, seed=0):
    cfg = preset("tiny").replace(quant=quant)
    torch.manual_seed(seed)
    return cfg, MoE(cfg, dtype).eval()


@pytest.mark.parametrize("dtype, quant", FORMS)
def test_the_models_moe_block_fuses_once_and_equals_the_unfused_compile(tmp_path, dtype, quant):
    cfg, module = _moe(dtype, quant)
    u = torch.randn(2, 7, cfg.dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_moe"], dump_dir=tmp_path, fullgraph=True)
    out = fused(u)
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    after = "\n".join(p.read_text() for p in sorted(tmp_path.glob("graph*_mega_moe_after.txt")))
    assert after.count("megafuse.mega_moe.default") == 1
    for gone in ("aten._grouped_mm", "aten.bmm", "aten.sort", "aten.scatter_add", "aten.cumsum"):
        assert gone not in after, gone
    spec = fused.report.matches("mega_moe")[0].spec
    assert (spec["weight_dtype"], spec["mxfp8"], spec["k"]) == (str(dtype)[6:], quant == "ref", cfg.n_active_experts)
    assert spec["swiglu_limit"] == cfg.swiglu_limit
    torch._dynamo.reset()
    ref = passes.compile(module, passes="none", fullgraph=True)(u)
    # bf16: one bf16 step of the output, plus a step of an intermediate where it sits on a tie
    # (relative to the largest value); fp32: summation order over D = 256 terms. MXFP8: one e4m3
    # step (2^-3 relative) of an activation where it sits on a rounding tie of the chain's.
    rtol = {"none": 2.0**-7 if dtype == torch.bfloat16 else 2.0**-16, "ref": 2.0**-3}[quant]
    assert (out.float() - ref.float()).abs().max() <= rtol * ref.float().abs().max()


def test_a_symbolic_token_count_fuses_once_for_every_count():
    cfg, module = _moe(torch.float32, "none")
    fused = fuse(module, ["mega_moe"], dynamic=True, fullgraph=True)
    for T in (9, 3):
        u = torch.randn(T, cfg.dim, generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            assert (fused(u) - module(u)).abs().max() <= 2.0**-16 * module(u).abs().max()
    assert fused.report.counts() == {"mega_moe": 1}


# ---- near misses --------------------------------------------------------------------------------

class _Variant(Experts):
    """The fp32 form with its activation, weight or use of intermediates changed."""

    def __init__(self, cfg, variant):
        super().__init__(cfg, torch.float32)
        self.variant = variant

    def _gathered(self, u, slot_weight, slot_expert, k):
        tokens = u.float().repeat_interleave(k, dim=0)
        gate_up = torch.bmm(self.w13[slot_expert], tokens.unsqueeze(-1)).squeeze(-1)
        g, v = gate_up.chunk(2, dim=-1)
        act = {"plain_silu": lambda: F.silu(g) * v.clamp(-self.limit, self.limit),
               "gelu": lambda: F.gelu(g.clamp(max=self.limit)) * v.clamp(-self.limit, self.limit),
               "no_v_clamp": lambda: F.silu(g.clamp(max=self.limit)) * v}.get(self.variant,
                                                                            lambda: clamped_swiglu(gate_up, self.limit))()
        if self.variant == "weight_after_down":
            return torch.bmm(self.w2[slot_expert], act.unsqueeze(-1)).squeeze(-1) * slot_weight[:, None]
        down = torch.bmm(self.w2[slot_expert], (act * slot_weight[:, None]).unsqueeze(-1)).squeeze(-1)
        if self.variant == "leak":
            self.leaked = gate_up
        return down

    def forward(self, u, weights, idx):
        out = sum_slots(self.slot_outputs(u, weights.flatten(), idx.flatten(), idx.shape[1]), idx.shape, u.dtype)
        return (out, self.leaked.sum()) if self.variant == "leak" else out


@pytest.mark.parametrize("variant, reason", [
    ("plain_silu", "silu(g) without min(g, limit)"),
    ("gelu", "the activation is not SiLU"),
    ("no_v_clamp", "v is not clamped to [-limit, limit]"),
    ("leak", "is also used outside the MoE chain"),
])
def test_near_misses_stay_unfused_with_the_reason(variant, reason):
    cfg = preset("tiny").replace(quant="none")
    torch.manual_seed(0)
    module = _Variant(cfg, variant).eval()
    g = torch.Generator().manual_seed(2)
    u, weights = torch.randn(5, cfg.dim, generator=g), torch.rand(5, cfg.n_active_experts, generator=g)
    ids = torch.randint(0, cfg.n_experts, (5, cfg.n_active_experts), generator=g)
    fused = fuse(module, ["mega_moe"], fullgraph=True)
    with torch.no_grad():
        out = fused(u, weights, ids)
    assert fused.report.counts() == {"mega_moe": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_moe")]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert "aten.bmm" in fused.post_grad_graphs[-1]
    got, expected = (out[0], module(u, weights, ids)[0]) if variant == "leak" else (out, module(u, weights, ids))
    assert (got - expected).abs().max() <= 2.0**-16 * expected.abs().max()  # the unfused graph runs


def test_the_weight_after_the_down_projection_fuses_with_its_placement_in_the_spec():
    """bmm(w2[ids], act) * w: the kernel multiplies the fp32 down projection by w in its epilogue."""
    cfg = preset("tiny").replace(quant="none")
    torch.manual_seed(0)
    module = _Variant(cfg, "weight_after_down").eval()
    g = torch.Generator().manual_seed(2)
    u, weights = torch.randn(5, cfg.dim, generator=g), torch.rand(5, cfg.n_active_experts, generator=g)
    ids = torch.randint(0, cfg.n_experts, (5, cfg.n_active_experts), generator=g)
    fused = fuse(module, ["mega_moe"], fullgraph=True)
    with torch.no_grad():
        out, expected = fused(u, weights, ids), module(u, weights, ids)
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    spec = fused.report.matches("mega_moe")[0].spec
    assert (spec["weight_at"], spec["weighted_dtype"], spec["swiglu_dtype"]) == ("after", "float32", "float32")
    assert "aten.bmm" not in fused.post_grad_graphs[-1]
    assert (out - expected).abs().max() <= 2.0**-16 * expected.abs().max()


def test_the_precision_option_reaches_the_spec_and_a_bad_value_is_an_error():
    cfg = preset("tiny").replace(quant="ref", expert_dim=32)
    torch.manual_seed(0)
    module = Experts(cfg, torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    u, weights = torch.randn(4, cfg.dim, generator=g), torch.rand(4, cfg.n_active_experts, generator=g)
    ids = torch.randint(0, cfg.n_experts, (4, cfg.n_active_experts), generator=g)
    fused = fuse(module, ["mega_moe"], fullgraph=True, pass_options={"mega_moe": {"precision": "ieee"}})
    with torch.no_grad():
        fused(u, weights, ids)
    assert fused.report.counts() == {"mega_moe": 1}  # F = 32: one MXFP8 block per row
    assert fused.report.matches("mega_moe")[0].spec["precision"] == "ieee"
    with pytest.raises(ValueError, match="precision='fp8' is not a valid value"):
        fuse(module, ["mega_moe"], pass_options={"mega_moe": {"precision": "fp8"}})


@pytest.mark.slow  # a whole model (about 5 minutes on 2 cores)
def test_tiny_every_moe_layer_fuses_once_and_the_logits_equal_the_unfused_compile():
    from tests.passes.tiny import compile_tiny
    cfg, model, ids, fused, logits = compile_tiny(["mega_moe"], 16)
    assert fused.report.counts() == {"mega_moe": cfg.n_layers}  # every layer of tiny is MoE
    assert fused.report.rejections("mega_moe") == []
    torch._dynamo.reset()
    ref = passes.compile(model, passes="none", fullgraph=True)(ids)
    assert (logits - ref).abs().max() <= 2.0**-14 * ref.abs().max()  # fp32: summation order
