"""Compiles are the cost of the tool tests, so they run the tools on tiny's roles at 5 layers
(`tiny_config`, a config JSON of `tests/passes/tiny.every_role_tiny`: a third of tiny's compile
time), and every test in this folder goes through one session-wide cache in place of `tools.common.compile_model`: the first request for a
(module, passes, device) compiles for real, later ones get the same compiled module back.

The cache compiles with a dump directory of its own and copies those graphs to a caller's
`dump_dir`, so `inspect --out` still writes them. Ablation's `reset_compiler` becomes a no-op (it
would throw the cached graphs away). A cached module compiles once per input shape (static shapes:
the model's regions have a prefill and a decode bucket); `CachedCompile` fails the test when a
shape it has seen compiles again, which would double the report.
"""

import dataclasses
import json
import shutil

import pytest
import torch

from megafuse.tools import common
from tests.passes.tiny import every_role_tiny

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
def tiny_config(tmp_path_factory) -> str:
    """`--config` for the tools: tiny's roles at 5 layers, as a config JSON (its name stays "tiny")."""
    path = tmp_path_factory.mktemp("config") / "tiny5.json"
    path.write_text(json.dumps(every_role_tiny().to_dict()))
    return str(path)


@pytest.fixture(scope="session")
def tiny():
    """The model the tools build from `tiny_config` (seed 0, the tools' default)."""
    from megafuse.model import build_model
    with torch.no_grad():
        return build_model(every_role_tiny(), seed=0)
