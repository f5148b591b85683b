"""The pass manager: an Inductor CustomGraphPass that runs the enabled fusion passes in order.

It is installed as `post_grad_custom_post_pass` through `torch.compile(options=...)`, so it acts
only on the compile it was given to and leaves no global state behind. Its `uuid()` is the FX graph
cache key for the passes: it hashes the enabled passes, their options and their source, so Inductor
never serves a graph compiled with different passes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import registry
from .report import CompileReport, GraphReport


log = logging.getLogger("megafuse.passes")


def graph_label(index: int) -> str:
    """`graph <index> (<function>, frame <Dynamo compile id>)`: the index counts one report's graphs,
    so two compiles (two blocks, two regions) each have a graph 0; the function and Dynamo's
    compile id tell them apart in a log."""
    context = torch._guards.TracingContext.try_get()
    traced = context.get_traced_code() if context is not None else []
    compile_id = torch._guards.CompileContext.current_compile_id()
    where = ", ".join(filter(None, [traced[0].co_qualname if traced else None,
                                    f"frame {compile_id}" if compile_id is not None else None]))
    return f"graph {index}" + (f" ({where})" if where else "")


class PassManager(CustomGraphPass):
    def __init__(self, passes="all", *, options: dict | None = None, dump_dir: str | Path | None = None,
                 debug_nodes: list[str] | None = None):
        options = options or {}
        self.names = registry.resolve(passes)
        unknown = set(options) - set(registry.available())
        if unknown:
            raise ValueError(f"options given for unknown passes {sorted(unknown)}; valid passes: {', '.join(registry.available())}")
        self.passes = [registry.get(n)(**options.get(n, {})) for n in self.names]
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.debug_nodes = set(debug_nodes or ())
        self.report = CompileReport(self.names)

    def __call__(self, graph: fx.Graph) -> None:
        graph_report = GraphReport()
        index = len(self.report.graphs)
        for fusion_pass in self.passes:
            self._dump(graph, index, fusion_pass.name, "before")
            pass_report = fusion_pass.run(graph)
            graph_report.passes.append(pass_report)
            log.info("%s: %s: %d matched, %d rejected in %.2f s", graph_label(index), fusion_pass.name,
                     len(pass_report.matches), len(pass_report.rejections), pass_report.time_s)
            self._dump(graph, index, fusion_pass.name, "after")
            for node in self.debug_nodes & set(pass_report.decisions):
                print(f"[megafuse debug] {fusion_pass.name} at {node}: {pass_report.decisions[node]}", file=sys.stderr)
        self.report.graphs.append(graph_report)

    def _dump(self, graph: fx.Graph, index: int, name: str, when: str) -> None:
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            (self.dump_dir / f"graph{index:03d}_{name}_{when}.txt").write_text(str(graph))

    def uuid(self) -> str:
        """The passes' part of Inductor's cache keys: the enabled passes and their options, and the
        code of every module that can change a match or a support decision (the passes package
        and the lowering package, whose support checks the passes consult)."""
        key = {
            "passes": [(p.name, p.options, p.source()) for p in self.passes],  # (a user's pass lives elsewhere)
            "code": [(str(path.relative_to(_ROOT)), path.read_text()) for path in _deciding_modules()],
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


_ROOT = Path(__file__).parent.parent


def _deciding_modules() -> list[Path]:
    """Every module of passes/ and lowering/, packages included: what decides a match or a support
    check lives there (read at each uuid(), so a module added later counts too)."""
    return sorted(path for folder in ("passes", "lowering") for path in (_ROOT / folder).rglob("*.py"))
