"""The public entry point: `passes.compile(module, passes=...)` -> a compiled module with a report."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import time
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

from .blocks import BlockCompiler
from .manager import PassManager, graph_label
from .report import CompileReport, GraphReport
from .torch_fixes import eager_roundings

# Progress of a compile, at INFO: each graph Dynamo hands over, what the passes did to it, how long
# Inductor took. Logged under megafuse.* (the tools show it on stderr when their output is a log).
log = logging.getLogger("megafuse.compile")


class FusedModule(nn.Module):
    """A module compiled under megafuse's passes, for inference. Call it like the original: it runs
    under `torch.no_grad()` (with autograd on, AOT autograd would keep every chain's intermediates for
    a backward, and no chain could fuse; the fused ops have no backward). `report` holds what each
    pass matched, rejected (and why) and the time it took, across every graph compiled so far."""

    def __init__(self, module: nn.Module, manager: PassManager, compiled):
        super().__init__()
        self.module = module
        self.manager = manager
        self._compiled = compiled

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self._compiled(*args, **kwargs)

    @property
    def report(self) -> CompileReport:
        return self.manager.report


def compile(module: nn.Module, passes="all", *, blocks: bool = False, pass_options: dict | None = None,
            dump_dir=None, debug_nodes: list[str] | None = None, **torch_compile_kwargs) -> FusedModule:
    """torch.compile `module` for inference (the result runs under torch.no_grad(): FusedModule)
    with megafuse's passes installed for this compile only. A module in training mode compiles too,
    with a UserWarning (once per module) that its outputs carry no grad.

    passes: "all", "none" (the plain Inductor baseline) or a list / comma-separated string of names.
    blocks: compile each child of the module's nn.ModuleLists as a block instead of the module as one
    graph: children of one kind (class, structure, flags) share one compiled graph, so compile time
    no longer grows with depth (passes/blocks.py). The code outside the blocks runs eagerly, and a
    chain that crosses a block boundary cannot fuse whole: that module's docstring states the cost.
    The children's `forward` is replaced in place, as `nn.Module.compile` does. Each block compiles
    as one graph (fullgraph=True unless given).
    pass_options: {pass name: {option: value}}. dump_dir: write each graph before/after each pass.
    debug_nodes: FX node names whose matcher decisions are printed as they are made.
    Everything else goes to torch.compile (e.g. dynamic=True, fullgraph=True, mode=...).

    On torch < 2.12 Inductor keeps the model's bf16 round trips here (passes/torch_fixes.py), as
    torch 2.12 does: the compiled graph computes what eager computes.

    Inductor's FX graph cache stays on: a graph compiled before (same code, inputs, options and
    passes) is served from it, with the report it had (see _InductorWithReports). dump_dir and
    debug_nodes turn the cache off for this compile unless options say otherwise: what they show
    exists only where the passes run.
    """
    manager, inductor = _backend(passes, pass_options, dump_dir, debug_nodes, torch_compile_kwargs)
    _warn_if_training(module)
    if not blocks:
        return FusedModule(module, manager, torch.compile(module, backend=inductor, **torch_compile_kwargs))
    # a graph break would leave part of a block in graphs of other frames, which the report cannot
    # attribute to the layers that run them: a block is one graph, or an error naming the break
    torch_compile_kwargs.setdefault("fullgraph", True)
    compiler = BlockCompiler(manager, inductor, names={id(m): name for name, m in module.named_modules()},
                             **torch_compile_kwargs)
    for child in repeated_blocks(module):
        child.forward = functools.partial(compiler, type(child).forward, child)
    return FusedModule(module, manager, module)


# Modules already warned about training mode: a module compiled again is not warned about again.
_warned_training: weakref.WeakSet = weakref.WeakSet()


def _in_training_mode(module: nn.Module) -> bool:
    """Whether a module that holds weights (parameters or buffers of its own) is in training mode; a
    wrapper that holds none (the runtime's EncoderRegion around an eval model) counts by what it wraps."""
    holders = [m for m in module.modules()
               if next(itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)), None) is not None]
    return any(m.training for m in holders) if holders else module.training


def _warn_if_training(module: nn.Module) -> None:
    """A module left in training mode (nn.Module's default, or after .train()) compiles all the same,
    but its outputs carry no grad, which nothing else would say: warn, once per module."""
    if module in _warned_training or not _in_training_mode(module):
        return
    _warned_training.add(module)
    warnings.warn(f"passes.compile: {type(module).__name__} is in training mode, and megafuse compiles for "
                  "inference: the outputs carry no grad (the compiled module runs under torch.no_grad()). Call "
                  "model.eval() before compiling; use torch.compile to train.", UserWarning, stacklevel=3)


def block_compiler(passes="all", *, names: dict[int, str], mark_dynamic=None, pass_options: dict | None = None,
                   **torch_compile_kwargs) -> BlockCompiler:
    """A `BlockCompiler` (passes/blocks.py) with megafuse's passes: `compiler(function, module, *args)`
    runs `function(module, *args)` compiled once per kind of module. For code that runs its own
    blocks, as the runtime's step does; arguments as `compile`'s."""
    manager, inductor = _backend(passes, pass_options, None, None, torch_compile_kwargs)
    return BlockCompiler(manager, inductor, names=names, mark_dynamic=mark_dynamic, **torch_compile_kwargs)


def _backend(passes, pass_options, dump_dir, debug_nodes, torch_compile_kwargs: dict):
    """(the pass manager, Inductor with it installed); takes Inductor's own arguments out of
    `torch_compile_kwargs` (backend, mode, options), leaving torch.compile's."""
    backend = torch_compile_kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"megafuse passes run inside Inductor; backend must be 'inductor', got {backend!r}")
    manager = PassManager(passes, options=pass_options, dump_dir=dump_dir, debug_nodes=debug_nodes)
    inductor_options = dict(torch_compile_kwargs.pop("options", None) or {})
    if "post_grad_custom_post_pass" in inductor_options:
        raise ValueError("options['post_grad_custom_post_pass'] is where megafuse installs its pass manager; "
                         "pass your own pass as a megafuse pass instead")
    inductor_options["post_grad_custom_post_pass"] = manager
    if dump_dir is not None or debug_nodes:  # graphs and decisions exist only where the passes run
        inductor_options.setdefault("fx_graph_cache", False)
    inductor = _InductorWithReports(manager, torch_compile_kwargs.pop("mode", None), inductor_options,
                                    torch_compile_kwargs.get("dynamic"))
    return manager, inductor


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The children of the outermost nn.ModuleLists under `module` (a model's layers)."""
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    inner = {id(m) for outer in lists for child in outer for m in child.modules()}
    children = [child for m in lists if id(m) not in inner for child in m]
    if not children:
        raise ValueError(f"blocks=True compiles the children of nn.ModuleLists, and {type(module).__name__} has "
                         "none; pass blocks=False to compile it as one graph")
    return children


class _InductorWithReports(torch._TorchCompileInductorWrapper):
    """Inductor as torch.compile's backend (the same mode and options handling), keeping each
    graph's pass report beside Inductor's caches.

    Inductor's FX graph cache (and AOT autograd's) serves a graph compiled before without running
    the post-grad passes, so the passes cannot report on it. The manager's uuid is part of those
    caches' keys, so a served graph was compiled with these passes; its report is stored when it is
    compiled and read back when it is served, under a key of the same things: the Dynamo graph's
    code, its inputs' shapes, strides and dtypes, the Inductor options and the manager's uuid.
    A served graph with no stored report is compiled again with the caches off, so that it has one
    (counted in `CompileReport.unreported` should that compile be served too: never hidden).
    """

    def __init__(self, manager: PassManager, mode, options: dict, dynamic):
        super().__init__(mode, options, dynamic)
        self.manager = manager

    def __eq__(self, other):  # another manager is another backend: its report must be written
        return super().__eq__(other) and self.manager is getattr(other, "manager", None)

    def __call__(self, graph, example_inputs, **kwargs):
        report = self.manager.report
        before, start = len(report.graphs), time.perf_counter()
        label = graph_label(before + report.unreported)
        log.info("%s: %d FX nodes from Dynamo; AOT autograd, the passes and Inductor's codegen next",
                 label, len(graph.graph.nodes))
        with eager_roundings():
            compiled = super().__call__(graph, example_inputs, **kwargs)
        stored = _report_dir() / f"{self._key(graph, example_inputs)}.json"
        if len(report.graphs) == before and not stored.exists():
            # Served from Inductor's FX graph cache, which keys on the graph after AOT autograd: another
            # Dynamo graph (say, code that changed but lowers the same) can be served a graph whose
            # report was stored under another key. Compile it again with the caches off: the passes
            # run and report, and the report is stored under this key.
            log.info("%s: served from Inductor's cache without a stored report; compiling it again "
                     "with the caches off", label)
            patches = {**(kwargs.pop("config_patches", None) or {}), "fx_graph_cache": False}
            with eager_roundings(), torch._functorch.config.patch(enable_autograd_cache=False):
                compiled = super().__call__(graph, example_inputs, config_patches=patches, **kwargs)
        log.info("%s: compiled in %.1f s (%s)", label, time.perf_counter() - start,
                 "the passes ran" if len(report.graphs) > before else "from Inductor's cache")
        compile_id = str(torch._guards.CompileContext.current_compile_id())
        if len(report.graphs) > before:  # the passes ran
            stored.parent.mkdir(parents=True, exist_ok=True)
            stored.write_text(json.dumps([g.to_dict() for g in report.graphs[before:]]))
        elif stored.exists():
            for data in json.loads(stored.read_text()):
                graph_report = GraphReport.from_dict(data)
                graph_report.cached = True
                report.graphs.append(graph_report)
        else:
            report.unreported += 1
        for graph_report in report.graphs[before:]:
            graph_report.compile_id = compile_id
        return compiled

    def _key(self, graph, example_inputs) -> str:
        inputs = [(tuple(x.shape), x.stride(), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor) else x
                  for x in example_inputs]
        options = {k: v for k, v in self.config.items() if k != "post_grad_custom_post_pass"}
        key = [torch.__version__, self.manager.uuid(), graph.code, repr(inputs), repr(sorted(options.items()))]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def _report_dir() -> Path:
    """Beside Inductor's own caches, so that clearing those clears these too."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return Path(cache_dir()) / "megafuse_reports"
