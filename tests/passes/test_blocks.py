"""Repeated blocks compiled once (passes/blocks.py, `passes.compile(..., blocks=True)`): one graph per
kind of block whatever the depth, each block's own weights, fused sites counted per block."""

import pytest
import torch
from torch import nn

from megafuse import passes
from tests.passes.gate_clients import GateChain


class RoutedLayer(nn.Module):
    """A residual layer around a gate chain the Mega-Gate pass fuses: x + (weights * ids) @ proj."""

    def __init__(self, seed: int, hidden: int = 64, n_experts: int = 24):
        super().__init__()
        self.gate = GateChain(n_experts=n_experts, hidden=hidden)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(n_experts, hidden, generator=g) * hidden ** -0.5)
        self.proj = nn.Parameter(torch.randn(3, hidden, generator=g))

    def forward(self, x):
        weights, ids = self.gate(x)
        return x + (weights * ids.float()) @ self.proj


class IndexedLayer(RoutedLayer):
    """Near miss for sharing: the forward reads its layer index, a Python value Dynamo guards on."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.index = seed

    def forward(self, x):
        return super().forward(x) * (1.0 + 0.01 * self.index)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _compile_blocks(model):
    torch._dynamo.reset()
    return passes.compile(model, passes=["mega_gate"], blocks=True, fullgraph=True)


@pytest.mark.parametrize("depth", [2, 5])
def test_identical_layers_compile_one_graph_whatever_the_depth(depth):
    model = Stack([RoutedLayer(seed) for seed in range(depth)]).eval()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(7))
    want = model(x)
    fused = _compile_blocks(model)
    got = fused(x)
    report = fused.report
    assert len(report.graphs) == 1  # the count does not grow with depth
    assert report.graphs[0].blocks == [f"layers.{i}" for i in range(depth)]
    assert report.counts() == {"mega_gate": depth}  # one fused gate per layer that runs the graph
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layers_sharing_a_graph_each_use_their_own_weights():
    layers = [RoutedLayer(seed) for seed in (1, 2)]
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(8))
    want = [layer(x) for layer in layers]
    assert (want[0] - want[1]).abs().max() > 0.1  # the weights differ enough to tell apart
    model = Stack(layers).eval()
    fused = _compile_blocks(model)
    fused(x)  # compiles once, for layers.0
    got = [layer(x) for layer in layers]  # each through the shared graph, alone
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(fused.report.graphs) == 1


def test_a_block_that_reads_its_index_compiles_one_graph_per_layer_and_counts_stay_right():
    model = Stack([IndexedLayer(seed) for seed in range(3)]).eval()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(9))
    want = model(x)
    fused = _compile_blocks(model)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
    assert [g.blocks for g in fused.report.graphs] == [["layers.0"], ["layers.1"], ["layers.2"]]
    assert fused.report.counts() == {"mega_gate": 3}


def test_block_compile_needs_a_module_list_and_says_so():
    with pytest.raises(ValueError, match="nn.ModuleLists.*blocks=False"):
        passes.compile(RoutedLayer(0), passes=["mega_gate"], blocks=True)


def test_hf_deepseek_v4_layers_compile_once_per_kind_and_the_report_says_what_the_boundary_costs():
    """HF's layers end with their FFN's hc_post, so under blocks=True a seam's post lies in the
    layer before: each seam still fuses (coefficients, collapse, norm), the post stays outside.
    HF builds the attention mask once, in the model: inside a block it is an input whose values the
    pass cannot see, so attention stays unfused, with the reason. The hash-routed and the
    learned-router layers are the two kinds."""
    from tests.passes.test_mega_gate_models import _hf_model

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    whole = passes.compile(_hf_model(), passes="all")
    want = whole(ids, use_cache=False).logits
    model = _hf_model()
    torch._dynamo.reset()
    fused = passes.compile(model, passes="all", blocks=True)
    got = fused(ids, use_cache=False).logits
    n_layers = model.config.num_hidden_layers
    # the routed experts fuse in every layer, the hash-routed ones too (their ids come from a table)
    assert whole.report.counts() == {"mega_mhc": 2 * n_layers, "mega_gate": 2, "mega_attention": n_layers,
                                     "mega_moe": n_layers, "mega_indexer": 0}
    assert fused.report.counts() == {"mega_mhc": 2 * n_layers, "mega_gate": 2, "mega_attention": 0,
                                     "mega_moe": n_layers, "mega_indexer": 0}
    assert {r.reason for r in fused.report.rejections("mega_attention")} == {
        "the scores are not masked: neither where(~valid, -inf, s), where(valid, s, -inf) nor s + a mask of 0 and -inf"}
    assert sorted(g.blocks for g in fused.report.graphs) == [[f"model.layers.{i}" for i in range(2)],
                                                            [f"model.layers.{i}" for i in range(2, n_layers)]]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
