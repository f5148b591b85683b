"""The step the engine runs: the model's two regions compiled with the passes, and on a GPU each
region captured as a CUDA graph per padded bucket (piecewise CUDA graphs).

    step = CompiledStep(model, layout=layout, passes="all", cuda_graphs=True, buckets=(2, 8, 32, 256))
    rows, decoder_rows = step.bucket(n_rows, n_decoder_rows)      # pad build_step to these
    logits = step(batch, step.cache)

The step owns the byte cache it runs on (`step.cache`, allocated for `layout`): a CUDA graph
replays on the addresses it captured, so engines that share a step share its cache, one at a time.

Static shapes per bucket (docs/serving.md, invariant 5): a step is padded to a bucket, the smallest
bucket size at least its row count, and its decoder rows to the smallest at least theirs; each
(rows, decoder rows) pair is captured once. The compiled regions take the row counts as symbolic
sizes (the batch's row tensors are marked dynamic), so one graph of each region serves every
bucket. Buckets hold at least 2 rows, and a step without decoder rows (a non-final chunk under the
trim) pads to the smallest bucket of them too: 0 and 1 are sizes Dynamo specialises on, which
would compile graphs of their own (the padding rows cost a decode of that many rows). A bucket is
prepared (compiled where new, captured) the first time a step needs it, so the buckets a workload
never uses cost nothing and `setup_s` says how much of a call was set-up. With CUDA graphs it is
compiled and captured on a batch of padding rows before the step runs; without them it is compiled
on the step's own batch, whose first run then counts as set-up (one run per step: on an
expert-parallel model every run is a collective).

Compiled once per kind of layer (`blocks=True`, the default): the regions run as Python loops over
their layers, and each layer runs a graph compiled once for its kind (role, flags, shapes and
dtypes: passes/blocks.py), the head one of its own. A model of 40 layers of a handful of kinds
compiles a handful of graphs, and Inductor's caches serve them to the next process. Each layer
ends before its FFN's mHC post and the next begins with it (model/mhc.py `Residual`), so every
seam fuses whole. `blocks=False` compiles each region as one graph of all its layers instead
(the same fusions; compile time grows with depth).

The pieces: the encoder region (layers 0..L/2) and the decoder region (layers > L/2 and the
head) are captured separately, the decoder's graph reading the encoder graph's static outputs.
Padding rows write only the cache's scratch slot and page, so the capture itself (run on an
all-padding batch) leaves every request's cache untouched. All graphs share one memory pool:
they replay one at a time, and each step's logits are read before the next replay. The largest
bucket is captured first, whatever bucket is asked for first, so that every later graph can reuse
memory the pool already holds rather than grow it (`prepare`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, fields

import torch

from megafuse import passes as megafuse_passes
from megafuse.model import CacheLayout, DecoderRegion, EncoderRegion, KVCache, StepBatch, build_step
from megafuse.model.attention import Selection
from megafuse.model.batch import Rows
from megafuse.passes.report import CompileReport


def default_buckets(token_budget: int) -> tuple[int, ...]:
    """Powers of two from 2 below the token budget, then the budget: a step never exceeds it."""
    sizes, size = [], 2
    while size < token_budget:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max(token_budget, 2),)


@dataclass
class GraphStats:
    buckets: int = 0  # (rows, decoder rows) buckets run so far
    first_run_s: float = 0.0  # their first runs, compiles included
    graphs: int = 0  # graphs compiled: per kind of layer and the head, or per region (blocks=False)
    graphs_from_cache: int = 0  # of those, served by Inductor's caches (a warm start)
    compile_s: float = 0.0  # of first_run_s, the calls that compiled a graph
    captures: int = 0  # buckets captured as CUDA graphs
    capture_s: float = 0.0
    graph_bytes: int = 0  # device memory the graphs' pool reserves


class _Pieces:
    """One bucket's captured regions: static inputs (the batch), static outputs (the logits)."""

    def __init__(self, batch: StepBatch, encoder_graph, decoder_graph, logits):
        self.batch, self.encoder_graph, self.decoder_graph, self.logits = batch, encoder_graph, decoder_graph, logits

    def replay(self, batch: StepBatch) -> torch.Tensor:
        _copy_batch(self.batch, batch)
        self.encoder_graph.replay()
        self.decoder_graph.replay()
        return self.logits


def _mark_rows_dynamic(batch: StepBatch) -> None:
    """The row counts become symbolic sizes (buckets hold 2 or more rows)."""
    tensors = [getattr(rows, f.name) for rows in (batch.rows, batch.decoder) for f in fields(Rows)]
    for t in tensors + [batch.decoder_index]:
        torch._dynamo.mark_dynamic(t, 0)


def _mark_layer_rows_dynamic(function, args) -> None:
    """A layer's (or the head's) inputs from the layer before: the residual, pre and the selection,
    all [1, rows, ...]. Their row count is symbolic too, so one graph per kind serves every bucket."""
    tensors = [t for t in args[0] if t is not None] + [args[1]]
    if isinstance(args[-1], Selection):
        tensors += [t for t in args[-1] if t is not None]
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 1)


def _copy_batch(static: StepBatch, batch: StepBatch) -> None:
    for rows_static, rows in ((static.rows, batch.rows), (static.decoder, batch.decoder)):
        for f in fields(Rows):
            getattr(rows_static, f.name).copy_(getattr(rows, f.name), non_blocking=True)
    static.decoder_index.copy_(batch.decoder_index, non_blocking=True)
    static.page_table.copy_(batch.page_table, non_blocking=True)


class CompiledStep:
    """`run(batch, cache) -> logits` for the engine: the compiled regions, replayed as CUDA graphs."""

    def __init__(self, model, *, layout: CacheLayout, buckets: tuple[int, ...], passes="all",
                 cuda_graphs: bool = False, blocks: bool = True):
        sizes = tuple(int(b) for b in buckets)
        if not sizes or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"buckets must be increasing row counts, got {buckets}")
        if sizes[0] < 2:
            raise ValueError(f"buckets must hold at least 2 rows, got {buckets}: Dynamo specialises a size of 1, "
                             "so a 1-row bucket would compile graphs of its own (one request pads to 2 rows)")
        device = model.embed.weight.device
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {device.type}. "
                             "Pass cuda_graphs=False (the compiled regions run without graphs)")
        self.model, self.layout, self.buckets = model, layout, sizes
        self.cuda_graphs = cuda_graphs  # may be switched off later: the compiled regions then run as they are
        self.passes = megafuse_passes.registry.resolve(passes)  # names, registry order
        self.blocks = blocks
        kwargs = dict(fullgraph=True, dynamic=None)  # row counts: marked per call
        if blocks:
            names = {id(m): name for name, m in model.named_modules()}
            self.compiler = megafuse_passes.block_compiler(passes, names=names, mark_dynamic=_mark_layer_rows_dynamic,
                                                           **kwargs)
            self.encoder = functools.partial(model.encoder_region, run=self.compiler)
            self.decoder = functools.partial(model.decoder_region, run=self.compiler)
        else:
            self.encoder = megafuse_passes.compile(EncoderRegion(model), passes=passes, **kwargs)
            self.decoder = megafuse_passes.compile(DecoderRegion(model), passes=passes, **kwargs)
        self.device = device
        self.cache = KVCache.allocate(model.cfg, layout, device)
        self.stats = GraphStats()
        self.compiled_buckets: set[tuple[int, int]] = set()
        self.setup_s = 0.0
        self._graphs: dict[tuple[int, int], _Pieces] = {}
        self._pool = None

    def report(self) -> CompileReport:
        """The passes' matches and rejections over every graph compiled so far."""
        if self.blocks:
            return self.compiler.report
        return CompileReport.combined(self.encoder.report, self.decoder.report)

    def bucket(self, rows: int, decoder_rows: int) -> tuple[int, int]:
        """The padded (rows, decoder rows) of a step."""
        def pad(n: int) -> int:
            for size in self.buckets:
                if size >= n:
                    return size
            raise ValueError(f"a step of {n} rows exceeds the largest bucket ({self.buckets[-1]}); "
                             f"the buckets must reach the engine's token budget")
        return pad(rows), pad(decoder_rows)  # no decoder rows pads to the smallest bucket too: one graph

    def run(self, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        """The compiled regions on `batch` and any cache, without CUDA graphs or bucket bookkeeping
        (a batch of 2 rows or more: buckets hold at least 2)."""
        _mark_rows_dynamic(batch)
        # fail loudly rather than fall back to eager if the graphs ever exceed Dynamo's limit
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return self.model.step(batch, cache, self.encoder, self.decoder)

    def __call__(self, batch: StepBatch, cache: KVCache) -> torch.Tensor:
        if cache is not self.cache:
            raise ValueError("a CompiledStep runs on its own cache (step.cache): its CUDA graphs hold those addresses")
        key = (len(batch.rows), len(batch.decoder))
        self.setup_s = 0.0  # compile and capture time inside this call (benchmarks take it off)
        if not self.cuda_graphs:
            if key not in self.compiled_buckets:  # compiled on this batch: its first run is setup
                return self._compile(key, batch)
            return self.run(batch, cache)
        if key not in self._graphs:
            self.prepare([key])
        return self._graphs[key].replay(batch)

    def prepare(self, keys: list[tuple[int, int]]) -> None:
        """Compile (where new) and capture the (rows, decoder rows) buckets `keys` before a step needs
        them, largest first; the pool's first graph is the largest bucket's (module docstring)."""
        if not self.cuda_graphs:
            raise ValueError("prepare() captures CUDA graphs; this step runs without them (cuda_graphs=False)")
        largest = (self.buckets[-1], self.buckets[-1])
        for key in sorted(set(keys) | ({largest} if self._pool is None else set()), reverse=True):
            if key not in self._graphs:
                if key not in self.compiled_buckets:
                    self._compile(key)
                self._graphs[key] = self._capture(key)

    def _padding(self, key: tuple[int, int]) -> StepBatch:
        """A batch of padding rows only: it writes the scratch slot and page and nothing else."""
        table = torch.full((self.layout.slots + 1, self.layout.max_pages), self.layout.scratch_page, dtype=torch.int64)
        return build_step(self.model.cfg, self.layout, [], table, *key, self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _compile(self, key: tuple[int, int], batch: StepBatch | None = None) -> torch.Tensor:
        """Compile the bucket `key` by running it once: on `batch`, or on padding rows before a
        capture. One run, not two: on an expert-parallel model every run is a collective that all
        ranks must enter the same number of times."""
        self._sync()
        start = time.perf_counter()
        logits = self.run(self._padding(key) if batch is None else batch, self.cache)
        self._sync()
        seconds = time.perf_counter() - start
        self.compiled_buckets.add(key)
        self.stats.buckets += 1
        self.stats.first_run_s += seconds
        report = self.report()
        self.stats.graphs, self.stats.graphs_from_cache = len(report.graphs), sum(g.cached for g in report.graphs)
        self.stats.compile_s = self.compiler.compile_s if self.blocks else self.stats.first_run_s
        self.setup_s += seconds
        return logits

    def _capture(self, key: tuple[int, int]) -> _Pieces:
        cache, static = self.cache, self._padding(key)
        _mark_rows_dynamic(static)  # the same guards as the compiled graph's calls: no recompile in a capture
        self._sync()
        # torch.cuda.graph empties the allocator's cache as it starts: empty it first, so the
        # growth of reserved memory is what the graphs' pool took
        torch.cuda.empty_cache()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        encoder_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(encoder_graph, pool=self._pool):
            encoded = self.encoder(static, cache)
        self._pool = encoder_graph.pool()
        decoder_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(decoder_graph, pool=self._pool):
            logits = self.decoder(*encoded, static, cache)
        self._sync()
        seconds = time.perf_counter() - start
        self.stats.captures += 1
        self.stats.capture_s += seconds
        self.setup_s += seconds
        self.stats.graph_bytes += torch.cuda.memory_reserved() - reserved
        return _Pieces(static, encoder_graph, decoder_graph, logits)
