"""Mega-Gate pass: exact match counts, the unfused ops gone, equality with the unfused chain,
near misses left alone with the reason."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from megafuse import passes
from megafuse.lowering import mega_gate as gate_lowering
from torch._inductor import config as inductor_config
from tests.passes.gate_clients import BiasInWeights, GateChain, MixtralRouter, SoftmaxAfterTopk, TopkOverTokens
from tests.passes.online_softmax import ONLINE_SOFTMAX
from tests.passes.post_grad import fuse


def _compile(module, tmp_path, which=("mega_gate",)):
    torch._dynamo.reset()
    return passes.compile(module, passes=which, dump_dir=tmp_path, fullgraph=True)


def _after_graph(tmp_path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("graph*_mega_gate_after.txt")))


def _assert_same_routing(got, ref, *, rtol, choice=None, tie_rtol=0.0):
    """Same experts in every row, except rows where the reference's k-th and (k+1)-th choices tie
    (torch.topk leaves tie order open). Ties are exact in fp32; with bf16 logits they are ties at
    bf16 resolution (`tie_rtol`): the kernel and torch accumulate the GEMM in different orders, so a
    logit can round to the neighbouring bf16 value. Weights within rtol on the rows that agree."""
    (w, ids), (w_ref, ids_ref) = got, ref
    order, order_ref = ids.argsort(-1), ids_ref.argsort(-1)
    same = (ids.gather(-1, order) == ids_ref.gather(-1, order_ref)).all(-1)
    if choice is not None and choice.shape[-1] > ids.shape[-1]:
        top = choice.topk(ids.shape[-1] + 1, dim=-1).values
        tied = (top[:, -2] - top[:, -1]).abs() <= tie_rtol * top[:, -2].abs()
        assert (same | tied).all(), "selection differs on a row without a tie"
    else:
        assert same.all(), "selection differs"
    w_s, w_ref_s = w.float().gather(-1, order)[same], w_ref.float().gather(-1, order_ref)[same]
    assert ((w_s - w_ref_s).norm() / w_ref_s.norm()).item() <= rtol


def _choice(module, u):
    """The biased choice the chain selects on, recomputed the way the module does."""
    logits = torch.nn.functional.linear(u.to(module.gemm_dtype), module.weight.to(module.gemm_dtype)).float()
    scores = {"sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
              "softmax": lambda x: x.softmax(-1)}[module.score_func](logits)
    return scores + module.bias if module.bias is not None else scores


VARIANTS = list(itertools.product(["sqrtsoftplus", "sigmoid", "softmax"], [True, False], ["eps", "plain", None]))


@pytest.mark.parametrize("score_func, bias, renorm", VARIANTS)
def test_every_fp32_variant_matches_once_and_equals_the_chain(tmp_path, score_func, bias, renorm):
    scale = 1.5 if renorm != "plain" else None  # both scale forms appear across the grid
    module = GateChain(score_func=score_func, bias=bias, renorm=renorm, scale=scale)
    u = torch.randn(33, 64, generator=torch.Generator().manual_seed(len(VARIANTS)))
    fused = _compile(module, tmp_path)
    out = fused(u)
    assert fused.report.counts() == {"mega_gate": 1}
    after = _after_graph(tmp_path)
    assert "megafuse.mega_gate" in after
    for gone in ("aten.topk", "aten.gather", "aten.mm", "aten.sigmoid", "aten.sqrt", "aten.amax"):
        assert gone not in after, gone
    match = fused.report.matches("mega_gate")[0]
    assert match.spec["score_func"] == score_func and match.spec["has_bias"] == bias
    assert match.spec["renorm"] == (renorm is not None)
    assert match.spec["renorm_eps"] == (1e-20 if renorm == "eps" else 0.0)
    assert match.spec["scale"] == (scale or 1.0)
    _assert_same_routing(out, module(u), rtol=1e-5, choice=_choice(module, u))


def test_the_gate_fuses_on_a_symbolic_token_count(tmp_path):
    # the runtime's compiled step marks its row counts dynamic: one graph, one match, any T >= 2
    module = GateChain(score_func="sqrtsoftplus", bias=True, renorm="eps", scale=1.5)
    fused = _compile(module, tmp_path)
    for T in (33, 5, 2):
        u = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
        torch._dynamo.mark_dynamic(u, 0)
        _assert_same_routing(fused(u), module(u), rtol=1e-5, choice=_choice(module, u))
    assert len(fused.report.graphs) == 1 and fused.report.counts() == {"mega_gate": 1}
    assert "aten.topk" not in _after_graph(tmp_path)


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax"])
def test_a_frozen_gate_fuses_too(tmp_path, score_func):
    # Inductor's freezing (inference) makes the gate weight a constant and folds its transpose
    # (on CPU with weight prepacking, the default, the GEMM becomes MKL's linear): the pass takes
    # the weight from the constant and fuses as without freezing
    module = GateChain(score_func=score_func, bias=True, renorm="eps", scale=1.5).eval()
    u = torch.randn(33, 64, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(freezing=True):
        fused = passes.compile(module, passes=["mega_gate"], dump_dir=tmp_path, fullgraph=True)
        out = fused(u)
        ref = module(u)
    assert fused.report.counts() == {"mega_gate": 1}, fused.report.rejections("mega_gate")
    before = "\n".join(p.read_text() for p in sorted(tmp_path.glob("graph*_mega_gate_before.txt")))
    assert "get_attr[target=_frozen_param" in before
    after = _after_graph(tmp_path)
    assert "megafuse.mega_gate" in after and "get_attr[target=_megafuse_gate_weight" in after
    for gone in ("aten.topk", "aten.mm", "_mkl_linear", "aten.sqrt", "aten.amax"):
        assert gone not in after, gone
    _assert_same_routing(out, ref, rtol=1e-5, choice=_choice(module, u))


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax"])
def test_bf16_gemm_inputs(tmp_path, score_func):
    module = GateChain(score_func=score_func, gemm_dtype=torch.bfloat16)
    u = torch.randn(17, 64, generator=torch.Generator().manual_seed(3))
    fused = _compile(module, tmp_path)
    out = fused(u)
    assert fused.report.counts() == {"mega_gate": 1}
    spec = fused.report.matches("mega_gate")[0].spec
    # the chain rounds u and W to bf16 for its GEMM: the kernel reads them so (a bf16 dot)
    assert spec["logits_dtype"] == spec["input_dtype"] == spec["weight_dtype"] == "bfloat16"
    _assert_same_routing(out, module(u), rtol=1e-2, choice=_choice(module, u), tie_rtol=2 ** -7)


@pytest.mark.parametrize("n_experts, k", [(7, 1), (6, 6), (48, 5)])
def test_odd_expert_counts_and_extreme_k(tmp_path, n_experts, k):
    module = GateChain(n_experts=n_experts, k=k, hidden=32)
    u = torch.randn(9, 32)
    fused = _compile(module, tmp_path)
    out = fused(u)
    assert fused.report.counts() == {"mega_gate": 1}
    _assert_same_routing(out, module(u), rtol=1e-5)


def test_mixtral_style_router_matches(tmp_path):
    module = MixtralRouter()
    u = torch.randn(20, 64)
    fused = _compile(module, tmp_path)
    out = fused(u)
    assert fused.report.counts() == {"mega_gate": 1}
    assert fused.report.matches("mega_gate")[0].spec["score_func"] == "softmax"
    _assert_same_routing(out, module(u), rtol=1e-5)


class Bf16Scores(GateChain):
    """A model cast to bf16 whose router scores in bf16 (HF's DeepseekV4 after .to(bfloat16))."""

    def forward(self, u):
        scores = F.softplus(F.linear(u, self.weight)).sqrt()  # softplus, then sqrt: two bf16 roundings
        ids = torch.topk(scores + self.bias, self.k, dim=-1).indices
        weights = scores.gather(-1, ids)
        return weights / (weights.sum(-1, keepdim=True) + 1e-20), ids

    def choice(self, u):
        return F.softplus(F.linear(u, self.weight)).sqrt() + self.bias


def test_scores_computed_in_bf16_fuse_and_round_where_the_chain_rounds(tmp_path):
    module = Bf16Scores().to(torch.bfloat16)
    u = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    fused = fuse(module, ["mega_gate"], fullgraph=True)
    with torch.no_grad():
        out, ref, choice = fused(u), module(u), module.choice(u)
    assert fused.report.counts() == {"mega_gate": 1}
    spec = fused.report.matches("mega_gate")[0].spec
    assert (spec["bias_dtype"], spec["logits_dtype"], spec["score_dtype"], spec["choice_dtype"]) == ("bfloat16",) * 4
    # bf16 choices tie often; only exactly tied rows may differ (torch.topk's tie order is open)
    _assert_same_routing(out, ref, rtol=1e-2, choice=choice.float(), tie_rtol=0.0)


def test_a_softmax_written_out_in_bf16_stays_unfused_with_the_reason():
    class SpelledBf16Softmax(GateChain):
        def forward(self, u):
            logits = F.linear(u, self.weight)
            e = torch.exp(logits - logits.amax(-1, keepdim=True))  # each step rounds to bf16
            scores = e / e.sum(-1, keepdim=True)
            ids = torch.topk(scores, self.k, dim=-1).indices
            return scores.gather(-1, ids), ids

    fused = fuse(SpelledBf16Softmax().to(torch.bfloat16), ["mega_gate"], fullgraph=True)
    with torch.no_grad():
        fused(torch.randn(8, 64).bfloat16())
    assert fused.report.counts() == {"mega_gate": 0}
    assert "rounds after every step" in fused.report.rejections("mega_gate")[0].reason


def test_inputs_the_launcher_would_refuse_stay_unfused_at_compile_time(monkeypatch):
    # check() runs the launcher's own input checks on the match's fake tensors: what it refuses
    # is a rejection with its reason, never a run-time error of the compiled graph
    def refuse(u, weight, bias, spec):
        raise ValueError(f"mega_gate: bias must be float32 [{spec.n_experts}], got {bias.dtype}")

    monkeypatch.setattr(gate_lowering, "validate", refuse)
    module = GateChain(score_func="sigmoid")
    u = torch.randn(5, 64)
    fused = fuse(module, ["mega_gate"], fullgraph=True)
    with torch.no_grad():
        out, ref = fused(u), module(u)
    assert fused.report.counts() == {"mega_gate": 0}
    assert fused.report.rejections("mega_gate")[0].reason == "mega_gate: bias must be float32 [24], got torch.float32"
    assert torch.equal(out[1], ref[1])


def test_the_online_softmax_of_triton_graphs_fuses():
    module = GateChain(score_func="softmax", bias=False, renorm="plain", scale=None)
    u = torch.randn(9, 64, generator=torch.Generator().manual_seed(2))
    fused, unfused = fuse(module, ["mega_gate"], fullgraph=True), fuse(module, "none", fullgraph=True)
    with torch.no_grad(), inductor_config.patch(ONLINE_SOFTMAX):
        out = fused(u)
        unfused(u)
    assert "prepare_softmax_online" in unfused.post_grad_graphs[0]
    assert "prepare_softmax_online" not in fused.post_grad_graphs[0]
    assert fused.report.counts() == {"mega_gate": 1}
    _assert_same_routing(out, module(u), rtol=1e-5, choice=_choice(module, u))


@pytest.mark.parametrize("module, reason", [
    (BiasInWeights(bias=True), "bias also enters the weights"),
    (TopkOverTokens(), "not the expert dimension"),
    (SoftmaxAfterTopk(), "not a gate score"),
])
def test_near_misses_are_not_matched_and_say_why(tmp_path, module, reason):
    u = torch.randn(16, 64)
    fused = _compile(module, tmp_path)
    out = fused(u)
    assert fused.report.counts() == {"mega_gate": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_gate")]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert "aten.topk" in _after_graph(tmp_path)
    ref = module(u)
    assert all(torch.equal(a, b) for a, b in zip(out[1:], ref[1:]))


def test_disabled_pass_leaves_the_chain(tmp_path):
    module = GateChain()
    fused = _compile(module, tmp_path, which="none")
    fused(torch.randn(4, 64))
    assert fused.report.counts() == {}
    assert not list(tmp_path.glob("*mega_gate*"))


def test_debug_hook_explains_a_node(tmp_path, capsys):
    torch._dynamo.reset()
    fused = passes.compile(TopkOverTokens(), passes=["mega_gate"], debug_nodes=["topk"], fullgraph=True)
    fused(torch.randn(8, 64))
    assert "not the expert dimension" in fused.report.why("topk")["mega_gate"]
    assert "[megafuse debug] mega_gate at topk" in capsys.readouterr().err
