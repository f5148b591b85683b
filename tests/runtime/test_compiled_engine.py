"""The engine on its compiled step (runtime/graphs.py): the regions compiled with the passes per
padded bucket give the eager engine's tokens and logits; on a GPU, so do their CUDA graphs."""

import pytest
import torch

from megafuse.model import CacheLayout, build_model
from megafuse.runtime import Engine
from megafuse.runtime.graphs import CompiledStep, default_buckets
from tests.model.stepping import random_tokens

NEW_TOKENS = 4
# Layers 0..2 form the encoder region and layer 3 the decoder region: the same kinds of layers as
# tiny (compressed ratio 2 and 1, an index source, Engram) at a third of the compile time.
LAYOUT = CacheLayout(slots=3, pages=30, page_size=8, max_pages=10)


@pytest.fixture(scope="module")
def shallow(tiny_fp32):
    cfg = tiny_fp32.replace(n_layers=4, compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2),
                            index_source_layers=(1, 2, 3), engram_layers=(1,))
    return build_model(cfg, seed=0)


def _prompts(cfg):
    """3 requests over one 40-token system prompt: later admissions hit its cached pages."""
    system = random_tokens(cfg, 40, seed=50)
    return [system + random_tokens(cfg, 5 + i, seed=60 + i) for i in range(3)]


def _serve(model, **flags):
    engine = Engine(model, layout=LAYOUT, token_budget=32, keep_logits=True, **flags)
    outputs = engine.generate(_prompts(model.cfg), NEW_TOKENS)
    logits = [torch.stack(engine.requests[i].logits) for i in range(len(outputs))]
    return engine, outputs, logits


def _check_against_eager(model, **flags):
    eager, want, want_logits = _serve(model, passes=None)
    engine, got, got_logits = _serve(model, passes="all", buckets=(8, 32), **flags)
    assert got == want
    assert max(float((a - b).abs().max()) for a, b in zip(want_logits, got_logits)) < 1e-4
    assert engine.stats == eager.stats  # the same steps, hits, replay and trim: padding is invisible
    assert engine.stats.prefix_hits == 2 and engine.stats.trimmed_tokens > 0
    return engine


# Every layer has two mHC seams, one gate and one attention; the head adds its collapse; layers 1-3
# (two full, one reindex) have an indexer.
SHALLOW_COUNTS = {"mega_mhc": 2 * 4 + 1, "mega_gate": 4, "mega_attention": 4, "mega_moe": 4, "mega_indexer": 3}


@pytest.mark.slow  # ~1 min of compiles on 2 CPU cores (one graph per kind of layer)
def test_compiled_step_per_bucket_equals_the_eager_engine(shallow):
    engine = _check_against_eager(shallow, cuda_graphs=False)
    runner = engine.step_runner
    # prefill steps pad to 32 rows (decoder rows: 8 for a short tail or none, 32 for a whole
    # untrimmed chunk), decodes of 3 requests to 8
    buckets = runner.compiled_buckets
    assert {(8, 8), (32, 8)} <= buckets <= {(8, 8), (32, 8), (32, 32)}
    assert runner.stats.buckets == len(buckets) and runner.stats.captures == 0
    report = runner.report()
    rejected = {name: [r.reason for r in report.rejections(name)] for name in report.pass_names}
    assert rejected == {"mega_mhc": [], "mega_gate": [], "mega_attention": [], "mega_moe": [], "mega_indexer": []}
    # symbolic row counts: one graph per kind of layer serves every bucket; the shallow model's four
    # layers are four kinds (SWA-only first layer, Engram + compressor, the decoder KV source, reindex)
    assert sorted(graph.blocks for graph in report.graphs) == [["Transformer"], ["layers.0"], ["layers.1"],
                                                                ["layers.2"], ["layers.3"]]
    assert runner.stats.graphs == 5 and report.counts() == SHALLOW_COUNTS
    attention = [m.spec for graph in report.graphs for p in graph.passes if p.name == "mega_attention" for m in p.matches]
    assert [spec["q_rope"] for spec in attention] == [True] * 4  # q's RoPE in the kernel's prologue


@pytest.mark.slow  # ~1 min: the two regions compiled whole
def test_whole_region_compile_fuses_what_the_block_compile_fuses(shallow):
    runner = CompiledStep(shallow, layout=LAYOUT, buckets=(8, 32), blocks=False)
    engine = Engine(shallow, layout=LAYOUT, token_budget=32, compiled=runner)
    engine.generate(_prompts(shallow.cfg)[:1], 1)
    report = runner.report()
    # one graph per region: the encoder's 3 layers (2 seams, a gate, an attention and the routed
    # experts each) and the decoder's layer with the head's collapse
    assert sorted(tuple(len(p.matches) for p in graph.passes) for graph in report.graphs) == [(3, 1, 1, 1, 1),
                                                                                             (6, 3, 3, 3, 2)]
    assert runner.stats.graphs == 2 and report.counts() == SHALLOW_COUNTS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_compiled_step(shallow):
    engine = _check_against_eager(shallow.cuda(), cuda_graphs=True)
    stats = engine.step_runner.stats
    assert stats.captures == stats.buckets == len(engine.step_runner.compiled_buckets) and stats.graph_bytes > 0


def test_default_buckets_reach_the_token_budget():
    assert default_buckets(1) == (2,)
    assert default_buckets(32) == (2, 4, 8, 16, 32)
    assert default_buckets(48) == (2, 4, 8, 16, 32, 48)


def test_bad_step_configurations_are_named(shallow):
    with pytest.raises(ValueError, match="largest bucket .16. is below token_budget=32"):
        Engine(shallow, layout=LAYOUT, token_budget=32, buckets=(4, 16))
    with pytest.raises(ValueError, match="increasing row counts"):
        CompiledStep(shallow, layout=LAYOUT, buckets=(32, 4))
    with pytest.raises(ValueError, match="at least 2 rows.*a size of 1"):
        CompiledStep(shallow, layout=LAYOUT, buckets=(1, 32))
    with pytest.raises(ValueError, match="captures the compiled regions"):
        Engine(shallow, layout=LAYOUT, passes=None, cuda_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs the model on a CUDA device"):
            Engine(shallow, layout=LAYOUT, cuda_graphs=True)
    runner = CompiledStep(shallow, layout=LAYOUT, buckets=(4, 32))
    assert runner.bucket(3, 3) == (4, 4) and runner.bucket(5, 0) == (32, 4) and runner.bucket(1, 1) == (4, 4)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        runner.bucket(33, 1)
