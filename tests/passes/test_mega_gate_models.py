"""Mega-Gate on whole models: ours (`tiny`) and one nobody here wrote (HF transformers' DeepseekV4)."""

import pytest
import torch

from megafuse import passes
from tests.passes.post_grad import fuse
from tests.passes.tiny import compile_tiny

pytestmark = pytest.mark.slow  # whole models compiled


def test_tiny_one_gate_per_moe_layer_and_logits_equal_eager(tmp_path):
    cfg, model, ids, fused, logits = compile_tiny(["mega_gate"], 16, dump_dir=tmp_path)
    # Every layer of the model is MoE: one gate per layer, and no gate op survives the pass.
    assert fused.report.counts() == {"mega_gate": cfg.n_layers}
    assert fused.report.rejections("mega_gate") == []
    after = (tmp_path / "graph000_mega_gate_after.txt").read_text()
    assert after.count("megafuse.mega_gate.default") == cfg.n_layers
    for gone in ("aten.topk", "aten.gather", "aten.sqrt.default(mm"):
        assert gone not in after
    # the replaced nodes map back to the model's own source: the router in model/moe.py
    sources = {s for m in fused.report.matches("mega_gate") for s in m.sources}
    assert sources and all("model/moe.py:" in s and s.rsplit(":", 1)[1].isdigit() for s in sources)
    assert (logits - model(ids)).abs().max().item() <= 1e-4


hf = pytest.importorskip("transformers")


def _hf_model(sharp_routers: bool = False, compress_ratios=(0, 0, 0, 0)):
    """HF's DeepseekV4ForCausalLM at a tiny random config. `sharp_routers`: router weights as sharp
    as trained ones, so that bf16 scores rarely tie (torch.topk leaves the order of ties open, the
    kernel takes the lower index: a tie broken the other way changes that token's experts).
    `compress_ratios`: each layer's 0 (sliding), 4 (CSA) or 128 (HCA, here every 8 tokens)."""
    cfg = hf.DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        head_dim=32, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, hc_mult=4, o_groups=1,
        o_lora_rank=16, index_n_heads=2, index_head_dim=32, index_topk=4, sliding_window=8,
        compress_ratios=list(compress_ratios), compress_rate_hca=8, num_hash_layers=2, partial_rotary_factor=0.5, use_cache=False)
    torch.manual_seed(0)
    model = hf.DeepseekV4ForCausalLM(cfg).eval()
    for layer in model.model.layers:  # a random bias, so that selection really depends on it
        if hasattr(layer.mlp.gate, "e_score_correction_bias"):
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.05)
    if sharp_routers:
        g = torch.Generator().manual_seed(1)
        for router in _moe_routers(model):
            router.weight.data.normal_(std=0.2, generator=g)
    return model


def test_hf_deepseek_v4_fires_on_moe_layers_only_and_equals_unfused_compile():
    model = _hf_model()
    layer_kinds = model.config.mlp_layer_types
    assert layer_kinds == ["hash_moe", "hash_moe", "moe", "moe"]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    fused = passes.compile(model, passes="all")
    logits = fused(ids, use_cache=False).logits
    torch._dynamo.reset()
    unfused = passes.compile(model, passes="none")(ids, use_cache=False).logits
    # one gate per `moe` layer; `hash_moe` selects by table lookup and has no top-k to match
    assert fused.report.counts()["mega_gate"] == layer_kinds.count("moe")
    sources = {s.split(":")[0] for m in fused.report.matches("mega_gate") for s in m.sources}
    assert any(s.endswith("modeling_deepseek_v4.py") for s in sources)
    assert (logits - unfused).abs().max().item() <= 1e-4


def _moe_routers(model):
    return [layer.mlp.gate for layer in model.model.layers if not layer.mlp.is_hash]


def test_hf_deepseek_v4_in_bf16_fuses_every_moe_gate_and_equals_the_unfused_graph():
    model = _hf_model(sharp_routers=True).to(torch.bfloat16)  # W, the bias and the activations: bf16 scores
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    choices = []
    hooks = [r.register_forward_hook(lambda router, args, out: choices.append(
        torch.sqrt(torch.nn.functional.softplus(out[0])) + router.e_score_correction_bias)) for r in _moe_routers(model)]
    with torch.no_grad():
        model(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    # the premise: no row's 2nd and 3rd choices tie in bf16 (torch.topk leaves tie order open, the
    # kernel takes the lower index; a differently broken tie changes that token's experts)
    tops = [c.float().topk(3).values for c in choices]
    assert all((top[:, 1] > top[:, 2]).all() for top in tops)

    fused, unfused = fuse(model, "all", fullgraph=True), fuse(model, "none", fullgraph=True)
    with torch.no_grad():
        logits = fused(ids, use_cache=False).logits
        ref = unfused(ids, use_cache=False).logits
    assert fused.report.counts()["mega_gate"] == len(choices) == 2  # `moe` layers; `hash_moe` has no top-k
    assert fused.report.rejections("mega_gate") == []
    assert all("aten.topk" not in graph for graph in fused.post_grad_graphs)
    spec = fused.report.matches("mega_gate")[0].spec
    assert (spec["score_func"], spec["score_dtype"], spec["choice_dtype"]) == ("sqrtsoftplus", "bfloat16", "bfloat16")
    assert ((logits.float() - ref.float()).norm() / ref.float().norm()).item() <= 1e-2
