"""The public entry point: `passes.compile(module, passes=...)` -> a compiled module with a report."""

from __future__ import annotations

import torch
from torch import nn

from .manager import PassManager
from .report import CompileReport


class FusedModule(nn.Module):
    """A module compiled under megafuse's passes. Call it like the original; `report` holds what
    each pass matched, rejected (and why) and the time it took, across every graph compiled so far."""

    def __init__(self, module: nn.Module, manager: PassManager, compiled):
        super().__init__()
        self.module = module
        self.manager = manager
        self._compiled = compiled

    def forward(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)

    @property
    def report(self) -> CompileReport:
        return self.manager.report


def compile(module: nn.Module, passes="all", *, pass_options: dict | None = None, dump_dir=None,
            debug_nodes: list[str] | None = None, **torch_compile_kwargs) -> FusedModule:
    """torch.compile `module` with megafuse's passes installed for this compile only.

    passes: "all", "none" (the plain Inductor baseline) or a list / comma-separated string of names.
    pass_options: {pass name: {option: value}}. dump_dir: write each graph before/after each pass.
    debug_nodes: FX node names whose matcher decisions are printed as they are made.
    Everything else goes to torch.compile (e.g. dynamic=True, fullgraph=True, mode=...).
    """
    backend = torch_compile_kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"megafuse passes run inside Inductor; backend must be 'inductor', got {backend!r}")
    manager = PassManager(passes, options=pass_options, dump_dir=dump_dir, debug_nodes=debug_nodes)
    inductor_options = dict(torch_compile_kwargs.pop("options", None) or {})
    if "post_grad_custom_post_pass" in inductor_options:
        raise ValueError("options['post_grad_custom_post_pass'] is where megafuse installs its pass manager; "
                         "pass your own pass as a megafuse pass instead")
    inductor_options["post_grad_custom_post_pass"] = manager
    # The report is written by running the passes; an FX-graph-cache hit would skip them and leave
    # it empty. The cache stays correct either way (the manager's uuid is in its key), so
    # `options={"fx_graph_cache": True}` trades the report for compile time.
    inductor_options.setdefault("fx_graph_cache", False)
    compiled = torch.compile(module, backend="inductor", options=inductor_options, **torch_compile_kwargs)
    return FusedModule(module, manager, compiled)
