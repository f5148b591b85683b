"""Several ranks (runtime/distributed.py): the engine over 2 gloo processes, each rank its own
requests and a shard of the experts, returns the single-process engine's tokens; a rank that dies
or raises ends the job with the rank and the reason named, within the collectives' timeout; the
session router keeps a session on its rank and balances new ones."""

import os
import signal
import time

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
MODES = {"exact": dict(swa_bounded_replay=False, trim_decoder=False), "default": {}}


def _model(world: int = 1, rank: int = 0):
    model = build_model(preset("tiny").replace(quant="none", dtype="float32"), seed=0)
    return shard_experts(model, rank, world) if world > 1 else model


def _engine(model, mode: str) -> Engine:
    layout = CacheLayout.private(len(PROMPTS), 80, 16)
    return Engine(model, layout=layout, token_budget=24, passes=None, **MODES[mode])


def _serve(rank: int, world: int, mode: str, kill_rank_at_step: int | None = None) -> dict:
    engine = _engine(_model(world, rank), mode)
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
    steps = step_together(engine)
    return {"outputs": {i: engine.requests[r].output for i, r in ids.items()}, "steps": steps,
            "hits": engine.stats.prefix_hits}


def _generate_one_engine(mode: str) -> dict[int, list[int]]:
    engine = _engine(_model(), mode)
    ids = [engine.add_request(p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    while engine.waiting or engine.running:
        engine.step()
    return {i: engine.requests[r].output for i, r in enumerate(ids)}


@pytest.mark.parametrize("mode", ["exact", "default"])
def test_two_gloo_ranks_return_the_single_process_engines_tokens(mode):
    ranks = launch(_serve, 2, (mode,), timeout_s=120)
    want = _generate_one_engine(mode)
    got = {i: out for r in ranks for i, out in r["outputs"].items()}
    assert sorted(got) == list(range(len(PROMPTS)))  # every request served, by exactly one rank
    assert sum(len(r["outputs"]) for r in ranks) == len(PROMPTS)
    assert got == want
    assert all(len(got[i]) == n for i, n in enumerate(NEW_TOKENS))
    assert ranks[0]["steps"] == ranks[1]["steps"]  # lockstep
    # least routed tokens first: 49 -> 0, 7 -> 1, 65 -> 1, 57 -> 0, 45 -> 1
    assert sorted(ranks[0]["outputs"]) == [0, 3] and sorted(ranks[1]["outputs"]) == [1, 2, 4]
    assert (ranks[0]["hits"], ranks[1]["hits"]) == (1, 0)  # prompt 3 reuses prompt 0's pages on rank 0


def test_a_rank_killed_mid_run_ends_the_job_naming_it():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 1 was killed by SIGKILL"):
        launch(_serve, 2, ("exact", 2), timeout_s=30)
    assert time.monotonic() - start < 30  # the job ends, not the collective's timeout


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


def test_an_expert_parallel_engine_runs_the_eager_step_and_says_so():
    sharded = shard_experts(_model(), 0, 1)  # a world of one: still every MoE layer a collective
    with pytest.raises(ValueError, match=r"expert-parallel model runs the eager step \(passes=None\)"):
        Engine(sharded, layout=CacheLayout.private(1, 32, 16), passes="all")
    assert Engine(sharded, layout=CacheLayout.private(1, 32, 16), passes=None).lockstep
    assert not _engine(_model(), "exact").lockstep
