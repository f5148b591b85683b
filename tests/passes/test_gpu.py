"""The passes end to end on CUDA: Inductor's generated code calls the generated Triton kernels.

Skipped without CUDA; run on the H200 with `python3 -m pytest tests/passes/test_gpu.py`.
"""

import pytest
import torch

import passes
from model import build_model, preset
from tests.passes.gate_clients import GateChain
from tests.passes.test_mega_mhc import Seam, _inputs, _rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
    assert fused.report.counts() == {"mega_mhc": 2 * cfg.n_layers + 1, "mega_gate": cfg.n_layers}
    assert err <= 1e-3  # fp32 model; the gate GEMM runs 3xTF32 on CUDA


@pytest.mark.parametrize("form", ["delayed", "final", "fresh"])
def test_seam_forms_bf16_on_cuda(form):
    module = Seam(form, torch.bfloat16).cuda()
    args = tuple(a.cuda() for a in _inputs(33, torch.bfloat16))
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_mhc"], fullgraph=True)
    out = fused(*args)
    assert fused.report.counts() == {"mega_mhc": 1}
    for got, want in zip(out, module(*args)):
        assert _rel(got, want) <= 1e-2


def test_gate_on_cuda_selects_like_the_chain():
    module = GateChain(n_experts=48, hidden=256, k=6).cuda()
    u = torch.randn(300, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch._dynamo.reset()
    fused = passes.compile(module, passes=["mega_gate"], fullgraph=True)
    (w, ids), (w_ref, ids_ref) = fused(u), module(u)
    assert fused.report.counts() == {"mega_gate": 1}
    assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)
    assert _rel(w.gather(-1, ids.argsort(-1)), w_ref.gather(-1, ids_ref.argsort(-1))) <= 1e-5
