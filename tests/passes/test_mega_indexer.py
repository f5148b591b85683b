"""Mega-Indexer pass: the step's indexer chain (keys from the cache bytes, scores, top-k) fuses once in
every cache format, with a candidate mask and with its scores read outside; the unfused ops are gone,
the top-k equals eager's and an fp64 top-k's, and near misses stay unfused with the reason."""

import pytest
import torch
from torch import nn

from megafuse.lowering.mega_indexer import IndexerSpec
from megafuse.model import preset, quant
from megafuse.model.attention import NEG_INF, candidate_mask, index_scores, select_topk, visible_entries
from megafuse.model.cache import row_codec
from torch._inductor import config as inductor_config

from tests.lowering.test_mega_indexer import fp64_topk
from tests.passes.cuda_forms import TORCH_2_11_FORMS
from tests.passes.post_grad import fuse

R, H, D, PER_PAGE, MAX_PAGES, K, RATIO = 5, 4, 32, 8, 4, 6, 2
POSITIONS = (0, 3, 17, 40, 63)


class IndexerStep(nn.Module):
    """The indexer part of `Attention.step`: the request's pages of key bytes decoded, scored, masked
    by visibility (and by `allowed`), the top-k; `publish`: the candidate source's blocks as well."""

    def __init__(self, cfg, dtype=torch.float32, publish=False):
        super().__init__()
        self.codec, self.dtype, self.publish = row_codec(cfg, "index_keys"), dtype, publish

    def keys(self, pool, pages):
        return self.codec.decode(pool[pages].flatten(1, 2), self.dtype)

    def scores(self, q, w, keys, positions):
        visible = visible_entries(positions, keys.shape[-2], RATIO)
        return index_scores(q[None], w[None], keys[None], visible[None])

    def select(self, scores):
        return select_topk(scores, K)

    def forward(self, q, w, pool, pages, positions, allowed=None):
        scores = self.scores(q, w, self.keys(pool, pages), positions)
        published = candidate_mask(scores, positions, RATIO, 2, 4) if self.publish else None
        if allowed is not None:
            scores = scores.masked_fill(~allowed[None], NEG_INF)
        topk = self.select(scores)
        return topk if published is None else (topk, published)


def _inputs(cfg, dtype=torch.float32, seed=0, allowed=False):
    g = torch.Generator().manual_seed(seed)
    codec = row_codec(cfg, "index_keys")
    pool = codec.encode(torch.randn(24, PER_PAGE, D, generator=g))
    pages = torch.randperm(24, generator=g)[: R * MAX_PAGES].view(R, MAX_PAGES)
    q = torch.randn(R, H, D, generator=g)
    q = (quant.fake_quant_index_mxfp4(q) if cfg.quant == "ref" else q).to(dtype)
    w = torch.randn(R, H, generator=g)
    args = [q, w, pool, pages, torch.tensor(POSITIONS)]
    if allowed:
        args.append(torch.rand(R, MAX_PAGES * PER_PAGE, generator=g) < 0.5)
    return args


def _fused_graph(fused) -> str:
    return "\n".join(fused.post_grad_graphs)


CFG = {quant_: preset("tiny").replace(quant=quant_, index_heads=H, index_head_dim=D) for quant_ in ("ref", "none")}


@pytest.mark.parametrize("quant_, dtype", [("ref", torch.float32), ("ref", torch.bfloat16), ("none", torch.float32),
                                           ("none", torch.bfloat16)])
def test_the_step_chain_fuses_once_in_every_cache_format_and_equals_eager(quant_, dtype):
    cfg = CFG[quant_].replace(dtype=str(dtype)[6:])
    module = IndexerStep(cfg, dtype)
    args = _inputs(cfg, dtype)
    fused = fuse(module, ["mega_indexer"], fullgraph=True)
    got = fused(*args)
    assert fused.report.counts() == {"mega_indexer": 1}, fused.report.rejections("mega_indexer")
    graph = _fused_graph(fused)
    assert graph.count("megafuse.mega_indexer.default") == 1
    for gone in ("aten.sort", "aten.bmm", "aten.relu", "aten.__rshift__", "aten.__lshift__", "aten.index.Tensor"):
        assert gone not in graph, gone
    spec = fused.report.matches("mega_indexer")[0].spec
    key_format = "index_mxfp4" if quant_ == "ref" else str(dtype)[6:]
    assert (spec["key_format"], spec["ratio"], spec["topk"], spec["heads"], spec["head_dim"]) == (key_format, RATIO, K, H, D)
    want = module(*args)
    assert torch.equal(got, want)
    exact, gaps = fp64_topk(*args[:5], None, IndexerSpec(H, D, K, RATIO, PER_PAGE, key_format, str(dtype)[6:]))
    assert not any(0 < gap < 1e-4 for gap in gaps) and torch.equal(got[0], exact)


def test_a_candidate_mask_and_the_candidate_sources_blocks_fuse():
    cfg = CFG["ref"]
    masked = IndexerStep(cfg)
    args = _inputs(cfg, allowed=True)
    fused = fuse(masked, ["mega_indexer"], fullgraph=True)
    assert torch.equal(fused(*args), masked(*args))
    assert fused.report.counts() == {"mega_indexer": 1} and fused.report.matches("mega_indexer")[0].spec["allowed"]
    source = IndexerStep(cfg, publish=True)  # its scores also feed the block selection
    fused = fuse(source, ["mega_indexer"], fullgraph=True)
    (topk, blocks), (want_topk, want_blocks) = fused(*args[:5]), source(*args[:5])
    assert fused.report.counts() == {"mega_indexer": 1}
    assert torch.equal(topk, want_topk) and torch.equal(blocks, want_blocks)
    assert _fused_graph(fused).count("aten.sort") == 1  # the block selection's own sort stays


def test_a_symbolic_row_count_fuses_once_for_every_count():
    """Row dims marked dynamic, as the runtime's step marks them: one graph for 5 rows and for 3."""
    cfg = CFG["none"]
    module = IndexerStep(cfg)
    fused = fuse(module, ["mega_indexer"], fullgraph=True)
    for rows in (5, 3):
        args = [a[:rows] if a.shape[0] == R else a for a in _inputs(cfg, seed=rows)]
        for a in args[:2] + args[3:]:
            torch._dynamo.mark_dynamic(a, 0)
        assert torch.equal(fused(*args), module(*args))
    assert fused.report.counts() == {"mega_indexer": 1} and len(fused.post_grad_graphs) == 1


@pytest.mark.parametrize("quant_, dtype", [("ref", torch.bfloat16), ("none", torch.float32)])
def test_the_gpu_graph_forms_fuse(quant_, dtype):
    """The GPU's graphs (tests/passes/cuda_forms.py): the head sum's one row and 4 heads are padded
    to aligned GEMM sizes and its output sliced; torch 2.11 drops the bf16 keys' round trip."""
    cfg = CFG[quant_].replace(dtype=str(dtype)[6:])
    module = IndexerStep(cfg, dtype, publish=True)
    args = _inputs(cfg, dtype, seed=6)
    fused, unfused = fuse(module, ["mega_indexer"], fullgraph=True), fuse(module, "none", fullgraph=True)
    with torch.no_grad(), inductor_config.patch(TORCH_2_11_FORMS):
        (topk, blocks), _ = fused(*args), unfused(*args)
    assert "constant_pad_nd" in unfused.post_grad_graphs[0]
    assert fused.report.counts() == {"mega_indexer": 1}, fused.report.rejections("mega_indexer")
    for gone in ("aten.bmm", "aten.constant_pad_nd", "aten.relu"):
        assert gone not in fused.post_grad_graphs[0], gone
    want_topk, want_blocks = module(*args)
    assert torch.equal(topk, want_topk) and torch.equal(blocks, want_blocks)


# ---- near misses --------------------------------------------------------------------------------

class NoRelu(IndexerStep):
    def scores(self, q, w, keys, positions):
        visible = visible_entries(positions, keys.shape[-2], RATIO)
        logits = torch.einsum("bthd,btnd->bthn", q[None].float(), keys[None].float())  # no ReLU
        return torch.einsum("bth,bthn->btn", w[None], logits).masked_fill(~visible[None], NEG_INF)


class ZeroPadded(IndexerStep):
    def select(self, scores):
        ids = select_topk(scores, K)
        return torch.where(ids < 0, 0, ids)  # a fill the kernel does not write (the chain ends elsewhere)


class FloatKeys(IndexerStep):
    def keys(self, pool, pages):  # keys that never were cache bytes
        return torch.ones(R, MAX_PAGES * PER_PAGE, D).cumsum(1) * 1e-2


class OtherScale(IndexerStep):
    def keys(self, pool, pages):  # the scale byte read as 2^(e - 126): another format
        return super().keys(pool, pages) * 2


class VisibleFromPosition(IndexerStep):
    def scores(self, q, w, keys, positions):
        entry = torch.arange(keys.shape[-2])
        visible = entry[None, :] < torch.div(positions[:, None], RATIO, rounding_mode="floor")  # no + 1
        logits = torch.relu(torch.einsum("bthd,btnd->bthn", q[None].float(), keys[None].float()))
        return torch.einsum("bth,bthn->btn", w[None], logits).masked_fill(~visible[None], NEG_INF)


@pytest.mark.parametrize("module, reason", [
    (NoRelu, "the head weights do not multiply relu(logits)"),
    (FloatKeys, "the keys are not decoded from the cache's bytes"),
    (OtherScale, "the keys are not decoded from the cache's bytes"),
    (VisibleFromPosition, "the visible count is not (position + 1) // ratio"),
])
def test_near_misses_stay_unfused_and_say_why(module, reason):
    cfg = CFG["ref"]
    step = module(cfg)
    args = _inputs(cfg)
    fused = fuse(step, ["mega_indexer"], fullgraph=True)
    assert torch.equal(fused(*args), step(*args))
    assert fused.report.counts() == {"mega_indexer": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_indexer")]
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_a_top_k_whose_empty_slots_are_not_minus_one_is_read_up_to_its_own_end():
    """select_topk then a fill of its own: the fused op gives select_topk's -1s, the fill follows."""
    cfg = CFG["ref"]
    step = ZeroPadded(cfg)
    args = _inputs(cfg)
    fused = fuse(step, ["mega_indexer"], fullgraph=True)
    assert torch.equal(fused(*args), step(*args)) and fused.report.counts() == {"mega_indexer": 1}


def test_hfs_indexer_stays_unfused_and_the_report_names_its_topk_and_keys():
    """HF transformers' DeepseekV4 indexer (a prefill: keys compressed in the forward, torch.topk):
    one rejection that names both, and the model's MoE gate top-k in the same graph is no candidate."""
    hf = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    from tests.passes.test_mega_gate_models import _hf_model
    model = _hf_model(compress_ratios=(4, 0, 0, 0))
    attention = model.model.layers[0].self_attn
    indexer = next(m for m in attention.modules() if isinstance(m, v4.DeepseekV4Indexer))
    g = torch.Generator().manual_seed(0)
    hidden, q_residual = torch.randn(1, 24, 64, generator=g), torch.randn(1, 24, 32, generator=g)
    positions = torch.arange(24)[None]
    fused = fuse(lambda h, r, p: indexer(h, r, p, None, 0), ["mega_indexer"], fullgraph=True)
    with torch.no_grad():
        got, want = fused(hidden, q_residual, positions), indexer(hidden, q_residual, positions, None, 0)
    assert fused.report.counts() == {"mega_indexer": 0}
    reasons = [r.reason for r in fused.report.rejections("mega_indexer")]
    assert len(reasons) == 1 and "torch.topk" in reasons[0] and "cache's bytes" in reasons[0], reasons
    assert torch.equal(got, want)
    gate = fuse(model.model.layers[3].mlp, ["mega_indexer"], fullgraph=True)  # a top-k router, not a hash one
    with torch.no_grad():
        gate(torch.randn(1, 5, 64, generator=g))
    assert gate.report.rejections("mega_indexer") == []
