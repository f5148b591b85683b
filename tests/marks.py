"""Parametrisations split between `make test-fast` and `make test`."""

import pytest


def slow_beyond(values, fast: int = 1) -> list:
    """`values` for `pytest.mark.parametrize`, all but the first `fast` marked `slow`: `make test-fast`
    runs those representatives, `make test` (CI) runs every value."""
    def param(v, marks=()):
        return pytest.param(*v, marks=marks) if isinstance(v, tuple) else pytest.param(v, marks=marks)
    return [param(v) if i < fast else param(v, pytest.mark.slow) for i, v in enumerate(values)]
