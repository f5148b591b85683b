"""Expert parallelism (model/expert_parallel.py): shards hold disjoint experts whose union is the
model's, and a MoE layer sharded over 2 gloo processes equals the whole layer bit for bit, each rank
with its own tokens (none on one of them included)."""

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megafuse.model import build_model
from megafuse.model.config import preset
from megafuse.model.expert_parallel import expert_range, shard_experts
from megafuse.model.moe import MoE

TOKENS = {2: (7, 3), 3: (5, 0, 4)}  # tokens each rank routes, by world size


@pytest.mark.parametrize("n_experts, world", [(8, 2), (8, 3), (5, 5), (1, 1)])
def test_shards_hold_disjoint_experts_whose_union_is_the_model(n_experts, world):
    ranges = [expert_range(n_experts, r, world) for r in range(world)]
    held = [e for r in ranges for e in r]
    assert held == list(range(n_experts))  # contiguous, in rank order, each expert once
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_bad_worlds_are_named():
    with pytest.raises(ValueError, match=r"needs 1 <= world size <= the 4 routed experts"):
        expert_range(4, 0, 5)
    with pytest.raises(ValueError, match=r"rank 2 is outside the world of 2 ranks"):
        expert_range(4, 2, 2)
    with pytest.raises(ValueError, match="no MoE layer"):
        shard_experts(torch.nn.Linear(2, 2), 0, 1)


def _model():
    return build_model(preset("tiny").replace(quant="none", dtype="float32"), seed=0)


def _tokens(world, rank, dim):
    return torch.randn(TOKENS[world][rank], dim, generator=torch.Generator().manual_seed(100 + rank))


def _rank(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        model = shard_experts(_model(), rank, world)
        moe = next(m for m in model.modules() if isinstance(m, MoE))
        with torch.no_grad():
            results[rank] = (moe(_tokens(world, rank, model.cfg.dim)), moe.experts.shard.w13.clone())
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_a_moe_layer_sharded_over_gloo_ranks_equals_the_whole_layer(world):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(world, _free_port(), results), nprocs=world, join=True)
        results = dict(results)
    whole = _model()
    moe = next(m for m in whole.modules() if isinstance(m, MoE))
    n_experts = moe.experts.w13.shape[0]
    for rank in range(world):
        out, w13 = results[rank]
        held = expert_range(n_experts, rank, world)
        assert torch.equal(w13, moe.experts.w13[held.start:held.stop])
        with torch.no_grad():
            want = moe(_tokens(world, rank, whole.cfg.dim))
        assert out.shape == want.shape and torch.equal(out, want), rank


def _compiled_rank(rank, world, port, dump, results):
    from megafuse import passes
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        model = shard_experts(_model(), rank, world)
        moe = next(m for m in model.modules() if isinstance(m, MoE))
        compiled = passes.compile(moe, passes="all", fullgraph=True, dump_dir=dump / str(rank))
        with torch.no_grad():
            out = compiled(_tokens(world, rank, model.cfg.dim))
        graph = (dump / str(rank) / "graph000_mega_gate_after.txt").read_text()
        results[rank] = (out, compiled.report.counts(), graph.count("megafuse.expert_exchange.default"), graph.count("aten.topk"))
    finally:
        dist.destroy_process_group()


def test_a_sharded_moe_layer_compiles_whole_with_the_gate_fused(tmp_path):
    """fullgraph: the exchange is one opaque op, and Mega-Gate still fuses the router before it."""
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_compiled_rank, args=(world, _free_port(), tmp_path, results), nprocs=world, join=True)
        results = dict(results)
    whole = _model()
    moe = next(m for m in whole.modules() if isinstance(m, MoE))
    for rank in range(world):
        out, counts, exchanges, topks = results[rank]
        assert counts["mega_gate"] == 1 and (exchanges, topks) == (1, 0), (counts, exchanges, topks)
        with torch.no_grad():
            want = moe(_tokens(world, rank, whole.cfg.dim))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
