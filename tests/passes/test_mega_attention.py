"""MegaAttention pass: exact match counts, the unfused ops gone, equality with the unfused chain,
near misses left alone with the reason. Compiled through Inductor's real post-grad passes
(`post_grad.fuse`) and run with the generated kernel (the Triton interpreter on the CPU)."""

import pytest
import torch
from torch._inductor import config as inductor_config

from megafuse import passes
from megafuse.lowering import kernel_cache
from megafuse.model import build_model
from tests.passes.attention_clients import (AttentionChain, AttentionChainMxfp8, FloorScaleMxfp8, ForwardRope,
                                            HFBiasedChain, HFCompressedChain, HFDenseChain, HFForwardRope, HFSinkKept, NoSink, NoSinkInDenominator,
                                            PlainMaxChain, RopedQChain, RopedQOtherAngles, RopeOnHead,
                                            SoftmaxOverHeads, ValuesNotKeys)
from tests.passes import attention_spellings as outside
from tests.passes.cuda_forms import TORCH_2_11_FORMS
from tests.passes.online_softmax import online_softmax
from tests.passes.post_grad import fuse

HEADS, HEAD_DIM, ROPE_DIM, KEYS = 4, 32, 8, 12
CHAIN_OPS = ("aten.bmm", "aten.amax", "aten.exp", "aten.maximum", "aten.cos", "aten.sin", "aten.cat",
             "aten.where")


@pytest.fixture(autouse=True)
def _kernel_cache_in_tmp(tmp_path_factory):
    kernel_cache.set_cache_dir(tmp_path_factory.getbasetemp() / "kernels")
    yield
    kernel_cache.set_cache_dir(None)


def _inputs(B, T, dtype, seed, heads=HEADS, n_keys=KEYS, dead_row=True):
    """Random rows; with `dead_row`, query (0, 0) sees no valid key (its output is exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, heads, HEAD_DIM, generator=g).to(dtype)
    keys = torch.randn(B, T, n_keys, HEAD_DIM, generator=g).to(dtype)
    valid = torch.rand(B, T, n_keys, generator=g) < 0.7
    valid[0, 0] = not dead_row
    angles = torch.rand(B, T, ROPE_DIM // 2, generator=g) * 100
    return q, keys, valid, angles


def _run_fused(module, args):
    """(the module through the attention pass, its output on args)."""
    fused = fuse(module, ["mega_attention"], fullgraph=True)
    with torch.no_grad():
        return fused, fused(*args)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_model_chain_fuses_once_and_equals_it(dtype, tol):
    module = AttentionChain(HEADS, HEAD_DIM, out_dtype=dtype)
    args = _inputs(2, 3, dtype, seed=1)
    fused, out = _run_fused(module, args)
    want = module(*args)
    assert fused.report.counts() == {"mega_attention": 1}
    graph = fused.post_grad_graphs[0]
    assert "megafuse.mega_attention" in graph
    for gone in CHAIN_OPS:
        assert gone not in graph, gone
    spec = fused.report.matches("mega_attention")[0].spec
    assert (spec["heads"], spec["head_dim"], spec["rope_dim"]) == (HEADS, HEAD_DIM, ROPE_DIM)
    assert spec["scale"] == HEAD_DIM ** -0.5 and spec["out_dtype"] == str(dtype).removeprefix("torch.")
    assert out.dtype == dtype and out.shape == want.shape
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))  # no valid key, and the sink: exactly 0
    assert _rel(out, want) <= tol


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_max_without_the_sink_fuses_as_the_model_chain(dtype, tol):
    # m = max_j s_j with the sink only in the denominator: m cancels, so it is the model's function,
    # and the kernel keeps its own max (the sink's included)
    module = PlainMaxChain(HEADS, HEAD_DIM, out_dtype=dtype)
    args = _inputs(2, 3, dtype, seed=1)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 1}, fused.report.rejections("mega_attention")
    graph = fused.post_grad_graphs[0]
    for gone in CHAIN_OPS:
        assert gone not in graph, gone
    model_chain = AttentionChain(HEADS, HEAD_DIM, out_dtype=dtype)  # the same sink
    assert _rel(out, model_chain(*args)) <= tol
    # query (0, 0) sees no valid key: eager's plain max makes it e^(-inf - -inf) = NaN, the fused
    # op the function's value, 0 (as the model's chain)
    assert bool(module(*args)[0, 0].isnan().all()) and torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


@pytest.mark.parametrize("rows", ["many", "one"])
@pytest.mark.parametrize("graph", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_form", ["with_sink", "plain"])
@pytest.mark.parametrize("layout", ["gathered", "dense"])
def test_an_attention_written_outside_fuses_once_with_either_max(layout, max_form, dtype, graph, rows):
    # tests/passes/attention_spellings.py, its default spellings: the sink viewed [1, 1, H, 1],
    # masked_fill(~valid, -inf), exp / (sum + e^(sink - m)), the inverse RoPE by pairs (gathered)
    # or rotate-half (dense); on the CPU's graph and the GPU's (online softmax, padded GEMMs, at one
    # query a GEMM of batch one as mm)
    spec = outside.check_fused(outside.Spelling(layout=layout, rows=rows, max=max_form, dtype=dtype, graph=graph))
    assert (spec["heads"], spec["head_dim"], spec["rope_dim"]) == (outside.HEADS, outside.HEAD_DIM, outside.ROPE_DIM)
    assert spec["out_dtype"] == dtype and spec["scale"] == outside.HEAD_DIM ** -0.5


@pytest.mark.parametrize("near_miss", ["no_sink", "no_inverse_rope"])
@pytest.mark.parametrize("layout", ["gathered", "dense"])
def test_an_attention_written_outside_without_its_sink_or_its_inverse_rope_stays_unfused(layout, near_miss):
    # no sink: another function; no inverse RoPE: the pass matches the attention with it only
    outside.check_near_miss(outside.Spelling(layout=layout, near_miss=near_miss))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_q_rope_by_the_outputs_angles_fuses_into_the_prologue(dtype, tol):
    module = RopedQChain(HEADS, HEAD_DIM, out_dtype=dtype)
    args = _inputs(2, 3, dtype, seed=7)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 1}
    match = fused.report.matches("mega_attention")[0]
    assert match.spec["q_rope"] is True
    assert not any("q RoPE" in part for part in match.spec["left_unfused"])
    graph = fused.post_grad_graphs[0]
    for gone in ("aten.cos", "aten.sin", "aten.cat", "aten.bmm"):  # both rotations are in the op
        assert gone not in graph, gone
    assert _rel(out, module(*args)) <= tol
    # the op's q is the query before its RoPE: rotating q again outside would change the output
    assert _rel(out, AttentionChain(HEADS, HEAD_DIM, out_dtype=dtype)(*args)) > 1e-2


def test_a_q_rope_by_other_angles_stays_unfused_and_the_attention_still_fuses():
    module = RopedQOtherAngles(HEADS, HEAD_DIM)
    args = _inputs(2, 3, torch.float32, seed=7)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 1}
    match = fused.report.matches("mega_attention")[0]
    assert match.spec["q_rope"] is False
    assert match.spec["left_unfused"][0] == "the q RoPE: q is rotated by other angles than the output is rotated back by"
    assert _rel(out, module(*args)) <= 1e-5


def test_one_row_per_step_fuses():
    # a decode step: one query per request, rows [R, 1]
    module = AttentionChain(HEADS, HEAD_DIM)
    args = _inputs(5, 1, torch.float32, seed=2)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 1}
    assert _rel(out, module(*args)) <= 1e-5


def test_angles_shared_by_the_batch_fuse():
    # the unbatched model's angles: one position per token for every sequence, [1, T, rd / 2]
    module = AttentionChain(HEADS, HEAD_DIM)
    q, keys, valid, angles = _inputs(3, 4, torch.float32, seed=5)
    args = (q, keys, valid, angles[:1])
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 1}
    assert "aten.cos" not in fused.post_grad_graphs[0]
    assert _rel(out, module(*args)) <= 1e-5
    assert _rel(out[2], module(*args)[2]) <= 1e-5 and _rel(out[2], out[1]) > 1e-2  # rows differ, angles shared


@pytest.mark.parametrize("B, T, heads, n_keys, dtype", [
    (1, 1, HEADS, KEYS, torch.float32),  # one row: Inductor makes both bmm of batch one mm
    (2, 3, 3, 10, torch.bfloat16),  # 3 heads and 10 keys: both GEMMs zero-padded, their outputs sliced
    (1, 1, 3, 10, torch.float32),  # both
])
def test_the_gpu_graph_forms_fuse(B, T, heads, n_keys, dtype):
    module = AttentionChain(heads, HEAD_DIM, out_dtype=dtype)
    args = _inputs(B, T, dtype, seed=4, heads=heads, n_keys=n_keys, dead_row=False)
    fused, unfused = fuse(module, ["mega_attention"], fullgraph=True), fuse(module, "none", fullgraph=True)
    with torch.no_grad(), inductor_config.patch(TORCH_2_11_FORMS):
        out = fused(*args)
        unfused(*args)
    graph, before = fused.post_grad_graphs[0], unfused.post_grad_graphs[0]
    assert ("aten.mm" in before) == (B * T == 1) and ("constant_pad_nd" in before) == (heads != HEADS)
    assert fused.report.counts() == {"mega_attention": 1}
    for gone in ("aten.bmm", "aten.mm", "aten.constant_pad_nd", "aten.exp"):
        assert gone not in graph, gone
    assert _rel(out, module(*args)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mxfp8_rounding_after_the_cast_fuses_into_the_epilogue(dtype):
    # quant="ref": the output, flattened into WO-A's groups, through MXFP8 blocks of 32
    module = AttentionChainMxfp8(HEADS, HEAD_DIM, out_dtype=dtype)
    args = _inputs(2, 3, dtype, seed=6)
    fused, out = _run_fused(module, args)
    want = module(*args)
    assert fused.report.counts() == {"mega_attention": 1}
    assert fused.report.matches("mega_attention")[0].spec["mxfp8"] is True
    graph = fused.post_grad_graphs[0]
    for gone in ("float8_e4m3fn", "aten.amax", "aten.__rshift__", "aten.exp"):
        assert gone not in graph, gone
    assert out.shape == want.shape == (2, 3, AttentionChainMxfp8.groups, HEADS * HEAD_DIM // AttentionChainMxfp8.groups)
    assert out.dtype == dtype
    # equal but where the fp32 value sits on an e4m3 rounding tie (summation order): one step apart
    differs = out != want
    assert int(differs.sum()) <= max(2, differs.numel() // 100)
    gap = (out.float() - want.float()).abs()[differs]
    assert bool((gap <= 2.0 ** -3 * want.float().abs()[differs].clamp(min=2.0 ** -9) * 1.01).all())


def test_an_mxfp8_rounding_with_another_scale_rule_stays_unfused():
    module = FloorScaleMxfp8(HEADS, HEAD_DIM)
    args = _inputs(2, 3, torch.float32, seed=6)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_attention")]
    assert reasons == ["the MXFP8 scale is not 2^ceil(log2(max(amax, 1e-4) / 448)) of each block's amax"]
    torch.testing.assert_close(out, module(*args), rtol=0, atol=0)


@pytest.mark.parametrize("module, reason", [
    (NoSink(HEADS, HEAD_DIM), "denominator has no sink term"),
    (NoSinkInDenominator(HEADS, HEAD_DIM), "denominator has no sink term"),
    (SoftmaxOverHeads(HEADS, HEAD_DIM), "not over the keys"),
    (ValuesNotKeys(HEADS, HEAD_DIM), "values are not the keys"),
    (RopeOnHead(HEADS, HEAD_DIM), "rotated part [8, 32) is not taken as 12 pairs"),
    (ForwardRope(HEADS, HEAD_DIM), "the attention output is rotated by +angle: not the inverse RoPE"),
])
def test_near_misses_are_not_matched_and_say_why(module, reason):
    args = _inputs(2, 2, torch.float32, seed=3)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_attention")]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    assert "megafuse.mega_attention" not in fused.post_grad_graphs[0]
    # a query with no valid key is NaN without the sink in the max: the same NaN unfused
    torch.testing.assert_close(out, module(*args), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.slow  # a whole (4-layer) model through the post-grad graph
def test_every_attention_layer_of_a_quant_ref_model_fuses_with_its_mxfp8(tiny_fp32):
    cfg = tiny_fp32.replace(quant="ref", n_layers=4, compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2),
                            index_source_layers=(1, 2, 3), engram_layers=(1,))
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = fuse(model, ["mega_attention"], fullgraph=True)
        logits, want = fused(ids), model(ids)
    assert fused.report.counts() == {"mega_attention": cfg.n_layers}, fused.report.rejections("mega_attention")
    assert [m.spec["mxfp8"] for m in fused.report.matches("mega_attention")] == [True] * cfg.n_layers
    assert [m.spec["q_rope"] for m in fused.report.matches("mega_attention")] == [True] * cfg.n_layers
    assert _rel(logits, want) <= 1e-5


# ---- HF transformers' dense form ----------------------------------------------------------------

def _dense_inputs(B, T, S, dtype, seed, shared_mask=True):
    """q [B, H, T, D], one key head kv [B, 1, S, D], a causal sliding mask (query t sees keys
    t + S - T - 3 .. t + S - T) with, per sequence, one query left without a key, angles [1, T, rd / 2]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, T, HEAD_DIM, generator=g).to(dtype)
    kv = torch.randn(B, 1, S, HEAD_DIM, generator=g).to(dtype)
    t, j = torch.arange(T)[:, None] + S - T, torch.arange(S)[None, :]
    allowed = ((j <= t) & (j > t - 4)).expand(1 if shared_mask else B, 1, T, S).clone()
    allowed[..., 1, :] = False  # a query that sees only the sink: exactly 0
    angles = torch.rand(1, T, ROPE_DIM // 2, generator=g) * 100
    return q, kv, allowed, angles


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shared_mask", [True, False])
def test_hf_dense_chain_fuses_once_and_equals_it(dtype, tol, shared_mask):
    pytest.importorskip("transformers")
    module = HFDenseChain(HEADS, HEAD_DIM).to(dtype)
    module.sinks.data = module.sinks.data.float()  # HF keeps the sinks fp32
    args = _dense_inputs(2, 5, 9, dtype, seed=7, shared_mask=shared_mask)
    fused, out = _run_fused(module, args)
    want = module(*args)
    assert fused.report.counts() == {"mega_attention": 1}, fused.report.rejections("mega_attention")
    graph = fused.post_grad_graphs[0]
    for gone in ("aten.bmm", "aten.exp", "aten.amax", "aten.neg", "aten.sin"):
        assert gone not in graph, gone
    assert out.shape == want.shape == (2, 5, HEADS, HEAD_DIM) and out.dtype == dtype
    assert _rel(out, want) <= tol
    assert bool((out[:, 1] == 0).all())  # the query without a key


def test_hf_dense_chain_fuses_under_the_gpus_online_softmax():
    # On CUDA, Inductor turns the softmax over the scores and the sink column into
    # prims.prepare_softmax_online (max and sum in one pass) before the passes run
    pytest.importorskip("transformers")
    module = HFDenseChain(HEADS, HEAD_DIM)
    args = _dense_inputs(2, 5, 9, torch.float32, seed=9)
    with inductor_config.patch(post_grad_custom_pre_pass=online_softmax):
        fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 1}, fused.report.rejections("mega_attention")
    assert "prepare_softmax_online" not in fused.post_grad_graphs[0]
    assert _rel(out, module(*args)) <= 1e-5


@pytest.mark.parametrize("module, reason", [
    (HFForwardRope(HEADS, HEAD_DIM), "not cos and -sin of one angle tensor"),
    (HFSinkKept(HEADS, HEAD_DIM), "cut otherwise than dropping the last"),
])
def test_hf_near_misses_are_not_matched_and_say_why(module, reason):
    pytest.importorskip("transformers")
    args = _dense_inputs(2, 5, 9, torch.float32, seed=8)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_attention")]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    torch.testing.assert_close(out, module(*args), rtol=1e-6, atol=1e-6)


def _compressed_inputs(B, T, S, entries, k, dtype, seed):
    """_dense_inputs over S window keys, then `entries` compressed keys joined to them and each
    query's k picks among those (-1 for none; query 1 has none, as it has no window key)."""
    q, kv, allowed, angles = _dense_inputs(B, T, S, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    kv = torch.cat([kv, torch.randn(B, 1, entries, HEAD_DIM, generator=g).to(dtype)], dim=2)
    picks = torch.stack([torch.randperm(entries, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
    picks[torch.rand(B, T, k, generator=g) < 0.3] = -1
    picks[:, 1] = -1
    return q, kv, allowed, picks, angles


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("bias", ["scatter", "causal"])
def test_hf_compressed_layers_fuse_with_their_block_bias(bias, dtype, tol):
    # the mask is the window's joined with the compressor's block bias: a float mask the pass proves
    # to hold only 0 and -inf (or the dtype's min) from how the graph builds it, and reads as == 0
    pytest.importorskip("transformers")
    module = HFCompressedChain(HEADS, HEAD_DIM, entries=6, bias=bias).to(dtype)
    module.sinks.data = module.sinks.data.float()
    args = _compressed_inputs(2, 5, 9, entries=6, k=3, dtype=dtype, seed=11)
    fused, out = _run_fused(module, args)
    want = module(*args)
    assert fused.report.counts() == {"mega_attention": 1}, fused.report.rejections("mega_attention")
    graph = fused.post_grad_graphs[0]
    for gone in ("aten.bmm", "aten.exp.default", "aten.amax", "aten.sin"):
        assert gone not in graph, gone
    assert _rel(out, want) <= tol
    if bias == "scatter":
        assert bool((out[:, 1] == 0).all())  # no window key, no pick: the sink alone


def test_hf_a_finite_bias_in_the_mask_stays_unfused_and_says_why():
    pytest.importorskip("transformers")
    module = HFBiasedChain(HEADS, HEAD_DIM, entries=6)
    args = _compressed_inputs(2, 5, 9, entries=6, k=3, dtype=torch.float32, seed=12)
    fused, out = _run_fused(module, args)
    assert fused.report.counts() == {"mega_attention": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_attention")]
    assert len(reasons) == 1 and "nor s + a mask of 0 and -inf" in reasons[0], reasons
    torch.testing.assert_close(out, module(*args), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # HF's 4-layer model through the post-grad graph, in fp32 and bf16 (~1 min)
def test_hf_deepseek_v4_fires_at_every_attention_layer_compressed_ones_included():
    pytest.importorskip("transformers")
    from tests.passes.test_mega_gate_models import _hf_model
    model = _hf_model(sharp_routers=True, compress_ratios=(0, 4, 128, 4))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        fused = fuse(model, ["mega_attention"], fullgraph=True)
        logits, want = fused(ids, use_cache=False).logits, model(ids, use_cache=False).logits
        assert fused.report.counts() == {"mega_attention": layers}, fused.report.rejections("mega_attention")
        graph = fused.post_grad_graphs[0]
        assert graph.count("megafuse.mega_attention") == layers
        # each attention's softmax is gone: HF's row max over the scores and the sink column (the
        # only max.dim of the model; the hyper-connections' softmaxes keep their amax)
        assert "aten.max.dim" not in graph
        assert _rel(logits, want) <= 1e-5

        # bf16: HF rounds the scores and the probabilities to bf16 where the op keeps fp32, so the
        # fused logits stand as close to the fp32 model's as the unfused compile's do
        model_bf16 = _hf_model(sharp_routers=True, compress_ratios=(0, 4, 128, 4)).to(torch.bfloat16)
        torch._dynamo.reset()
        fused = fuse(model_bf16, ["mega_attention"], fullgraph=True)
        got = fused(ids, use_cache=False).logits.float()
        assert fused.report.counts() == {"mega_attention": layers}, fused.report.rejections("mega_attention")
        torch._dynamo.reset()
        plain = fuse(model_bf16, [], fullgraph=True)(ids, use_cache=False).logits.float()
    fp32 = want
    for norm in (lambda d: d.abs().max(), lambda d: d.pow(2).mean().sqrt()):
        assert norm(got - fp32) <= 1.5 * norm(plain - fp32), (norm(got - fp32), norm(plain - fp32))
    assert (plain - fp32).abs().max() <= 0.1  # bf16's own distance from fp32, for scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hf_deepseek_v4_in_bf16_on_the_gpu_fuses_every_layer_within_bf16_rounding():
    """The acceptance on the GPU, through passes.compile and the CUDA kernel: HF's model in bf16
    fuses attention at all 4 layers (CSA and HCA included), and its logits stand as close to the
    fp32 model's as the unfused compile's."""
    pytest.importorskip("transformers")
    from tests.passes.test_mega_gate_models import _hf_model
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        fp32 = _hf_model(sharp_routers=True, compress_ratios=(0, 4, 128, 4)).cuda()(ids, use_cache=False).logits
        model = _hf_model(sharp_routers=True, compress_ratios=(0, 4, 128, 4)).to(torch.bfloat16).cuda()
        torch._dynamo.reset()
        fused = passes.compile(model, ["mega_attention"], fullgraph=True)
        got = fused(ids, use_cache=False).logits.float()
        assert fused.report.counts() == {"mega_attention": 4}, fused.report.rejections("mega_attention")
        torch._dynamo.reset()
        plain = passes.compile(model, "none", fullgraph=True)(ids, use_cache=False).logits.float()
    for norm in (lambda d: d.abs().max(), lambda d: d.pow(2).mean().sqrt()):
        assert norm(got - fp32) <= 1.5 * norm(plain - fp32), (norm(got - fp32), norm(plain - fp32))
