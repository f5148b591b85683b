"""MegaAttention on generated spellings: a sink attention written outside the project
(tests/passes/attention_spellings.py) in either layout, with either form of the max, in fp32 or
bf16, on the CPU's graph or the GPU's forms, drawn by hypothesis from discrete choices
(derandomized: CI runs the same draws every time), compiled through Inductor's real post-grad
passes (`post_grad.fuse`) and run with the generated kernel (the Triton interpreter on the CPU).

Every spelling fuses exactly once, its chain's ops are gone, and the fused output equals an fp64
reference within the output's rounding; the eager module equals the same reference, so each
spelling is the attention. A near miss stays unfused with the reason in the report.
"""

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.passes.attention_spellings import CHOICES, NEAR_MISSES, Spelling, check_fused, check_near_miss

# Generate, never shrink: a failure names its whole spelling, and each step of a shrink compiles one.
FIND = (Phase.explicit, Phase.generate)


def spellings(**fixed) -> st.SearchStrategy[Spelling]:
    """Attentions in any spelling; `fixed`: field -> its choices."""
    fields = {**CHOICES, **fixed}
    drawn = {name: st.sampled_from(choices) for name, choices in fields.items()}
    return st.builds(Spelling, **drawn).map(Spelling.valid)


def _run(strategy, check, examples: int) -> set:
    """`check` on `examples` draws of a fixed seed; the distinct spellings seen."""
    seen = set()

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None, phases=FIND,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(spelling):
        check(spelling)
        seen.add(spelling)

    run()
    return seen


def _near_misses(examples: int) -> set:
    refused = set()
    for name, near in NEAR_MISSES.items():
        refused |= _run(spellings(**near.fixed).map(lambda s, name=name: dataclasses.replace(s, near_miss=name)),
                        check_near_miss, examples)
    return refused


def test_generated_spellings_fuse_once_and_equal_the_reference():
    seen = _run(spellings(), check_fused, examples=90)
    assert len(seen) >= 85
    for field, choices in CHOICES.items():  # every choice drawn at least once
        assert {getattr(s, field) for s in seen} == set(choices), field


def test_near_misses_stay_unfused_with_the_reason():
    refused = _near_misses(2)
    assert {s.near_miss for s in refused} == set(NEAR_MISSES) and len(refused) >= 2 * len(NEAR_MISSES) - 2


@pytest.mark.exhaustive  # `make test-all`: about two minutes more on 2 CPU cores
def test_many_more_generated_spellings():
    assert len(_run(spellings(), check_fused, examples=200)) >= 180
    assert len(_near_misses(6)) >= 5 * len(NEAR_MISSES)
