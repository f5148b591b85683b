"""The README's Python blocks run as written, in order, in one namespace (a reader runs them one
after the other), and what they print is what the README says they print."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def printed_claims(block: str) -> list[str]:
    """`print(...)  # <what it prints> on tiny`: the claims a block makes about its output."""
    return [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+#\s*(.*?)\s+on tiny\s*$", block, flags=re.M)]


def test_the_readme_has_the_blocks_this_test_runs():
    blocks = python_blocks()
    assert len(blocks) == 2, "a Python block was added or removed: run it here too"
    assert printed_claims(blocks[1]) == ["{'mega_mhc': 25, 'mega_gate': 12}"]


@pytest.mark.slow  # the second block compiles the whole tiny model
def test_every_python_block_runs_as_written_and_prints_what_the_readme_says():
    torch._dynamo.reset()
    namespace: dict = {}
    for block in python_blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), torch.enable_grad():  # as a reader runs them (the suite runs under no_grad)
            exec(compile(block, str(README), "exec"), namespace)
        assert out.getvalue().splitlines() == printed_claims(block), block
    # what the blocks' comments say of their results: [1, 32, vocab] logits, one decode step a token
    assert namespace["logits"].shape == (1, 32, namespace["cfg"].vocab_size)
    assert [s.shape[1] for s in namespace["step"]] == [8] + [1] * 24
    assert not namespace["logits"].requires_grad  # passes.compile compiles for inference
