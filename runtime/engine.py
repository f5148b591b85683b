"""The engine: continuous batching of requests over the model's batched step and byte cache.

    engine = Engine(model)                                                 # the cache sized from free memory
    engine = Engine(model, layout=CacheLayout(...))                        # or a layout of your own
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)    # greedy by default
    for token in engine.stream([1, 2, 3], max_new_tokens=16): ...         # one request's tokens as they come

Each `step()`:

1. decodes first: every running request whose prefill is done gets one row (its newest token);
2. then prefill chunks, FCFS, under `token_budget` rows: a request is admitted when a slot is free;
   with the prefix cache its longest cached run of full pages is reused and it replays from
   `replay_start = H - min(W, H)` (bounded) or `H - min(L x W, H)` (exact: swa_bounded_replay=False),
   docs/model.md section 8;
3. pages for the new positions come from the free list, then from evicting cached pages no request
   holds (LRU); when none are left the newest running request admitted after the one in need is
   preempted: its pages and slot are released and it goes back to the front of the queue to be
   recomputed (its output so far is kept). A newly admitted request that finds no pages waits;
4. the model runs the step: with `passes` (default "all"; "none" is plain `torch.compile`) the
   regions compiled per padded bucket and, on a GPU, replayed as CUDA graphs (runtime/graphs.py);
   with passes=None the eager `model.step` on unpadded rows. Each request whose final prefill
   chunk or decode ran samples its next token from its last decoder row;
5. full pages a request wrote are published to the prefix cache; finished requests release theirs.

With an expert-parallel model (model/expert_parallel.py) every MoE layer is a collective, so each
rank must run every layer at every step: the engine then runs the model at every `step()`, a
padding row when it has no work of its own, and keeps at least one decoder row (a padding row
where no chunk ends), so the decoder region runs too. runtime/distributed.py steps the ranks together.
Its compiled step runs without CUDA graphs: the all-to-all waits on the host for its counts.

A request that can never fit (prompt + max_new_tokens beyond one request's page table or the whole
pool) is rejected at `add_request` with the reason; bad input raises `RequestError` naming it.

Without a `layout` the engine sizes its own (`default_layout`), as vLLM sizes its KV cache from
gpu_memory_utilization, and logs it once (logger megafuse.runtime); `engine.layout` holds it:

    budget     cache_bytes when given; else memory_fraction (default 0.9) x the device's free memory:
               on CUDA what `torch.cuda.mem_get_info` reports free plus what PyTorch's allocator holds
               unused, measured when the engine is built (after the weights); elsewhere (CPU) a fixed
               CPU_CACHE_BYTES = 1 GiB: host memory is shared with everything else and the CPU runs
               small models (tests, the Triton interpreter), so a share of it would size nothing useful
    slots      token_budget: a step decodes at most token_budget requests, so more slots would only
               hold requests waiting for rows
    page_size  DEFAULT_PAGE_SIZE (64 positions)
    pages      CacheLayout.for_budget: what the budget holds after the slots' SWA rings
               (model/cache.py states the arithmetic)
    max_pages  max_tokens (default DEFAULT_MAX_TOKENS = 4096) / page_size, or the whole pool if less.
               Not the model's longest position: the indexer scores every page of a request's
               page-table row at every step, so the table's width is a cost paid by every step

The (1 - memory_fraction) left over is for activations, compiled graphs and CUDA-graph pools: lower
it (or give cache_bytes) if a step runs out of memory.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from megafuse.model import CacheLayout, KVCache, Sequence, build_step, page_table
from megafuse.model.cache import DEFAULT_PAGE_SIZE
from megafuse.model.expert_parallel import is_expert_parallel

from .graphs import CompiledStep, default_buckets
from .kv_cache import PagePool, PrefixCache


log = logging.getLogger("megafuse.runtime")

DEFAULT_MEMORY_FRACTION = 0.9  # of the device's free memory, for the default layout's pages
CPU_CACHE_BYTES = 1 << 30  # the free memory a CPU device is taken to have (module docstring)
DEFAULT_MAX_TOKENS = 4096  # positions one request can hold under the default layout


class RequestError(ValueError):
    """A request the engine cannot take; the message names the problem and the valid range."""


def device_free_bytes(device: torch.device) -> int:
    """The memory a cache may take a share of: on CUDA the device's free memory plus what PyTorch's
    caching allocator holds unused (it hands that out again); elsewhere CPU_CACHE_BYTES."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return CPU_CACHE_BYTES


def default_layout(model, *, slots: int, memory_fraction: float | None = None, cache_bytes: int | None = None,
                   max_tokens: int | None = None, page_size: int = DEFAULT_PAGE_SIZE) -> CacheLayout:
    """The layout an engine builds without one (module docstring): `slots` requests, pages from
    `cache_bytes`, or from `memory_fraction` (default 0.9) of the model's device's free memory."""
    if cache_bytes is not None and memory_fraction is not None:
        raise ValueError("give cache_bytes (the budget itself) or memory_fraction (a share of the free memory), not both")
    if memory_fraction is not None and not (isinstance(memory_fraction, (int, float))
                                            and not isinstance(memory_fraction, bool) and 0 < memory_fraction <= 1):
        raise ValueError(f"memory_fraction must lie in (0, 1] (the share of the device's free memory the cache "
                         f"takes), got {memory_fraction!r}")
    if cache_bytes is not None and (not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 1):
        raise ValueError(f"cache_bytes must be a positive int (bytes), got {cache_bytes!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int (positions one request can hold), got {max_tokens!r}")
    device = model.embed.weight.device
    if cache_bytes is None:
        fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        free = device_free_bytes(device)
        budget, source = math.floor(fraction * free), f"{fraction:g} x {free / 2**30:.2f} GiB free on {device}"
    else:
        budget, source = cache_bytes, "cache_bytes"
    layout = CacheLayout.for_budget(model.cfg, budget, slots=slots, page_size=page_size,
                                    max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    log.info("cache layout: %d slots, %d pages of %d tokens (up to %d tokens a request), %.3f GiB of a %.3f GiB "
             "budget (%s)", layout.slots, layout.pages, layout.page_size, layout.max_tokens,
             layout.nbytes(model.cfg) / 2**30, budget / 2**30, source)
    return layout


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when temperature == 0; else softmax(logits / temperature) cut to the top_p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}")


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    output: list[int] = field(default_factory=list)
    sequence: Sequence | None = None  # while it holds a slot
    generator: torch.Generator | None = None
    logits: list[torch.Tensor] = field(default_factory=list)  # per output token, with keep_logits

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


@dataclass
class EngineStats:
    steps: int = 0
    prefix_hits: int = 0  # admissions that reused cached pages (counted when their first chunk runs)
    hit_tokens: int = 0  # positions whose global KV came from the prefix cache
    replayed_tokens: int = 0  # of those, recomputed for their SWA rows
    trimmed_tokens: int = 0  # prefill rows that skipped the decoder layers
    preemptions: int = 0
    evictions: int = 0


class Engine:
    def __init__(self, model, *, layout: CacheLayout | None = None, memory_fraction: float | None = None,
                 cache_bytes: int | None = None, max_tokens: int | None = None, prefix_cache: bool = True,
                 swa_bounded_replay: bool = True, trim_decoder: bool = True, token_budget: int = 256, passes="all",
                 cuda_graphs: bool | None = None, buckets: tuple[int, ...] | None = None,
                 compiled: CompiledStep | None = None, keep_logits: bool = False):
        """layout: the cache's; None sizes one (`default_layout`, module docstring) from cache_bytes,
        or memory_fraction (default 0.9, in (0, 1]) of the device's free memory, with max_tokens
        (default 4096) positions a request; with a layout (or a compiled step's) those are errors.
        passes: "all", "none", a list of pass names (the compiled step), or None (eager step).
        cuda_graphs: capture the compiled regions per bucket (None: where the model is on CUDA and its
        experts are not sharded).
        buckets: the padded row counts of the compiled step (default: powers of two from 2 up to the
        token budget, then the budget); the largest must reach the token budget.
        compiled: a CompiledStep of this model and layout to run instead (engines that share one
        share its compiled graphs and CUDA graphs: bench-serve's configurations)."""
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        sizing = {k: v for k, v in (("memory_fraction", memory_fraction), ("cache_bytes", cache_bytes),
                                    ("max_tokens", max_tokens)) if v is not None}
        if layout is None and compiled is not None:
            layout = compiled.layout
        elif layout is None:
            layout = default_layout(model, slots=token_budget, **sizing)
        elif sizing:
            raise ValueError(f"{', '.join(sizing)} size the default layout; with a layout given they would do nothing")
        if sizing and compiled is not None:
            raise ValueError(f"{', '.join(sizing)} size the default layout; a compiled step brings its own")
        self.model, self.cfg, self.layout = model, model.cfg, layout
        self.device = model.embed.weight.device
        self.pages = PrefixCache(PagePool(layout.pages), layout.page_size)
        self.prefix_cache, self.trim, self.token_budget = prefix_cache, trim_decoder, token_budget
        self.replay = self.cfg.window if swa_bounded_replay else self.cfg.n_layers * self.cfg.window
        # every MoE layer of an expert-parallel model is a collective: run it at every step (module doc)
        self.lockstep = is_expert_parallel(model)
        if self.lockstep and (cuda_graphs or (compiled is not None and compiled.cuda_graphs)):
            raise ValueError("an expert-parallel model's step cannot be captured as CUDA graphs: its all-to-all "
                             "waits on the host for the routing's counts; pass cuda_graphs=False")
        self.step_runner = compiled or self._compiled_step(passes, cuda_graphs, buckets)
        if compiled is not None and (compiled.model is not model or compiled.layout != layout):
            raise ValueError("the compiled step was built for another model or cache layout")
        if self.step_runner is not None and self.step_runner.buckets[-1] < token_budget:
            raise ValueError(f"the largest bucket ({self.step_runner.buckets[-1]}) is below token_budget={token_budget}: "
                             "a full step would have no graph")
        if self.step_runner is None:
            self.cache = KVCache.allocate(self.cfg, layout, self.device)
        else:  # the compiled step's cache: its graphs hold those addresses
            self.cache = self.step_runner.cache
            self.cache.clear()
        self.keep_logits = keep_logits  # each request keeps the fp32 logits of its tokens (on the CPU)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(layout.slots - 1, -1, -1))
        self.requests: dict[int, Request] = {}
        self.stats = EngineStats()

    def _compiled_step(self, passes, cuda_graphs, buckets) -> CompiledStep | None:
        if passes is None:
            if cuda_graphs:
                raise ValueError("cuda_graphs=True captures the compiled regions; pass passes='all' or 'none'")
            return None
        graphs = self.device.type == "cuda" and not self.lockstep if cuda_graphs is None else cuda_graphs
        buckets = default_buckets(self.token_budget) if buckets is None else tuple(buckets)
        return CompiledStep(self.model, layout=self.layout, buckets=buckets, passes=passes, cuda_graphs=graphs)

    @property
    def setup_s(self) -> float:
        """Compile and capture time inside the last step() (0 on the eager step): serving clocks
        take it off."""
        return self.step_runner.setup_s if self.step_runner is not None else 0.0

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None) -> int:
        sampling = sampling or SamplingParams()
        sampling.check()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise RequestError("the prompt is empty; a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} lie outside 0..{self.cfg.vocab_size - 1}")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        # the last generated token is never fed back, so a request holds at most this many positions
        need = len(prompt) + max_new_tokens - 1
        limit = min(self.layout.max_tokens, self.layout.pages * self.layout.page_size)
        if need > limit:
            raise RequestError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) needs {need} positions; "
                               f"the cache holds at most {limit} for one request")
        request = Request(len(self.requests), prompt, max_new_tokens, sampling)
        if sampling.temperature > 0:
            request.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 sampling: SamplingParams | None = None) -> list[list[int]]:
        ids = [self.add_request(p, max_new_tokens, sampling) for p in prompts]
        while self.waiting or self.running:
            self.step()
        return [self.requests[i].output for i in ids]

    def stream(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams | None = None) -> Iterator[int]:
        """Add a request (errors at once, as add_request) and yield its tokens as they come: each
        next() runs engine steps, serving every other request too, until this one has a new token."""
        request = self.requests[self.add_request(prompt, max_new_tokens, sampling)]
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[int]:
        sent = 0
        while sent < request.max_new_tokens:
            while len(request.output) == sent:
                if not (self.waiting or self.running):
                    raise RuntimeError(f"request {request.id} stopped at {sent} tokens with nothing left to run")
                self.step()
            yield from request.output[sent:]
            sent = len(request.output)

    # ---- one step ---------------------------------------------------------------------------------

    def _pages_for(self, request: Request, end: int) -> bool:
        """Give the request pages up to position end - 1; False when the pool (after eviction) cannot."""
        seq = request.sequence
        missing = -(-end // self.layout.page_size) - len(seq.pages)
        if missing <= 0:
            return True
        before = self.pages.evicted
        pages = self.pages.allocate(missing)
        self.stats.evictions += self.pages.evicted - before
        if pages is None:
            return False
        seq.pages += pages
        return True

    def _release(self, request: Request) -> None:
        seq = request.sequence
        self.pages.release(seq.pages)
        self.free_slots.append(seq.slot)
        request.sequence = None
        self.running.remove(request)

    def _preempt(self, victim: Request) -> None:
        """Free a running request for recompute: back to the front of the queue, output kept."""
        self._release(victim)
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1

    def _admit(self, request: Request) -> None:
        tokens = request.prompt + request.output  # a preempted request recomputes what it generated
        seq = Sequence(self.free_slots.pop(), tokens, self.cfg.window)
        request.sequence = seq
        self.running.append(request)
        if self.prefix_cache:
            hit_pages = self.pages.lookup(tokens)
            # keep at least one token to run: its logits give the next token
            usable = min(len(hit_pages), (len(tokens) - 1) // self.layout.page_size)
            self.pages.release(hit_pages[usable:])
            seq.pages = hit_pages[:usable]
            hit = usable * self.layout.page_size
            if hit:
                seq.resume_from_cache(hit, self.replay)

    def _schedule(self) -> list[tuple[Request, int, bool]]:
        plan: list[tuple[Request, int, bool]] = []
        planned: set[int] = set()
        budget = self.token_budget

        def room(request: Request, end: int) -> bool:
            """Pages up to `end`, preempting running requests admitted after it (not yet planned),
            newest first: an older request never waits on a newer one."""
            while not self._pages_for(request, end):
                newer = self.running[self.running.index(request) + 1:]
                victims = [r for r in newer if r.id not in planned]
                if not victims:
                    return False
                self._preempt(victims[-1])
            return True

        def take(request: Request, n: int, final: bool) -> None:
            nonlocal budget
            plan.append((request, n, final))
            planned.add(request.id)
            budget -= n

        for request in list(self.running):  # 1. decodes
            seq = request.sequence
            if seq is None or not seq.prefilled:
                continue
            if budget == 0:
                break
            if room(request, seq.done + 1):
                take(request, 1, True)
        queue = [r for r in self.running if not r.sequence.prefilled]
        while budget > 0:  # 2. prefill chunks: running prefills first, then admissions, FCFS
            if not queue:
                if not self.waiting or not self.free_slots:
                    break
                self._admit(self.waiting.popleft())
                queue.append(self.running[-1])
            request = queue.pop(0)
            seq = request.sequence
            if seq is None:  # preempted to make room for an earlier one
                continue
            n = min(budget, len(seq.tokens) - seq.done)
            if not room(request, seq.done + n):
                n = len(seq.pages) * self.layout.page_size - seq.done  # what its pages hold
                if n <= 0:
                    if seq.done == seq.replay_start:  # admitted this step, nothing run: wait in the queue
                        self._release(request)
                        self.waiting.appendleft(request)
                    break
            take(request, n, seq.done + n == len(seq.tokens))
        return plan

    def step(self) -> list[tuple[int, int]]:
        """Run one step; returns the (request id, token) pairs it produced."""
        plan = self._schedule()
        if not plan and not self.lockstep:
            return []
        chunks = [r.sequence.chunk(n, final, self.trim) for r, n, final in plan]
        sequences = [r.sequence for r in self.running]
        n_rows, n_decoder = sum(len(c.ids) for c in chunks), sum(len(c.decoder_positions(self.cfg.window)) for c in chunks)
        rows = decoder_rows = None
        if self.step_runner is not None:
            rows, decoder_rows = self.step_runner.bucket(n_rows, n_decoder)
        elif self.lockstep:  # padding rows, so that every MoE layer of both regions runs (module doc)
            rows, decoder_rows = max(n_rows, 1), max(n_decoder, 1)
        batch = build_step(self.cfg, self.layout, chunks, page_table(self.layout, sequences), rows, decoder_rows,
                           self.device)
        with torch.no_grad():
            logits = (self.step_runner or self.model.step)(batch, self.cache)
        self.stats.steps += 1
        produced, row = [], 0
        for (request, n, final), chunk in zip(plan, chunks):
            if chunk.cached and chunk.start == chunk.replay_start:  # the first chunk after a prefix hit
                self.stats.prefix_hits += 1
                self.stats.hit_tokens += chunk.cached
                self.stats.replayed_tokens += chunk.cached - chunk.replay_start
            decoder_rows = len(chunk.decoder_positions(self.cfg.window))
            row += decoder_rows
            self.stats.trimmed_tokens += n - decoder_rows
            seq = request.sequence
            if self.prefix_cache:
                self.pages.publish(seq.tokens, seq.pages, seq.done)
            if not final:
                continue
            token = self._sample(logits[row - 1], request)
            request.output.append(token)
            if self.keep_logits:
                request.logits.append(logits[row - 1].float().cpu())
            produced.append((request.id, token))
            if request.finished:
                self._release(request)
            else:
                seq.tokens.append(token)
        return produced

    def _sample(self, logits: torch.Tensor, request: Request) -> int:
        params = request.sampling
        if params.temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # the smallest set reaching top_p
        sorted_probs = torch.where(keep, sorted_probs, 0.0)
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=request.generator)
        return int(order[choice])
