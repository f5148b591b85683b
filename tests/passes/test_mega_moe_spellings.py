"""Mega-MoE on spellings of the routed experts other than the model's own: HF's
DeepseekV4 experts (grouped_mm, batched_mm and its eager loop over experts), the dispatch spelled
HF's way with the model's weight placement, and the reference loop
`for e in range(E): rows, slot = torch.where(ids == e); out[rows] += ...` (docs/spellings.md).

Each spelling that fuses does so exactly once, its unfused ops gone, and equals the unfused graph
(fp32: to fp32 summation order; bf16: a bf16 step); each that does not keeps its graph and says why.
The slot weight applies before the down projection (the model) or after it (HF, the issue's loop):
the spec's weight_at, the kernel multiplies it in the down GEMM's epilogue at the chain's rounding."""

import pytest
import torch

from tests.passes.moe_spellings import DenseMaskLoop, HFStyleGrouped, WhereLoop
from tests.passes.post_grad import fuse

LONE = "a clamped SwiGLU alone in its graph"


def _routing(n=6, k=2, n_experts=8, hidden=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, hidden, generator=g)
    weights = torch.rand(n, k, generator=g)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)])  # distinct, as a top-k
    return u, weights, ids



def _outputs(module, args, **kw):
    fused = fuse(module, ["mega_moe"], **kw)
    with torch.no_grad():
        out = fused(*args)
    unfused = fuse(module, "none", **kw)
    with torch.no_grad():
        ref = unfused(*args)
    return fused, out, ref


def _fp64(module, args):
    """The spelling run in fp64 (weights and inputs widened): the reference both graphs approximate."""
    import copy
    wide = copy.deepcopy(module).double()
    with torch.no_grad():
        return wide(*[a.double() if a.is_floating_point() else a for a in args])


# ---- spellings that fuse ---------------------------------------------------------------------------------

@pytest.mark.parametrize("counts, inverse", [("histc", "index_put"), ("scatter", "argsort"), ("histc", "argsort")])
def test_the_grouped_dispatch_spelled_hf_s_way_with_the_model_s_weight_placement_fuses_once(counts, inverse):
    module = HFStyleGrouped(weight="before", counts=counts, inverse=inverse).eval()
    args = _routing()
    fused, out, ref = _outputs(module, args, fullgraph=True)
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    graph = fused.post_grad_graphs[-1]
    assert graph.count("megafuse.mega_moe.default") == 1
    for gone in ("aten._grouped_mm", "aten.sort", "aten.histc", "aten.cumsum", "aten.index_put", "aten.scatter_add"):
        assert gone not in graph, gone
    # bf16 roundings of gate_up, act and down: equal within a bf16 step of the output's scale
    assert (out - ref).abs().max() <= 2.0**-7 * ref.abs().max()


@pytest.mark.parametrize("accumulate", ["index_put", "index_add"])
def test_the_reference_where_loop_with_the_weight_before_the_down_projection_fuses_once(accumulate):
    module = WhereLoop(weight="before", accumulate=accumulate, n_experts=4).eval()
    args = _routing(n_experts=4)
    fused, out, ref = _outputs(module, args, fullgraph=True)  # fullgraph: torch.where's row count is captured
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    graph = fused.post_grad_graphs[-1]
    assert graph.count("megafuse.mega_moe.default") == 1
    for gone in ("aten.nonzero", "aten.mm", "aten.addmm", "aten.index_put", "_assert_scalar", "aten.eq"):
        assert gone not in graph, gone
    exact = _fp64(module, args)
    assert (out.double() - exact).abs().max() <= 2.0**-20 * exact.abs().max()
    assert (out - ref).abs().max() <= 2.0**-20 * ref.abs().max()


@pytest.mark.parametrize("weight, act", [("after", "fp32"), ("after", "bf16"), ("before", "bf16")])
def test_the_grouped_dispatch_with_the_weight_after_w2_or_a_bf16_swiglu_fuses_once(weight, act):
    """The weight after w2 on the fp32 `.float()` of the bf16 down projection (an fp32 product), and
    HF's bf16 `_apply_gate` (each op rounded to bf16) before either placement."""
    module = HFStyleGrouped(weight=weight, act=act).eval()
    args = _routing()
    fused, out, ref = _outputs(module, args, fullgraph=True)
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    spec = fused.report.matches("mega_moe")[0].spec
    assert (spec["weight_at"], spec["weighted_dtype"], spec["swiglu_dtype"]) == (
        weight, "float32", {"fp32": "float32", "bf16": "bfloat16"}[act])
    assert "aten._grouped_mm" not in fused.post_grad_graphs[-1]
    assert (out - ref).abs().max() <= 2.0**-7 * ref.abs().max()


@pytest.mark.parametrize("accumulate", ["index_put", "index_add"])
@pytest.mark.parametrize("k", [1, 2])
def test_the_issue_s_where_loop_with_the_weight_after_the_expert_fuses_once(accumulate, k):
    """`out[rows] += w * expert_e(x[rows])`: a token's k <= 2 slots add in either order to the same value."""
    module = WhereLoop(weight="after", accumulate=accumulate, n_experts=4, k=k).eval()
    args = _routing(k=k, n_experts=4)
    fused, out, ref = _outputs(module, args, fullgraph=True)
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    assert fused.report.matches("mega_moe")[0].spec["weight_at"] == "after"
    graph = fused.post_grad_graphs[-1]
    for gone in ("aten.nonzero", "aten.mm", "aten.index_put", "_assert_scalar", "aten.eq"):
        assert gone not in graph, gone
    exact = _fp64(module, args)
    assert (out.double() - exact).abs().max() <= 2.0**-20 * exact.abs().max()
    assert (out - ref).abs().max() <= 2.0**-20 * ref.abs().max()


# ---- spellings that do not fuse, each with its reason ------------------------------------------------------

@pytest.mark.parametrize("module, reason", [
    (lambda: DenseMaskLoop(weight="before", n_experts=4), "a dense loop over the experts"),
    (lambda: DenseMaskLoop(weight="after", n_experts=4), "a dense loop over the experts"),
    (lambda: WhereLoop(weight="before", k=3, n_experts=4), "sums each token's k = 3 slots in expert order"),
    (lambda: WhereLoop(weight="after", k=3, n_experts=4), "sums each token's k = 3 slots in expert order"),
    (lambda: HFStyleGrouped(act="bf16", limit=10.01), "with a limit 10.01 that is no bf16 value"),
])
def test_near_misses_stay_unfused_with_the_reason(module, reason):
    module = module().eval()
    args = _routing(k=module.k, n_experts=module.n_experts)
    fused, out, ref = _outputs(module, args, fullgraph=True)
    assert fused.report.counts() == {"mega_moe": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_moe")]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert "megafuse.mega_moe" not in fused.post_grad_graphs[-1]
    assert torch.equal(out, ref)  # the graph is left as it was


def test_the_where_loop_without_fullgraph_breaks_the_graph_and_the_report_says_so():
    """torch.where(ids == e) has a data-dependent row count: without fullgraph=True Dynamo breaks the
    graph inside the loop, runs the loop eagerly and compiles only the SwiGLU's own frame."""
    module = WhereLoop(weight="before", n_experts=4).eval()
    fused, out, ref = _outputs(module, _routing(n_experts=4))
    assert fused.report.counts() == {"mega_moe": 0}
    reasons = {r.reason for r in fused.report.rejections("mega_moe")}
    assert reasons and all(LONE in r for r in reasons), reasons
    assert all("aten.mm" not in g and "aten.nonzero" not in g for g in fused.post_grad_graphs)
    assert torch.equal(out, ref)


# ---- HF transformers' DeepseekV4 experts -------------------------------------------------------------------

def _hf_experts(implementation, dtype):
    hf = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    cfg = hf.DeepseekV4Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    cfg._experts_implementation = implementation
    torch.manual_seed(0)
    module = DeepseekV4Experts(cfg).eval()
    torch.nn.init.normal_(module.gate_up_proj, std=0.125)
    torch.nn.init.normal_(module.down_proj, std=0.18)
    return module.to(dtype)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_deepseek_v4_experts_fuse_once_with_the_weight_after_the_down_projection(implementation, dtype):
    """fp32: grouped_mm dispatches to transformers' opaque grouped_mm_fallback under compile, the same
    grouped product; bf16: torch._grouped_mm / bmm write bf16, `_apply_gate` rounds each op to bf16, the
    product down * w is bf16 (bf16 routing weights, widened exactly by the rewrite) and the sum
    accumulates in fp32 and rounds once. Every rounding point is the kernel's, so bf16 agrees to a
    bf16 step only where a value sits on a tie, fp32 to summation order (D = 64, F = 32 terms)."""
    module = _hf_experts(implementation, dtype)
    u, weights, ids = _routing()
    fused, out, ref = _outputs(module, (u.to(dtype), ids, weights.to(dtype)), fullgraph=True)
    assert fused.report.counts() == {"mega_moe": 1}, fused.report.rejections("mega_moe")
    spec = fused.report.matches("mega_moe")[0].spec
    name = str(dtype).removeprefix("torch.")
    assert (spec["weight_at"], spec["weighted_dtype"], spec["swiglu_dtype"], spec["out_dtype"]) == (
        "after", name, name, name)
    graph = fused.post_grad_graphs[-1]
    for gone in ("grouped_mm", "aten.bmm", "aten.sort", "aten.histc"):
        assert gone not in graph, gone
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-18
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


def test_hf_deepseek_v4_eager_experts_loop_cannot_be_captured_and_the_report_says_so():
    module = _hf_experts("eager", torch.float32)
    u, weights, ids = _routing()
    # fullgraph: Dynamo cannot unroll `for expert_idx in hit` over a tensor of data-dependent length
    with pytest.raises(Exception, match="data-dependent"):
        with torch.no_grad():
            fuse(module, ["mega_moe"], fullgraph=True)(u, ids, weights)
    # without: the loop runs eagerly; only `_apply_gate` compiles, and the report names the break
    fused, out, ref = _outputs(module, (u, ids, weights))
    assert fused.report.counts() == {"mega_moe": 0}
    reasons = {r.reason for r in fused.report.rejections("mega_moe")}
    assert reasons and all(LONE in r for r in reasons), reasons
    assert torch.equal(out, ref)


@pytest.mark.slow  # a whole model
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_deepseek_v4_model_every_moe_layer_fuses_and_the_logits_equal_the_unfused_graph(dtype):
    """Every MoE layer fuses, the two hash-routed ones too: their ids come from a table lookup, the
    experts' chain after it is the same. bf16 bound: the experts round each slot's value at about 8
    points (u, gate_up, min(g, L), silu, clamp(v), act, down, down * w) and the sum once; a value on a
    rounding tie moves one bf16 step (2^-8 relative) and that difference travels through the
    layers, so the logits agree to a few bf16 steps of their scale; fp32: summation order."""
    pytest.importorskip("transformers")
    from tests.passes.test_mega_gate_models import _hf_model
    model = _hf_model(sharp_routers=True).to(dtype)  # sharp: no bf16 tie in the top-k (its order is open)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    fused, unfused = fuse(model, ["mega_moe"], fullgraph=True), fuse(model, "none", fullgraph=True)
    with torch.no_grad():
        logits = fused(ids, use_cache=False).logits.float()
        ref = unfused(ids, use_cache=False).logits.float()
    assert fused.report.counts() == {"mega_moe": model.config.num_hidden_layers}, fused.report.rejections("mega_moe")
    assert fused.report.rejections("mega_moe") == []
    assert "grouped_mm" not in "\n".join(fused.post_grad_graphs)
    tol = 4 * 2.0**-8 if dtype == torch.bfloat16 else 2.0**-16
    assert (logits - ref).abs().max() <= tol * ref.abs().max()
