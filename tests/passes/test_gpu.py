"""The passes end to end on CUDA: Inductor's generated code calls the generated Triton kernels.

Skipped without CUDA; run on the H200 with `python3 -m pytest tests/passes/test_gpu.py`.
"""

import pytest
import torch

from megafuse import passes
from megafuse.model import build_model, preset
from tests.model.precision import bf16_format_bound, fp64_copy, rel
from tests.passes.gate_clients import GateChain
from tests.passes.test_mega_mhc import Seam, _inputs, _rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_tiny_all_passes_on_cuda_equal_eager():
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=0, device="cuda")
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    torch._dynamo.reset()
    fused = passes.compile(model, passes="all", fullgraph=True)
    logits = fused(ids)
    eager = model(ids)
    err = (logits - eager).abs().max().item()
    print(f"tiny on CUDA, all passes: counts {fused.report.counts()}, max abs error vs eager {err:.2e}")
    for name in passes.available():  # what did not match, and why: the CUDA graph differs from the CPU one
        for rejection in fused.report.rejections(name):
            print(f"  {name} rejected at {rejection.anchor}: {rejection.reason}")
        misses = [f"{node}: {why}" for g in fused.report.graphs for p in g.passes if p.name == name
                  for node, why in p.decisions.items() if not why.startswith("matched")]
        print(f"  {name}: {len(misses)} anchors not matched, e.g. {misses[:6]}")
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1, "mega_gate": cfg.n_layers,
                                      "mega_attention": cfg.n_layers}
    assert err <= 1e-3  # fp32 model; the gate GEMM runs 3xTF32 on CUDA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["delayed", "final", "fresh"])
def test_seam_forms_16_bit_on_cuda(form, dtype):
    module = Seam(form, dtype).cuda()
    args = tuple(a.cuda() for a in _inputs(33, dtype))
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True)
    out = fused(*args)
    assert fused.report.counts() == {"mega_mhc": 1}
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gate_on_cuda_selects_like_the_chain(dtype):
    # a 16-bit model rounds its logits and scores: the kernel rounds where the chain does
    module = GateChain(n_experts=48, hidden=256, k=6, gemm_dtype=dtype).to("cuda", dtype)
    u = torch.randn(300, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_gate"], fullgraph=True)
    (w, ids), (w_ref, ids_ref) = fused(u), module(u)
    assert fused.report.counts() == {"mega_gate": 1}
    rows = (ids.sort(-1).values == ids_ref.sort(-1).values).all(-1)
    if dtype == torch.float32:
        assert rows.all()
    else:  # cuBLAS and the kernel sum the 16-bit GEMM in different orders: a rounded logit may tie
        assert rows.float().mean().item() >= 0.98
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(w[rows].sort(-1).values, w_ref[rows].sort(-1).values) <= tol


def test_gate_repeat_launches_of_a_layout_equal_the_reference():
    # lowering.launch: later calls of a layout launch the first call's build directly; each of
    # five calls on fresh inputs, at each tuned size, selects like the fp32 reference.
    from megafuse.lowering import mega_gate as mg
    spec = mg.GateSpec(n_experts=384, hidden=5120, k=6, score_func="sqrtsoftplus", has_bias=True, renorm=True,
                       renorm_eps=1e-20, scale=1.5, input_dtype="float32", weight_dtype="float32")
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(384, 5120, generator=g) / 5120 ** 0.5).cuda()
    bias = (torch.randn(384, generator=g) * 0.05).cuda()
    mg.forget_kept_launches()
    for T in (1, 64, 512, 4096):
        for _ in range(5):
            u = torch.randn(T, 5120, generator=g).cuda()
            w, ids = mg.mega_gate(u, weight, bias, spec)
            w_ref, ids_ref = mg.reference(u, weight, bias, spec)
            agree = (ids.sort(-1).values == ids_ref.sort(-1).values).all(-1).float().mean().item()
            assert agree >= 0.99, (T, agree)  # 3xTF32 against cuBLAS fp32: near-ties may differ
            rows = (ids.sort(-1).values == ids_ref.sort(-1).values).all(-1)
            assert torch.allclose(w[rows].sort(-1).values, w_ref[rows].sort(-1).values, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("T", [1, 24])  # T = 1: Inductor specialises size-1 dimensions and pads GEMMs
def test_tiny_cast_to_bf16_fuses_every_seam_and_gate_on_cuda(T):
    # the usual serving dtype, as a user gets it: model.to("cuda", torch.bfloat16), all passes
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=0).to("cuda", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).cuda()
    torch._dynamo.reset()
    with torch.no_grad():
        fused = passes.compile(model, passes="all", fullgraph=True)
        logits, eager = fused(ids), model(ids)
        exact = fp64_copy(model)(ids)  # the same bf16 weights, evaluated in fp64
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1, "mega_gate": cfg.n_layers,
                                      "mega_attention": cfg.n_layers}, \
        [(r.anchor, r.reason) for name in passes.available() for r in fused.report.rejections(name)]
    # bf16 is the model's precision, so the compiled model is held to what bf16's rounding allows
    # against the fp64 model, not to eager's rounding noise: 2^-8 for each of the 52 roundings on a
    # logit's path, 20% (precision.bf16_format_bound). Eager meets it too: the bound's premise.
    bound = bf16_format_bound(cfg)
    print(f"tiny bf16 vs fp64 at T={T}: eager {rel(eager, exact):.2e}, compiled {rel(logits, exact):.2e}, "
          f"bound {bound:.2e}")
    assert rel(eager, exact) <= bound
    assert rel(logits, exact) <= bound, (rel(logits, exact), rel(eager, exact))


def test_hf_deepseek_v4_bf16_fuses_every_site_on_cuda():
    hf = pytest.importorskip("transformers")
    if not hasattr(hf, "DeepseekV4Config"):
        pytest.skip(f"transformers {hf.__version__} has no DeepseekV4")
    from tests.passes.test_mega_gate_models import _hf_model
    model = _hf_model(sharp_routers=True).to("cuda", torch.bfloat16)  # bf16 scores that do not tie
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3)).cuda()  # the CPU test's: no bf16 ties
    torch._dynamo.reset()
    with torch.no_grad():
        fused = passes.compile(model, passes="all", fullgraph=True)
        logits = fused(ids, use_cache=False).logits.float()
        eager = model(ids, use_cache=False).logits.float()
    layers = model.config.num_hidden_layers
    rejected = [(r.anchor, r.reason) for name in passes.available() for r in fused.report.rejections(name)]
    # every hyper-connection site (attention and MLP of each layer; V4's final head is not a
    # seam); a gate at each `moe` layer, none at `hash_moe`
    assert fused.report.counts()["mega_mhc"] == 2 * layers, rejected
    assert fused.report.counts()["mega_gate"] == model.config.mlp_layer_types.count("moe"), rejected
    assert ((logits - eager).norm() / eager.norm()).item() <= 2e-2
