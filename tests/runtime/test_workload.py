"""The agentic workload generator: seeded, with the shape docs/serving.md describes, at every scale."""

import math
import statistics

import pytest

from megafuse.runtime.workload import SCALES, AgenticWorkload


def test_the_workload_is_seeded_and_has_the_documented_shape():
    w = AgenticWorkload(vocab_size=1000, sessions=200, turns=3, system_prompt=50, seed=1)
    system, sessions = w.build()
    assert (system, sessions) == w.build() and w.build() != AgenticWorkload(vocab_size=1000, sessions=200, seed=2).build()
    assert len(system) == 50 and len(sessions) == 200 and all(len(s.turns) == 3 for s in sessions)
    contexts = [len(s.turns[0].new_tokens) for s in sessions]
    assert 5_000 <= min(contexts) and max(contexts) <= 131_000
    # log-uniform on [5K, 131K]: mean (131K - 5K) / ln(131/5) ~ 38.6K
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


def test_full_scale_is_the_default_workload_and_small_scales_every_length_by_one_hundredth():
    assert AgenticWorkload.at_scale("full", vocab_size=1000) == AgenticWorkload(vocab_size=1000)
    small = AgenticWorkload.at_scale("small", vocab_size=1000)
    # 2000, 5K-131K, 500-4000, 150 / 2000 tokens x 0.01, rounded (1.5 rounds to 2)
    assert (small.sessions, small.turns, small.system_prompt) == (4, 2, 20)
    assert (small.context, small.tool_result, small.output_median, small.output_p95) == ((50, 1310), (5, 40), 2, 20)
    assert (small.arrival_rate, small.think_time_s) == (0.5, 1.0)  # times are not lengths
    assert SCALES["small"].lengths == 0.01


def test_every_prompt_of_the_small_scale_is_within_its_scaled_bounds():
    w = AgenticWorkload.at_scale("small", vocab_size=1000, sessions=300, turns=3, seed=3)
    system, sessions = w.build()
    assert len(system) == 20
    contexts = [len(s.turns[0].new_tokens) for s in sessions]
    tools = [len(t.new_tokens) for s in sessions for t in s.turns[1:]]
    outputs = sorted(t.max_new_tokens for s in sessions for t in s.turns)
    assert 50 <= min(contexts) and max(contexts) <= 1310 and 5 <= min(tools) and max(tools) <= 40
    # the shape is kept, not clipped: the log-uniform median is the geometric mean of the range
    assert statistics.median(contexts) == pytest.approx(math.sqrt(50 * 1310), rel=0.15)
    assert sum(c == 1310 for c in contexts) < 5  # no mass piled on the upper end
    assert statistics.median(outputs) == 2 and outputs[int(0.95 * len(outputs))] == pytest.approx(20, rel=0.35)
    for s in sessions:  # prompt k = system + first context + (output + tool result) per earlier turn
        prompt = 20 + len(s.turns[0].new_tokens)
        for before, turn in zip(s.turns, s.turns[1:]):
            prompt += before.max_new_tokens + len(turn.new_tokens)
            assert prompt <= 20 + 1310 + 2 * (max(outputs) + 40)


def test_given_fields_replace_the_scale_as_written_and_bad_parameters_are_named():
    w = AgenticWorkload.at_scale("small", vocab_size=10, sessions=2, context=(8, 8), system_prompt=0)
    system, sessions = w.build()
    assert system == [] and len(sessions) == 2 and all(len(s.turns[0].new_tokens) == 8 for s in sessions)
    assert w.tool_result == (5, 40)  # the scale's, where nothing replaced it
    with pytest.raises(ValueError, match="unknown workload scale 'tiny'; valid scales: full, small"):
        AgenticWorkload.at_scale("tiny", vocab_size=10)
    with pytest.raises(ValueError, match="invalid arrival_rate, output_median"):
        AgenticWorkload(vocab_size=10, arrival_rate=0, output_median=5000)
    with pytest.raises(ValueError, match="invalid context"):
        AgenticWorkload.at_scale("small", vocab_size=10, context=(9, 8))
