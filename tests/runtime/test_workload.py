"""The agentic workload generator: seeded, with the shape RUNTIME.md asks for."""

import statistics

import pytest

from megafuse.runtime.workload import AgenticWorkload


def test_the_workload_is_seeded_and_has_the_documented_shape():
    w = AgenticWorkload(vocab_size=1000, sessions=200, turns=3, system_prompt=50, seed=1)
    system, sessions = w.build()
    assert (system, sessions) == w.build() and w.build() != AgenticWorkload(vocab_size=1000, sessions=200, seed=2).build()
    assert len(system) == 50 and len(sessions) == 200 and all(len(s.turns) == 3 for s in sessions)
    contexts = [len(s.turns[0].new_tokens) for s in sessions]
    assert 5_000 <= min(contexts) and max(contexts) <= 131_000
    # log-uniform on [5K, 131K]: mean (131K - 5K) / ln(131/5) ~ 38.6K (RUNTIME.md: "about 27K" is a fitted lognormal)
    assert 33_000 < statistics.mean(contexts) < 44_000
    assert statistics.median(contexts) == pytest.approx((5_000 * 131_000) ** 0.5, rel=0.15)
    tools = [len(t.new_tokens) for s in sessions for t in s.turns[1:]]
    assert 500 <= min(tools) and max(tools) <= 4_000
    outputs = sorted(t.max_new_tokens for s in sessions for t in s.turns)
    assert statistics.median(outputs) == pytest.approx(150, rel=0.15)
    assert outputs[int(0.95 * len(outputs))] == pytest.approx(2_000, rel=0.3)
    arrivals = [s.arrival_s for s in sessions]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / w.arrival_rate, rel=0.15)  # Poisson, 0.5 per second


def test_context_cap_clips_and_bad_parameters_are_named():
    _, sessions = AgenticWorkload(vocab_size=10, sessions=20, context_cap=300).build()
    assert max(len(s.turns[0].new_tokens) for s in sessions) == 300
    with pytest.raises(ValueError, match="invalid arrival_rate, output_median"):
        AgenticWorkload(vocab_size=10, arrival_rate=0, output_median=5000)
