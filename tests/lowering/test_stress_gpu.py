"""The lock-free launch protocols where they run: hundreds of back-to-back launches and CUDA-graph
replays at random token counts on the GPU, each checked against the reference, the persistent sync
state zero afterwards. Skipped without CUDA; run on the H200 with
`python3 -m pytest tests/lowering/test_stress_gpu.py`.

Mega-Gate ships two protocols (docs/mega_gate.md): job = program id where the grid fits the SMs at
once (T <= 16 at V4.1's widths) and claimed jobs otherwise. Mega-mHC ships three
(docs/mega_mhc.md): handoff (T <= 16), co-resident with monotonic tile counters (T <= 128) and
claimed jobs (larger T). The token counts below cover each, and the graphs are replayed in a random
order, so consecutive launches change protocol and T.
"""

import random

import pytest
import torch

from megafuse.lowering import mega_gate as mg
from megafuse.lowering import mega_mhc as mm
from tests.lowering.test_mega_gate import make_spec as make_gate_spec
from tests.lowering.test_mega_mhc import assert_matches_reference as assert_seam_matches, make_inputs, make_spec
from megafuse.tools.bench_gate import compare as compare_gate, make_inputs as gate_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAUNCHES = 300
GRAPH_REPLAYS = 200
GATE_TOKENS = (1, 3, 16, 17, 64, 100, 128, 512, 777, 4096)   # program ids (T <= 16), claimed jobs
SEAM_TOKENS = (1, 5, 16, 17, 37, 64, 128, 129, 300, 512)     # handoff, co-resident, claimed


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def assert_gate_matches(spec, u, w, b, weights, ids):
    """Selection equal to the fp32 reference's except at near-ties (reference choices within
    tools.bench_gate.TIE_TOL: at hundreds of thousands of rows, some choices differ by an ulp of the
    scoring function), weights within 1e-5."""
    check = compare_gate(spec, u, w, b, weights, ids)
    assert check["ok"], check


def _graph(fn):
    """fn captured in a CUDA graph (warmed up on a side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_gate_launches_and_replays_at_random_token_counts_equal_the_reference():
    spec = make_gate_spec(E=384, D=5120, k=6)
    rng = random.Random(0)
    mg.reserve_workspace(spec, max(GATE_TOKENS))
    for i in range(LAUNCHES):
        T = rng.choice(GATE_TOKENS)
        u, w, b = gate_inputs(spec, T, "cuda", seed=i)
        assert_gate_matches(spec, u, w, b, *mg.mega_gate(u, w, b, spec))
    graphs = {}
    for T in GATE_TOKENS:
        u, w, b = gate_inputs(spec, T, "cuda", seed=10_000 + T)
        graphs[T] = (u, w, b, *_graph(lambda u=u, w=w, b=b: mg.mega_gate(u, w, b, spec)))
    for i in range(GRAPH_REPLAYS):
        T = rng.choice(GATE_TOKENS)
        u, w, b, graph, (weights, ids) = graphs[T]
        u.copy_(gate_inputs(spec, T, "cuda", seed=20_000 + i)[0])
        graph.replay()
        assert_gate_matches(spec, u, w, b, weights, ids)
    torch.cuda.synchronize()
    assert mg.sync_state_is_clear("cuda")


def test_seam_launches_and_replays_at_random_token_counts_equal_the_reference():
    spec = make_spec("delayed", "bfloat16", dim=5120)
    rng = random.Random(1)
    mm.reserve_sync(spec, max(SEAM_TOKENS))
    for i in range(LAUNCHES):
        T = rng.choice(SEAM_TOKENS)
        args = _cuda(make_inputs(spec, T, seed=i))
        assert_seam_matches(spec, args, mm.mega_mhc(*args, spec))
    graphs = {}
    for T in SEAM_TOKENS:
        args = _cuda(make_inputs(spec, T, seed=10_000 + T))
        graphs[T] = (args, *_graph(lambda args=args: mm.mega_mhc(*args, spec)))
    for i in range(GRAPH_REPLAYS):
        T = rng.choice(SEAM_TOKENS)
        args, graph, out = graphs[T]
        fresh = _cuda(make_inputs(spec, T, seed=20_000 + i))
        for held, new in zip(args[:5], fresh[:5]):  # the activations; the weights stay
            held.copy_(new)
        graph.replay()
        assert_seam_matches(spec, args, out)
    torch.cuda.synchronize()
    assert mm.sync_state_is_clear("cuda")
