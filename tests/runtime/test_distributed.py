"""Several ranks (runtime/distributed.py): the engine over 2 gloo processes, each rank its own
requests and a shard of the experts, returns the single-process engine's tokens in exact mode (the
default mode's trim cuts windows at chunk boundaries, which depend on what shares a step, so no
two schedules are compared there), eager and compiled; a rank that dies
or raises ends the job with the rank and the reason named, within the collectives' timeout; the
session router keeps a session on its rank and balances new ones."""

import os
import signal

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megafuse.model import CacheLayout, build_model, preset
from megafuse.model.expert_parallel import shard_experts
from megafuse.runtime import Engine
from megafuse.runtime.distributed import RankFailure, SessionRouter, launch, step_together

# Prompts of unequal lengths sharing a prefix: the ranks finish at different steps (the idle one
# steps on a padding row), prefill runs in several chunks under the budget, and a prompt reuses
# prompt 0's pages when it lands on its rank.
PREFIX = list(range(100, 140))
PROMPTS = [PREFIX + [1, 2, 3], [7] * 5, list(range(300, 361)), PREFIX + [9] * 12, PREFIX + [4, 5]]
NEW_TOKENS = [6, 2, 4, 5, 3]
EXACT = dict(swa_bounded_replay=False, trim_decoder=False)


TINY = preset("tiny").replace(quant="none", dtype="float32")
# tiny's kinds of layer at 4 layers (SWA-only, Engram + compressor, the decoder KV source,
# reindex): what each rank compiles in the compiled test, a third of tiny's kinds
SHALLOW = TINY.replace(n_layers=4, compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2),
                       index_source_layers=(1, 2, 3), engram_layers=(1,))


def _model(world: int = 1, rank: int = 0, cfg=TINY):
    model = build_model(cfg, seed=0)
    return shard_experts(model, rank, world) if world > 1 else model


def _engine(model, passes=None) -> Engine:
    layout = CacheLayout.private(len(PROMPTS), 80, 16)
    return Engine(model, layout=layout, token_budget=24, passes=passes, keep_logits=True, **EXACT)


def _serve(rank: int, world: int, passes=None, kill_rank_at_step: int | None = None, cfg=TINY) -> dict:
    engine = _engine(_model(world, rank, cfg), passes)
    router = SessionRouter(world)
    ids = {i: engine.add_request(p, n) for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS))
           if router.route(i, len(p) + n) == rank}
    if kill_rank_at_step is not None and rank == 1:
        original = engine.step

        def step():
            if engine.stats.steps == kill_rank_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            return original()
        engine.step = step
    steps, _ = step_together(engine)
    return {"outputs": {i: engine.requests[r].output for i, r in ids.items()}, "steps": steps,
            "hits": engine.stats.prefix_hits, "logits": {i: torch.stack(engine.requests[r].logits) for i, r in ids.items()},
            "counts": engine.step_runner.report().counts() if engine.step_runner else None}


def _one_engine(cfg=TINY) -> Engine:
    engine = _engine(_model(cfg=cfg))
    for p, n in zip(PROMPTS, NEW_TOKENS):
        engine.add_request(p, n)
    while engine.waiting or engine.running:
        engine.step()
    return engine


def test_two_gloo_ranks_return_the_single_process_engines_tokens():
    ranks = launch(_serve, 2, timeout_s=120)
    one = _one_engine()
    want = {i: r.output for i, r in one.requests.items()}
    got = {i: out for r in ranks for i, out in r["outputs"].items()}
    assert sorted(got) == list(range(len(PROMPTS)))  # every request served, by exactly one rank
    assert sum(len(r["outputs"]) for r in ranks) == len(PROMPTS)
    assert got == want
    assert all(len(got[i]) == n for i, n in enumerate(NEW_TOKENS))
    assert ranks[0]["steps"] == ranks[1]["steps"]  # lockstep
    # least routed tokens first: 49 -> 0, 7 -> 1, 65 -> 1, 57 -> 0, 45 -> 1
    assert sorted(ranks[0]["outputs"]) == [0, 3] and sorted(ranks[1]["outputs"]) == [1, 2, 4]
    assert (ranks[0]["hits"], ranks[1]["hits"]) == (1, 0)  # prompt 3 reuses prompt 0's pages on rank 0


def test_two_gloo_ranks_run_the_compiled_step_with_the_passes():
    """Each rank compiles its own regions (the exchange an opaque op in them): the passes fire at
    every layer as on one process, and the logits follow the single-process eager engine's."""
    ranks = launch(_serve, 2, ("all", None, SHALLOW), timeout_s=900)
    one = _one_engine(SHALLOW)
    cfg = one.cfg
    for r in ranks:
        # Mega-MoE does not fuse an expert-parallel layer: its slots cross ranks between the GEMMs and the sum
        assert r["counts"] == {"mega_mhc": 2 * cfg.n_layers + 1, "mega_gate": cfg.n_layers,
                               "mega_attention": cfg.n_layers, "mega_moe": 0,
                               "mega_indexer": 3}
        for i, logits in r["logits"].items():
            assert r["outputs"][i] == one.requests[i].output
            torch.testing.assert_close(logits, torch.stack(one.requests[i].logits), rtol=1e-4, atol=1e-4)


def test_a_rank_killed_mid_run_ends_the_job_naming_it():
    # The collectives' timeout is long on purpose: had the job waited for it, the first failure
    # would be rank 0's timed-out collective, not rank 1's death, and the message would not match.
    with pytest.raises(RankFailure, match=r"^rank 1 was killed by SIGKILL"):
        launch(_serve, 2, (None, 2), timeout_s=600)


def _raise_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        raise ValueError("bad shard")
    torch.distributed.barrier()  # waits on rank 0, which never comes: stopped by the launcher
    return rank


def test_a_rank_that_raises_ends_the_job_with_its_error():
    with pytest.raises(RankFailure, match=r"^rank 0 raised ValueError: bad shard"):
        launch(_raise_on_rank_0, 2, timeout_s=30)


def _identity(rank: int, world: int, extra: str) -> tuple:
    return rank, world, extra, torch.distributed.get_world_size()


def test_launch_returns_the_workers_results_in_rank_order():
    assert launch(_identity, 3, ("x",), timeout_s=60) == [(r, 3, "x", 3) for r in range(3)]
    with pytest.raises(ValueError, match="backend 'mpi'; valid: gloo"):
        launch(_identity, 2, ("x",), backend="mpi")


def test_the_router_keeps_sessions_on_their_rank_and_sends_new_ones_to_the_least_loaded():
    router = SessionRouter(3)
    assert [router.route(s, t) for s, t in [("a", 10), ("b", 5), ("c", 5)]] == [0, 1, 2]
    assert router.route("d", 1) == 1  # ranks 1 and 2 tie at 5: the lower
    assert router.route("a", 100) == 0  # affinity beats load
    assert router.load == [110, 6, 5]
    with pytest.raises(ValueError, match="at least one rank"):
        SessionRouter(0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 50)), min_size=1, max_size=40), st.integers(1, 4))
def test_the_router_is_a_deterministic_least_loaded_assignment(calls, world):
    router, again = SessionRouter(world), SessionRouter(world)
    home, load = {}, [0] * world
    for session, tokens in calls:
        if session not in home:
            home[session] = min(range(world), key=lambda r: (load[r], r))
        load[home[session]] += tokens
        assert router.route(session, tokens) == home[session] == again.route(session, tokens)
    assert router.load == load


def test_an_expert_parallel_engine_refuses_cuda_graphs_and_says_why():
    sharded = shard_experts(_model(), 0, 1)  # a world of one: still every MoE layer a collective
    with pytest.raises(ValueError, match=r"cannot be captured as CUDA graphs: its all-to-all waits on the host"):
        Engine(sharded, layout=CacheLayout.private(1, 32, 16), passes="all", cuda_graphs=True)
    assert Engine(sharded, layout=CacheLayout.private(1, 32, 16), passes=None).lockstep
    assert not _engine(_model()).lockstep
