"""Mega-mHC pass: every seam form matches and equals the chain; exact counts on whole models."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from megafuse import passes
from torch._inductor import config as inductor_config
from megafuse.model import build_model
from megafuse.model.layers import RMSNorm
from megafuse.model.mhc import HyperConnection, hc_post, hc_pre
from tests.marks import slow_beyond
from tests.passes.cuda_forms import CUDA_FORMS, TORCH_2_11_FORMS
from tests.passes.online_softmax import ONLINE_SOFTMAX
from tests.passes.post_grad import fuse
from tests.passes.tiny import compile_tiny, every_role_tiny

N, D = 4, 64


class Seam(nn.Module):
    """One mHC seam written with the model's functions, in any of the forms the pass handles."""

    def __init__(self, form: str, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.form, self.dtype = form, dtype
        self.site = HyperConnection(N, D, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20)
        self.site.base.data += torch.randn(24) * 0.5
        self.norm = RMSNorm(D, 1e-20)
        self.norm.weight.data.uniform_(0.5, 1.5)

    def forward(self, X, y, post, comb, carried):
        if self.form in ("delayed", "final", "fresh"):
            X = hc_post(y, X, post, comb)
        if self.form == "engram":  # something other than a post produces the stream
            X = (X.float() * 1.01 + y.float().unsqueeze(-2) * 0.1).to(X.dtype)
        if self.form == "final":
            return X, self.norm(hc_pre(X, carried))
        pre, post_next, comb_next = self.site(X)
        u = self.norm(hc_pre(X, pre if self.form == "fresh" else carried))
        return X, u, pre, post_next, comb_next


def _inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    comb = torch.softmax(torch.randn(T, N, N, generator=g), -1)
    comb = comb / comb.sum(-2, keepdim=True)
    carried = torch.rand(T, N, generator=g) + 0.5
    return (torch.randn(T, N, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype),
            2 * torch.rand(T, N, generator=g), comb, carried)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("form", ["delayed", "first", "engram", "final", "fresh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softmax", ["decomposed", "online"])
def test_every_seam_form_matches_and_equals_the_chain(tmp_path, form, dtype, softmax):
    module = Seam(form, dtype)
    args = _inputs(7, dtype)
    torch._dynamo.reset()
    options = ONLINE_SOFTMAX if softmax == "online" else {}  # the graph CUDA gives the pass
    fused = passes.compile(module, passes=["mega_mhc"], dump_dir=tmp_path, fullgraph=True, options=options)
    out = fused(*args)
    ref = module(*args)
    assert fused.report.counts() == {"mega_mhc": 1}, fused.report.rejections("mega_mhc")
    spec = fused.report.matches("mega_mhc")[0].spec
    assert spec["has_post"] == (form in ("delayed", "final", "fresh"))
    assert spec["has_coefficients"] == (form != "final")
    assert spec["pre"] == ("fresh" if form == "fresh" else "carried")
    if form == "engram":
        assert "stays unfused" in spec["left_unfused"][0]
    if spec["has_coefficients"]:
        assert spec["sinkhorn_iters"] == 20 and spec["hc_eps"] == 1e-6
    before = (tmp_path / "graph000_mega_mhc_before.txt").read_text()
    assert before.count("prims.prepare_softmax_online") == (softmax == "online" and form != "final")
    after = (tmp_path / "graph000_mega_mhc_after.txt").read_text()
    for gone in ("aten.rsqrt", "aten.sigmoid", "aten.bmm", "aten.amax", "prepare_softmax_online"):
        if form != "engram" or gone != "aten.bmm":
            assert gone not in after, gone
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(out, ref):
        assert _rel(got, want) <= tol


@pytest.mark.parametrize("form", slow_beyond(["delayed", "first", "engram", "final", "fresh"]))
def test_every_seam_form_fuses_on_a_symbolic_token_count(form):
    # the runtime's compiled step marks its row counts dynamic (and only those): one graph, one
    # match, any T >= 2
    module = Seam(form)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True)
    for T in (7, 13, 2):
        args = _inputs(T, torch.float32, seed=T)
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        for got, want in zip(fused(*args), module(*args)):
            assert _rel(got, want) <= 1e-5
    assert len(fused.report.graphs) == 1
    assert fused.report.counts() == {"mega_mhc": 1}, fused.report.rejections("mega_mhc")


@pytest.mark.parametrize("T", [1, 5])  # T = 1: the post's mix is an mm (Inductor's bmm_to_mm on GPUs)
def test_a_final_collapse_of_unrounded_streams_is_refused_with_the_reason_not_silently(T):
    # torch 2.11's Inductor drops the bf16 round trips of X' and of c (TORCH_2_11_FORMS): the
    # collapse then reads X' in fp32, another function than the seam's; the report says so
    module, args = Seam("final", torch.bfloat16), _inputs(T, torch.bfloat16)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True, options=dict(TORCH_2_11_FORMS))
    out = fused(*args)
    assert fused.report.counts() == {"mega_mhc": 0}
    assert [r.reason for r in fused.report.rejections("mega_mhc")] == [
        "the collapse reads X' unrounded (float32), where the seam rounds X' to bfloat16 first"]
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-2


def test_a_chain_whose_readers_take_another_dtype_stays_unfused_with_the_reason(monkeypatch):
    # A graph that reads u in fp32 where the seam rounds it to bf16 (seen on torch 2.11, whose
    # Inductor drops a bf16 round trip: tests/passes/cuda_forms.py) computes another function, and
    # the fused op's bf16 u would reach readers compiled for fp32: check() refuses it, with why.
    from megafuse.passes.mega_mhc import MegaMhcPass
    match = MegaMhcPass.match

    def reads_u_in_fp32(self, anchor):
        candidate = match(self, anchor)
        u = candidate.outputs["u"]
        u.meta["val"] = u.meta["val"].float()
        return candidate

    monkeypatch.setattr(MegaMhcPass, "match", reads_u_in_fp32)
    module, args = Seam("final", torch.bfloat16), _inputs(5, torch.bfloat16)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True)
    out = fused(*args)
    assert fused.report.counts() == {"mega_mhc": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_mhc")]
    assert reasons and all(r.startswith("the graph reads the seam's u (") and r.endswith(
        "in float32, where the fused seam gives bfloat16") for r in reasons), reasons
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-2  # (plain Inductor: bf16 roundings of its own)


def _hf_order_seam():
    """A bf16 seam whose projection reads x * r (HF's order), at T = 1."""
    from tests.passes.mhc_spellings import Spelling, SpelledSeam
    module = SpelledSeam(Spelling(T=1, stream_dtype="bfloat16", r_at="before"), dim=D)
    return module, module.inputs()


@pytest.mark.parametrize("form", ["delayed", "fresh", "hf_order"])
def test_a_seam_whose_projection_inductor_padded_fuses_whole(form):
    # On GPUs Inductor zero-pads an unaligned GEMM (pad_mm): at T = 1 the fn projection reads
    # constant_pad_nd(x) and its output is sliced back (tests/passes/cuda_forms.py does it here).
    # The pass puts the GEMM back unpadded, erases the padded one (its padding would read the
    # stream outside the seam) and the seam fuses whole; the padding and the slices go.
    if form == "hf_order":
        module, args = _hf_order_seam()
    else:
        module, args = Seam(form, torch.bfloat16), _inputs(1, torch.bfloat16, seed=3)
    with torch.no_grad(), inductor_config.patch(CUDA_FORMS):
        fused = fuse(module, ["mega_mhc"], fullgraph=True)
        out = fused(*args)
    [after] = fused.post_grad_graphs
    assert fused.report.counts() == {"mega_mhc": 1}, fused.report.rejections("mega_mhc")
    assert fused.report.matches("mega_mhc")[0].spec["has_coefficients"]
    for gone in ("aten.constant_pad_nd", "aten.mm", "aten.slice"):
        assert gone not in after, gone
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-2


def test_a_final_collapse_at_one_token_fuses_where_inductor_made_its_mix_an_mm(tmp_path):
    # at T = 1 a GPU's Inductor rewrites the post's bmm C^T X (batch 1) as
    # mm(C.squeeze(0), X.squeeze(0)).unsqueeze(0): no coefficient head reads X', so the final
    # collapse is found from its mix, which must be looked for among mms too
    module, args = Seam("final", torch.bfloat16), _inputs(1, torch.bfloat16, seed=3)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True, dump_dir=tmp_path, options=dict(CUDA_FORMS))
    out = fused(*args)
    before = (tmp_path / "graph000_mega_mhc_before.txt").read_text()
    after = (tmp_path / "graph000_mega_mhc_after.txt").read_text()
    assert "aten.mm" in before and "aten.bmm" not in before  # the premise: the mix is an mm
    assert fused.report.counts() == {"mega_mhc": 1}, fused.report.rejections("mega_mhc")
    spec = fused.report.matches("mega_mhc")[0].spec
    assert spec["has_post"] and not spec["has_coefficients"]  # the final collapse
    for gone in ("aten.mm", "aten.rsqrt"):
        assert gone not in after, gone
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-2


def _frozen_seam(form, dump_dir):
    """Seam(form) compiled under Inductor's freezing: (report, graph before, graph after, max rel err)."""
    module = Seam(form, torch.bfloat16).eval()
    args = _inputs(7, torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(freezing=True):
        fused = passes.compile(module, passes=["mega_mhc"], dump_dir=dump_dir, fullgraph=True)
        out = fused(*args)
        ref = module(*args)
    before = (dump_dir / "graph000_mega_mhc_before.txt").read_text()
    after = (dump_dir / "graph000_mega_mhc_after.txt").read_text()
    return fused.report, before, after, max(_rel(got, want) for got, want in zip(out, ref))


@pytest.mark.parametrize("form", ["delayed", "first", "final", "fresh"])
def test_every_seam_form_fuses_whole_under_inductor_freezing(tmp_path, form):
    # torch._inductor.config.freezing (inference): the weights become constants and Inductor folds
    # what reads only them: fn's transpose (on CPU with weight prepacking, the default, the whole
    # projection becomes MKL's linear), base's split and scale's selects. The seam still fuses
    # whole: the pass rebuilds fn, base and scale as constants the kernel reads (made once, at
    # compile time). (Which projection Inductor emits is fixed by the process's first freezing
    # compile; the mm of a GPU, or of CPU without prepacking, is the next test.)
    report, before, after, err = _frozen_seam(form, tmp_path)
    assert report.counts() == {"mega_mhc": 1}, report.rejections("mega_mhc")
    assert report.matches("mega_mhc")[0].spec["has_coefficients"] == (form != "final")
    if form != "final":
        assert "get_attr[target=_frozen_param" in before and before.count("aten.split_with_sizes") == 1  # folded
        for constant in ("_megafuse_fn", "_megafuse_base", "_megafuse_scale"):
            assert f"get_attr[target={constant}" in after, constant
        # bf16 streams: fn's bf16 pieces too, made once (lowering.mega_mhc.split_fn), the op's last
        # argument; the outputs below then come from a kernel that loaded them
        [call] = [line for line in after.splitlines() if "megafuse.mega_mhc.default" in line]
        assert "get_attr[target=_megafuse_fn_pieces" in after and "_megafuse_fn_pieces" in call.split("args = (")[1]
    else:
        assert "_megafuse_fn_pieces" not in after
    for gone in ("aten.rsqrt", "aten.sigmoid", "aten.bmm", "aten.amax", "_mkl_linear", "aten.mm"):
        assert gone not in after, gone
    assert err <= 1e-2


@pytest.mark.slow
def test_a_frozen_projection_as_mm_fuses_too():
    # freezing without weight prepacking, as on a GPU (in a fresh process: Inductor registers its
    # prepacking patterns once, at the first freezing compile): fn^T, and the gate's W^T, are
    # folded constants read by aten.mm
    code = """if True:
        import pathlib, sys, tempfile, torch
        from torch._inductor import config
        config.cpp.weight_prepack = False
        from megafuse import passes
        from tests.passes.gate_clients import GateChain
        from tests.passes.test_mega_mhc import _frozen_seam
        report, before, after, err = _frozen_seam("delayed", pathlib.Path(tempfile.mkdtemp()))
        ok = (report.counts() == {"mega_mhc": 1} and "aten.mm" in before and "_mkl_linear" not in before
              and "aten.mm" not in after and "get_attr[target=_megafuse_fn" in after and err <= 1e-2)
        gate = GateChain(score_func="sigmoid", bias=True, renorm="eps", scale=1.5).eval()
        u = torch.randn(33, 64)
        torch._dynamo.reset()
        with torch.no_grad(), config.patch(freezing=True):
            fused = passes.compile(gate, passes=["mega_gate"], fullgraph=True)
            ids, ref_ids = fused(u)[1], gate(u)[1]
        ok = ok and fused.report.counts() == {"mega_gate": 1} and torch.equal(ids.sort(-1).values,
                                                                            ref_ids.sort(-1).values)
        print(report.counts(), err, fused.report.counts())
        sys.exit(0 if ok else 1)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_a_plain_residual_add_is_not_a_seam(tmp_path):
    class NotASeam(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(D, 1e-20)

        def forward(self, X, y):
            return self.norm((X.float().sum(-2) + y).to(X.dtype))

    torch._dynamo.reset()
    fused = passes.compile(NotASeam(), passes=["mega_mhc"], fullgraph=True)
    fused(torch.randn(3, N, D), torch.randn(3, D))
    assert fused.report.counts() == {"mega_mhc": 0}


def test_a_collapse_whose_pre_is_computed_from_its_own_stream_is_refused():
    # A post, then a collapse + norm whose "carried" pre is computed from the post's own output:
    # fusing it would make the fused op its own ancestor (on the H200 this shape came from a V4
    # site whose coefficient head went unrecognised, and stopped the compile). Refused, with why.
    class SelfPre(Seam):
        def forward(self, X, y, post, comb, carried):
            X = hc_post(y, X, post, comb)
            pre = torch.sigmoid(X.float().sum(-1))
            return X, self.norm(hc_pre(X, pre))

    module = SelfPre("final")
    args = _inputs(7, torch.float32)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True)
    out = fused(*args)
    assert fused.report.counts() == {"mega_mhc": 0}
    (rejection,) = fused.report.rejections("mega_mhc")
    assert "['carried_pre'] are computed from the seam itself" in rejection.reason, rejection.reason
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-5


@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float16])
def test_a_seam_whose_y_is_narrower_than_its_streams(y_dtype):
    # torch 2.11 folds X''s round trip through bf16 away when only an upcast reads it (Inductor's
    # pointless_convert; 2.13 keeps narrowing round trips), which leaves the proxy model's final
    # collapse with fp32 streams and a bf16 y: seen on the H200. The kernel widens y from any
    # stream dtype it takes (fp32, bf16, fp16).
    module = Seam("final", torch.float32)
    X, y, post, comb, carried = _inputs(7, torch.float32)
    args = (X, y.to(y_dtype), post, comb, carried)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True)
    out = fused(*args)
    assert fused.report.counts() == {"mega_mhc": 1}, fused.report.rejections("mega_mhc")
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-5


@pytest.mark.slow  # a whole model
def test_tiny_every_site_and_the_final_collapse(tmp_path):
    cfg, model, ids, fused, logits = compile_tiny(["mega_mhc"], 12, dump_dir=tmp_path)
    # Two sites per layer (attention, FFN), each one seam, plus the final collapse before the norm.
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1}
    specs = [m.spec for m in fused.report.matches("mega_mhc")]
    # no post before the first site and before the attention sites of the Engram layers
    assert sum(not s["has_post"] for s in specs) == 1 + len(cfg.engram_layers)
    assert sum(not s["has_coefficients"] for s in specs) == 1
    after = (tmp_path / "graph000_mega_mhc_after.txt").read_text()
    assert after.count("megafuse.mega_mhc.default") == 2 * cfg.n_layers + 1
    # no coefficient head survives (its [n, n, n*n] split), and only the posts in front of an
    # Engram injection stay unfused, which the report says
    assert not re.search(r"split_with_sizes.default\]\(args = \(%\w+, \[4, 4, 16\]", after)
    notes = [s["left_unfused"] for s in specs if "left_unfused" in s]
    assert len(notes) == 1 + len(cfg.engram_layers)
    torch._dynamo.reset()
    unfused = passes.compile(model, passes="none", fullgraph=True)(ids)
    assert (logits - unfused).abs().max().item() <= 1e-4


@pytest.mark.slow  # a whole model
def test_tiny_with_cudas_online_softmax_every_site_still_fuses(tmp_path):
    # On CUDA, Inductor rewrites each Sinkhorn's softmax into prims.prepare_softmax_online before
    # the passes run; on the H200 that once left 24 of tiny's 25 seams unfused.
    cfg, model, ids, fused, logits = compile_tiny(["mega_mhc"], 12, dump_dir=tmp_path, options=ONLINE_SOFTMAX)
    before = (tmp_path / "graph000_mega_mhc_before.txt").read_text()
    assert before.count("prims.prepare_softmax_online.default](") == 2 * cfg.n_layers  # one per site
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1}, fused.report.rejections("mega_mhc")
    assert "prepare_softmax_online" not in (tmp_path / "graph000_mega_mhc_after.txt").read_text()
    assert (logits - model(ids)).abs().max().item() <= 1e-4


@pytest.mark.slow  # a whole model
def test_tiny_cast_to_bf16_fuses_every_seam_and_gate_and_equals_the_eager_model():
    # model.to(torch.bfloat16), all passes: bf16 streams, and bf16 fn, base, scale and norm weights,
    # which the rewrite widens (exact); the seams are the fp32 model's, whole. The gate weight and
    # bias are bf16 while route() scores in fp32: the kernel reads the bf16 tensors (no run-time
    # dtype error). Run from the post-grad graph (tests/passes/post_grad.py), so the only
    # difference from eager is the fused kernels.
    cfg = every_role_tiny(quant="none")
    model = build_model(cfg, seed=0).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = fuse(model, "all", fullgraph=True)
        logits, want = fused(ids), model(ids)
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1, "mega_gate": cfg.n_layers,
                                      "mega_attention": cfg.n_layers, "mega_moe": cfg.n_layers,
                                      "mega_indexer": 0}, \
        [(r.anchor, r.reason) for name in fused.report.counts() for r in fused.report.rejections(name)]
    specs = [m.spec for m in fused.report.matches("mega_mhc")]
    assert all(s["stream_dtype"] == "bfloat16" for s in specs)
    assert sum(s["has_coefficients"] for s in specs) == 2 * cfg.n_layers
    assert sum(not s["has_post"] for s in specs) == 1 + len(cfg.engram_layers)  # first seam, Engram seams
    gate = fused.report.matches("mega_gate")[0].spec
    assert (gate["input_dtype"], gate["weight_dtype"], gate["bias_dtype"]) == ("bfloat16",) * 3
    assert _rel(logits, want) <= 1e-2


def _needs_hf_deepseek_v4():
    """Skip the calling test where transformers, or its DeepseekV4 port, is not installed: only the
    tests of HF's model need it."""
    pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


@pytest.mark.slow  # a whole model
def test_hf_deepseek_v4_fires_at_every_hyper_connection_site():
    _needs_hf_deepseek_v4()
    from tests.passes.test_mega_gate_models import _hf_model

    model = _hf_model()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    fused = passes.compile(model, passes=["mega_mhc"])
    logits = fused(ids, use_cache=False).logits
    torch._dynamo.reset()
    unfused = passes.compile(model, passes="none")(ids, use_cache=False).logits
    n_layers = model.config.num_hidden_layers
    specs = [m.spec for m in fused.report.matches("mega_mhc")]
    assert len(specs) == 2 * n_layers, fused.report.rejections("mega_mhc")
    assert all(s["pre"] == "fresh" for s in specs)  # V4: each site collapses with its own pre
    assert (logits - unfused).abs().max().item() <= 1e-4


def _llama_style_rms_norm(self, hidden_states):
    """HF's RMSNorm before the DeepseekV4 port kept its weight in fp32 (the transformers on the
    H200): rounded to the input dtype, then weighted."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)


@pytest.mark.slow  # a whole model
@pytest.mark.parametrize("norm", ["fp32_weight", "llama_style"])
def test_hf_deepseek_v4_cast_to_bf16_fuses_every_site_and_says_why_its_posts_stay_unfused(norm, monkeypatch):
    # HF's bf16 post rounds post and comb to bf16 and mixes in bf16: another function than the
    # reference's fp32 post, so each seam fuses without it (coefficients + fresh collapse + norm)
    # and its note says why. The final HyperHead (a pre-only head) is refused, with the reason.
    # Either RMSNorm transformers has had fuses: its roundings are the spec's norm_rounding.
    _needs_hf_deepseek_v4()
    from tests.passes.test_mega_gate_models import _hf_model, hf

    if norm == "llama_style":
        monkeypatch.setattr(hf.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RMSNorm, "forward",
                            _llama_style_rms_norm)
    model = _hf_model().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fused = fuse(model, ["mega_mhc"])
        logits, want = fused(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    specs = [m.spec for m in fused.report.matches("mega_mhc")]
    assert len(specs) == 2 * model.config.num_hidden_layers, fused.report.rejections("mega_mhc")
    assert all(s["pre"] == "fresh" and s["has_coefficients"] and s["stream_dtype"] == "bfloat16" for s in specs)
    assert {s["norm_rounding"] for s in specs} == {"once" if norm == "fp32_weight" else "twice"}
    notes = [s["left_unfused"][0] for s in specs[1:]]  # (the first site has no post before it)
    assert all("the post mixes in bfloat16" in note for note in notes), notes
    assert any("pre-only head" in r.reason for r in fused.report.rejections("mega_mhc"))
    assert _rel(logits, want) <= 1e-2
