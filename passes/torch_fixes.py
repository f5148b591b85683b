"""Inductor fixes megafuse's compiles need on older torch: graphs that compute what eager computes.

torch 2.11's joint-graph pattern `pointless_convert` rewrites convert(convert(x, bf16), fp32) as
convert(x, fp32): a value the model rounds to bf16 and widens again is read unrounded. Compiled code
then computes another function than the eager model (tiny in bf16: logits 3.6% from eager at 24
tokens), and a seam whose X' lost its rounding reads differently from the seam Mega-mHC fuses, so
it stays unfused. torch 2.12 keeps a narrower intermediate (pytorch/pytorch#180575).

`eager_roundings()` applies that fix to the pattern while passes.compile's Inductor compiles a
graph, on torch < 2.12 only; elsewhere, and in every other compile of the process, the pattern is
torch's own.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.torch_version import TorchVersion

log = logging.getLogger("megafuse.compile")
_state = threading.local()  # .active: inside a megafuse compile on this thread


def _narrower_intermediate(match) -> bool:
    """The rounding the fix keeps: convert(convert(x, dtype1), dtype2) with dtype1 narrower."""
    dtype1, dtype2 = match.kwargs.get("dtype1"), match.kwargs.get("dtype2")
    return isinstance(dtype1, torch.dtype) and isinstance(dtype2, torch.dtype) and dtype1.itemsize < dtype2.itemsize


def _keep_roundings_in(entry) -> None:
    """Make the pattern entry decline a narrower intermediate while a megafuse compile is active."""
    torch_check = entry.extra_check

    def check(match) -> bool:
        if getattr(_state, "active", False) and _narrower_intermediate(match):
            return False
        return torch_check(match)

    entry.extra_check = check


def _pointless_convert_entries() -> list:
    from torch._inductor.fx_passes import joint_graph
    return [entry for entries in joint_graph.patterns.patterns.values() for entry in entries
            if getattr(entry, "handler", None) is joint_graph.pointless_convert]


NEEDS_ROUNDING_FIX = TorchVersion(torch.__version__) < (2, 12)
_installed = False
_install_lock = threading.Lock()


@contextlib.contextmanager
def eager_roundings():
    """While active (on this thread), Inductor keeps the model's narrowing round trips."""
    global _installed
    if NEEDS_ROUNDING_FIX and not _installed:
        with _install_lock:
            if not _installed:
                entries = _pointless_convert_entries()
                if not entries:
                    log.warning("torch %s: Inductor's pointless_convert pattern was not found; compiled graphs "
                                "may read bf16 round trips unrounded", torch.__version__)
                for entry in entries:
                    _keep_roundings_in(entry)
                _installed = True
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous
