"""Compiles are the cost of the tool tests (~1.5 min for `tiny` on CPU), so every test in this folder
goes through one session-wide cache in place of `tools.common.compile_model`: the first request for a
(module, passes, device) compiles for real, later ones get the same compiled module back.

The cache compiles with a dump directory of its own and copies those graphs to a caller's
`dump_dir`, so `inspect --out` still writes them. Ablation's `reset_compiler` becomes a no-op (it
would throw the cached graphs away). A cached module compiles once per input shape (static shapes:
the model's regions have a prefill and a decode bucket); `CachedCompile` fails the test when a
shape it has seen compiles again, which would double the report.
"""

import dataclasses
import shutil

import pytest
import torch

from megafuse.tools import common

REAL_COMPILE = common.compile_model  # taken at import, before any test patches it


def _shapes(value):
    """The tensor shapes in a call's arguments (dataclasses, dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if dataclasses.is_dataclass(value):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return tuple(_shapes(v) for v in value)
    return None


class CachedCompile:
    def __init__(self, fused, own_dump, dump_dir, shapes):
        self.fused, self.own_dump, self.dump_dir, self.shapes = fused, own_dump, dump_dir, shapes

    def __call__(self, *args):
        self.shapes.add(_shapes(args))
        out = self.fused(*args)
        assert len(self.fused.report.graphs) == len(self.shapes), "a tool test recompiled a cached module"
        if self.dump_dir is not None:
            shutil.copytree(self.own_dump, self.dump_dir, dirs_exist_ok=True)
        return out

    @property
    def report(self):
        return self.fused.report


class CompileCache:
    def __init__(self, root):
        self.root, self.entries = root, {}

    @staticmethod
    def key(module, names, device):
        """Same kind of module, same weights (a checksum), same passes and device."""
        checksum = round(sum(float(p.detach().double().sum()) for p in module.parameters()), 6)
        return type(module).__name__, checksum, tuple(names), device

    def compile(self, module, names, device, dump_dir=None):
        key = self.key(module, names, device)
        if key not in self.entries:
            own = self.root / f"graphs{len(self.entries)}"
            self.entries[key] = (REAL_COMPILE(module, names, device, dump_dir=own), own, set())
        fused, own, shapes = self.entries[key]
        return CachedCompile(fused, own, dump_dir, shapes)

    def report(self, module, names, device="cpu"):
        return self.entries[self.key(module, names, device)][0].report


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    torch._dynamo.reset()  # start clear of other folders' compiles (Dynamo's per-function recompile limit)
    return CompileCache(tmp_path_factory.mktemp("compiles"))


@pytest.fixture
def cached_compiles(monkeypatch, compile_cache):
    monkeypatch.setattr(common, "compile_model", compile_cache.compile)
    monkeypatch.setattr(common, "reset_compiler", lambda: None)
    return compile_cache


@pytest.fixture(scope="session")
def tiny():
    from megafuse.model import build_model, preset
    with torch.no_grad():
        return build_model(preset("tiny"), seed=0)
