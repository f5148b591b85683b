"""Compiling repeated blocks once (regional compilation): each distinct kind of layer is traced,
passed over and lowered one time, and every layer of that kind runs the same compiled graph with
its own weights.

    blocks = passes.block_compiler("all", names={id(m): name for name, m in model.named_modules()})
    out = blocks(Block.step, model.layers[3], *args)     # torch.compile(Block.step), called with the layer

Why it holds: `torch.compile(function)` keeps its graphs on the function's code, each behind the
guards of what its trace read: the inputs' shapes, strides and dtypes, and the Python values that
steered it (a module's flags, which submodules exist). Dynamo inlines nn modules, so a module's
parameters are inputs of the graph, not constants in it. Layers of one kind (same class,
structure, shapes and flags) pass the same guards and share one graph; a layer that differs in
anything the trace read compiles a graph of its own. A block function must therefore not read a
per-layer value, such as the layer's index: it would make every layer a kind of its own. The
model's layers take their cache pools and their inputs from other layers as arguments for this
reason (model/cache.py `LayerCache`, model/attention.py `Selection`).

What a boundary costs: a fusion sees one graph, so a chain that crosses the boundary between two
blocks cannot fuse whole. The model's layers end before the mHC post of their FFN and begin with
the previous layer's (model/mhc.py `Residual`), so its seams stay inside one block. A model whose
seams straddle the boundary (HF's DeepseekV4: each layer ends with its FFN's post) keeps each
seam's post outside the fused op: one unfused elementwise kernel per layer, which re-reads the
streams the fused seam would have read once. A value built outside the blocks reaches them as an
input the passes cannot read: HF's attention mask, so its attention stays unfused (the report
says "the scores are not masked"). `passes.compile(..., blocks=False)`, the default, compiles the
whole module as one graph instead.

Which graph ran which block is read from Dynamo's own cache: after a call, the first cache entry of
the function whose guards accept the call's arguments is the one that ran (`_served_by`), and
each graph's report names the blocks it served (`GraphReport.blocks`), so `CompileReport.counts()`
counts a fused site once per layer that runs it. The guards are checked only when a graph was
compiled since the block was last attributed (no new entry, no new answer), which keeps them off
the hot path; a block whose calls alternate between static-shape graphs of one kind stays
attributed to the graph it ran when the newest graph was compiled.
"""

from __future__ import annotations

import inspect
import time

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

from .manager import PassManager
from .report import GraphReport

# Graphs one function may hold: its kinds of layer, for every pass selection a process compiles
# (bench-serve compiles two). Dynamo's default of 8 would stop a deep model's kinds; past this
# limit the compile fails (fail_on_recompile_limit_hit) rather than run a block eagerly.
RECOMPILE_LIMIT = 256


class BlockCompiler:
    """`compiler(function, module, *args)`: `function(module, *args)` through a torch.compile of
    `function` shared by every module it is called with; see the module docstring.

    manager: the passes (one PassManager: its report gathers every graph). backend: the compile's
    backend (passes.api builds it: Inductor with the passes installed and reports stored).
    names: module id -> the name its graphs' reports give it (e.g. "layers.3").
    mark_dynamic: called with (function, args) before each call to mark the sizes that vary
    between calls (a runtime's row counts) as dynamic, so one graph serves them all. Given one,
    no other size becomes dynamic: a block whose pools differ in size from another's (a cache of
    another compress ratio) is a kind of its own, not a reason to make every kind generic."""

    def __init__(self, manager: PassManager, backend, *, names: dict[int, str], mark_dynamic=None,
                 **torch_compile_kwargs):
        self.manager, self.backend, self.names = manager, backend, names
        self.mark_dynamic = mark_dynamic
        self._config = dict(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True)
        if mark_dynamic is not None:
            self._config["automatic_dynamic_shapes"] = False
        self._latest: dict[str, list[GraphReport]] = {}  # block name -> the graphs its latest call ran
        self._attributed_at: dict[str, int] = {}  # block name -> graphs compiled when it was attributed
        self.torch_compile_kwargs = torch_compile_kwargs
        self.compile_s = 0.0  # wall time of the calls that compiled a graph (cold or from the caches)
        self._compiled: dict = {}  # function -> its torch.compile
        self._signatures: dict = {}

    @property
    def report(self):
        return self.manager.report

    def __call__(self, function, module: torch.nn.Module, *args, **kwargs):
        compiled = self._compiled.get(function)
        if compiled is None:
            compiled = torch.compile(function, backend=self.backend, **self.torch_compile_kwargs)
            # the code Dynamo runs is `function`'s own, a decorator's wrapper included: its parameters
            # are the frame's locals, not those of the function it wraps
            self._compiled[function] = compiled
            self._signatures[function] = inspect.signature(function, follow_wrapped=False)
        if self.mark_dynamic is not None:
            self.mark_dynamic(function, args)
        graphs = self.report.graphs
        before, start = len(graphs), time.perf_counter()
        with torch.no_grad(), torch._dynamo.config.patch(**self._config):
            out = compiled(module, *args, **kwargs)
        if len(graphs) > before:
            self.compile_s += time.perf_counter() - start
        name = self.names.get(id(module)) or type(module).__name__  # the root module is named ""
        if self._attributed_at.get(name) == len(graphs):
            return out  # no graph compiled since: the entry that ran it before ran it again
        self._attributed_at[name] = len(graphs)
        served = self._served_by(function, module, args, kwargs)
        if list(map(id, served)) != list(map(id, self._latest.get(name, []))):
            for graph in self._latest.get(name, []):
                graph.blocks.remove(name)
            for graph in served:
                graph.blocks = (graph.blocks or []) + [name]
            self._latest[name] = served
        return out

    def _served_by(self, function, module, args, kwargs) -> list[GraphReport]:
        """The graphs of this compiler whose cache entry accepts these arguments (the one that ran)."""
        arguments = self._signatures[function].bind(module, *args, **kwargs)
        arguments.apply_defaults()
        frame_locals = dict(arguments.arguments)
        if function.__closure__:  # a frame's locals hold its free variables too (`__class__` for super())
            frame_locals.update(zip(function.__code__.co_freevars, (c.cell_contents for c in function.__closure__)))
        mine = {}
        for graph in self.report.graphs:
            mine.setdefault(graph.compile_id, []).append(graph)
        with torch.no_grad():  # the guards check grad mode as the call saw it
            for entry in _debug_get_cache_entry_list(function.__code__):
                if str(entry.compile_id) in mine and entry.guard_manager.check(frame_locals):
                    return mine[str(entry.compile_id)]
        raise RuntimeError(f"no compiled graph of {function.__qualname__} accepts the call it just ran "
                           f"({self.names.get(id(module))}): Dynamo's cache changed under the block compiler")
