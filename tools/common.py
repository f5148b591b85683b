"""What the compile tools (`run`, `ablate`, `inspect`) share.

    model       a preset, a config JSON or a checkpoint directory            `load_model`
    sizes       every size flag an argparse type that states its valid range     `in_range`
    memory      a request the device cannot hold is refused before anything is built (positions,
                weights, cache, activations: lower bounds), and an allocation that fails anyway
                is a usage error naming the sizes      `RequestSize`, `check_fits`,
                                                       `out_of_memory_is_usage_error`
    target      the whole model, or one block (`--layer N`) fed the inputs the whole model gives
                it, captured with a forward pre-hook               `target`, `prepare_target`
    passes      `--passes all|none|a,b` and one `--no-<pass>` flag per registered pass, generated
                from `passes.available()`: a pass that registers joins every tool unchanged
                                                                             `add_pass_arguments`
    compile     the one place the tools call `passes.compile` (static shapes, fullgraph; on CPU
                Inductor also wraps each generated C++ kernel in a profiler record, so kernels
                can be counted)                                              `compile_model`
    lowering    the kernel module behind a canonical op: `megafuse::<name>` -> `lowering.<name>`,
                with `source_path(spec)`, `load(spec, interpret)`, `KERNEL_NAME`,
                `choose_config(spec, n_tokens, device=)` and the launcher `<name>(...)`, which
                takes the token-major tensor first and accepts `config=`  `lowering_module`
    comparison  max abs error, cosine, top-1 agreement against eager         `compare_logits`
    timing      CUDA events on CUDA; wall clock on CPU, marked indicative    `Stopwatch`
    kernels     what one forward launches, from torch.profiler              `count_kernels`
    progress    a spinner with elapsed time while a step runs, and a line when it ends  `step`
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from torch import nn

from megafuse import passes
from megafuse.model.cache import row_codec
from megafuse.model.checkpoint import load_checkpoint
from megafuse.model.config import DTYPES, PRESETS, QUANT_MODES, ModelConfig, resolve_config
from megafuse.model.transformer import Transformer, build_model

from . import output
from .output import ToolError, console, progress_console  # noqa: F401  (ToolError: the tools raise it from here)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "model"
PAD_ID = 0  # what fills the positions of a static sequence graph that are not yet decoded


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------

def in_range(kind: type = int, *, at_least=None, above=None, at_most=None):
    """An argparse type: a `kind` (int or float) within the bounds given. A value outside them is a
    usage error at parse time that states the valid range (`argument --batch: must be >= 1, got
    -1`), before anything is built: sizes are checked where they are read, never by the tensor
    they would have shaped."""
    rule = " and ".join(r for r, bound in ((f">= {at_least}", at_least), (f"> {above}", above),
                                           (f"<= {at_most}", at_most)) if bound is not None)
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {rule}, got {text!r}") from None
        within = ((at_least is None or value >= at_least) and (above is None or value > above)
                  and (at_most is None or value <= at_most))
        if not within:  # NaN is within no range
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = f"{noun} {rule}"
    return parse


def add_model_arguments(parser: argparse.ArgumentParser, *, prompt_len: int) -> None:
    parser.add_argument("--config", required=True,
                        help=f"a preset ({', '.join(PRESETS)}), a config JSON or a checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", choices=DTYPES, help="override the config's dtype")
    parser.add_argument("--quant", choices=QUANT_MODES, help="override the config's quant mode")
    parser.add_argument("--prompt-len", type=in_range(at_least=1), default=prompt_len, metavar="T",
                        help=f"tokens per request (default {prompt_len})")
    parser.add_argument("--batch", type=in_range(at_least=1), default=1, metavar="B", help="requests (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the random prompt (default 0)")


def _pass_selection(text: str) -> list[str]:
    try:
        return passes.registry.resolve(text)
    except ValueError as e:  # "unknown pass 'x'; valid passes: ..."
        raise argparse.ArgumentTypeError(str(e)) from None


def add_pass_arguments(parser: argparse.ArgumentParser, what: str = "passes to enable") -> None:
    """`--passes` and one `--no-<pass>` per registered pass (both spellings: dashes, underscores)."""
    names = passes.available()
    group = parser.add_argument_group("passes", f"registered, in the order they run: {', '.join(names) or '(none)'}")
    group.add_argument("--passes", type=_pass_selection, default="all", metavar="all|none|a,b",
                       help=f"{what}: all (default), none (plain Inductor) or a comma-separated list")
    for name, description in passes.descriptions().items():
        flags = dict.fromkeys((f"--no-{name.replace('_', '-')}", f"--no-{name}"))
        group.add_argument(*flags, dest=f"no_{name}", action="store_true", help=f"disable {name} ({description})")


def add_engine_step_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine runs its step: compiled with the passes (default) and CUDA graphs on a GPU."""
    add_pass_arguments(parser, "passes the engine's compiled step uses")
    parser.add_argument("--eager", action="store_true",
                        help="run the step uncompiled, without graphs (no compile time: quick CPU runs)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the compiled regions without CUDA graphs")


def engine_step_options(args: argparse.Namespace) -> dict:
    """Engine keywords from add_engine_step_arguments: passes (None = eager) and cuda_graphs."""
    if args.eager:
        return {"passes": None, "cuda_graphs": False}
    return {"passes": selected_passes(args), "cuda_graphs": args.device == "cuda" and not args.no_cuda_graphs}


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers ("1,32")."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def launch_shapes(text: str, fields: int, valid, form: str) -> tuple[tuple[int, ...], ...]:
    """The core of an argparse type for launch sweeps: comma-separated items of `fields` integers
    joined by x ("16x32x4x2"), each accepted by `valid(*values)`; anything else is a usage error
    that names `form`."""
    items = []
    for item in text.split(","):
        try:
            values = tuple(int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            values = ()
        if len(values) != fields or not valid(*values):
            raise argparse.ArgumentTypeError(f"expected {form}; got {item!r} in {text!r}")
        items.append(values)
    return tuple(items)


def selected_passes(args: argparse.Namespace) -> list[str]:
    """`--passes` minus every `--no-<pass>`, in registry order."""
    chosen = args.passes if isinstance(args.passes, list) else passes.registry.resolve(args.passes)
    return [n for n in chosen if not getattr(args, f"no_{n}", False)]


# ------------------------------------------------------------------------------------------------
# model, inputs, compile
# ------------------------------------------------------------------------------------------------

def resolve_model_config(args: argparse.Namespace) -> ModelConfig:
    """The config `--config` names, with --dtype/--quant applied (nothing built)."""
    cfg = resolve_config(args.config)
    overrides = {k: v for k, v in (("dtype", args.dtype), ("quant", args.quant)) if v}
    return cfg.replace(**overrides) if overrides else cfg


def load_model(args: argparse.Namespace, size: RequestSize | None = None) -> tuple[ModelConfig, Transformer]:
    """The model `--config` names (preset, JSON, checkpoint directory), with --dtype/--quant applied,
    built once `check_fits` accepts `size` (default: one forward of --batch x --prompt-len,
    `forward_size`); an allocation that fails while it builds is a usage error too."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ToolError("--device cuda: no CUDA device is available here; use --device cpu")
    cfg = resolve_model_config(args)
    size = size or forward_size(cfg, args)
    check_fits(cfg, args.device, size)
    with out_of_memory_is_usage_error(size, args.device), \
            step(f"building {cfg.name} ({cfg.dtype}, quant={cfg.quant}) on {args.device}", quiet=True):
        if Path(args.config).is_dir():
            model = load_checkpoint(args.config, device=args.device, cfg=cfg)
        else:
            model = build_model(cfg, seed=args.seed, device=args.device)
    return cfg, model


# ------------------------------------------------------------------------------------------------
# memory: refuse a request that cannot fit before building it, and name the sizes when one fails
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RequestSize:
    """What a tool's request holds at once on its device, checked before anything is built. Every
    byte count is a lower bound, so `check_fits` never refuses a request that would fit; one that
    passes and still fails to allocate is caught by `out_of_memory_is_usage_error`."""

    request: str      # the request in the user's terms: "--batch 4 x 24 positions (--prompt-len 16 + --decode 8)"
    positions: int    # its longest sequence, against the model's maximum
    weights: int      # the model's parameters and buffers (`model_bytes`)
    cache: int        # the byte cache's pools (`CacheLayout.nbytes`)
    activations: int  # one forward or step beyond those (`activation_bytes`)
    advice: str       # what to change when it does not fit: "a smaller --batch or --prompt-len"

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.activations

    def __str__(self) -> str:
        return (f"{_size(self.total)} (weights {_size(self.weights)}, cache {_size(self.cache)}, "
                f"activations {_size(self.activations)})")


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:,.1f} MiB"


@functools.lru_cache(maxsize=16)
def model_bytes(cfg: ModelConfig) -> int:
    """Parameters and buffers of cfg's model, counted on its meta build: what building it allocates
    on the device (build_model puts everything there, the Engram tables included)."""
    model = build_model(cfg, device="meta")
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def activation_bytes(cfg: ModelConfig, rows: int, tokens: int, logit_rows: int, step: str | None) -> int:
    """A lower bound on what one forward (`step` None) or batched step ("compiled" or "eager") of
    `rows` rows holds at once beyond weights and cache:

        streams   every row's n residual streams a few times over in fp32: 4 x hc_mult x dim x 4 B
        logits    the fp32 logits of `logit_rows` rows
        indexer   every row scores every entry its request can hold (`tokens` positions / the
                  layer's compress ratio), `indexer_bytes_per_entry` each

    The indexer's term grows with rows x tokens: a long prompt's step is where requests stop fitting.
    """
    streams = rows * 4 * cfg.hc_mult * cfg.dim * 4
    logits = logit_rows * cfg.vocab_size * 4
    ratios = [cfg.compress_ratios[layer] for layer in range(cfg.n_layers) if cfg.role(layer) in ("full", "reindex")]
    entries = tokens // min(ratios) if ratios else 0
    return streams + logits + rows * entries * indexer_bytes_per_entry(cfg, step)


def indexer_bytes_per_entry(cfg: ModelConfig, step: str | None) -> int:
    """Bytes the lightning indexer holds at its peak per (row, entry) it scores, at least:

        forward (None)  the scores einsum's per-head fp32 logits; a sequence's queries share its keys
        "compiled"      each row's decoded keys (index_head_dim in the model dtype), the input of the
                        scores einsum's bmm, and its per-head fp32 output: no pass fuses the indexer
        "eager"         the larger of two moments. Decoding: the key bytes gathered from the cache and
                        the decode's temporaries, under quant="ref" the uint8 codes and five fp32
                        values per element (c, 0.5c, c - 2, 2c, 2c - 8 in quant._e2m1_value's
                        where-chain), under "none" each byte widened twice, cast then shifted
                        (cache._raw_codec). Scoring: the decoded keys and the per-head logits twice
                        (the einsum's output and its relu).

    The eager figures follow those functions' code: measured on tiny (256 rows x 4,032 entries), the
    peak resident memory grows by 813 B per (row, entry) under quant="ref" and 2,200 B under "none",
    against 689 and 2,176 here.
    """
    heads, dim, width = cfg.index_heads, cfg.index_head_dim, getattr(torch, cfg.dtype).itemsize
    if step is None:
        return heads * 4
    if step == "compiled":
        return dim * width + heads * 4
    wide = 4 if width == 2 else 8  # _raw_codec's integer type twice the value's width
    decoding = row_codec(cfg, "index_keys").row_bytes + dim * (1 + 5 * 4 if cfg.quant == "ref" else 2 * wide * width)
    scoring = dim * width + 2 * heads * 4
    return max(decoding, scoring)


def forward_size(cfg: ModelConfig, args: argparse.Namespace) -> RequestSize:
    """One forward of the whole model on --batch x --prompt-len tokens (`ablate`, `inspect`): no
    cache, every position's logits, index keys shared by a sequence's queries."""
    B, T = args.batch, args.prompt_len
    return RequestSize(f"--batch {B} x --prompt-len {T}", T, model_bytes(cfg), 0,
                       activation_bytes(cfg, B * T, T, B * T, step=None),
                       "a smaller --batch or --prompt-len")


CGROUP = Path("/sys/fs/cgroup")


def _cpu_memory() -> dict[str, int]:
    """What bounds this process's allocations on the CPU, in bytes: the kernel's MemAvailable, the
    address-space limit (ulimit -v) less what the process maps, the cgroup's limit less its usage."""
    bounds = {"physical memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    with contextlib.suppress(OSError, KeyError, ValueError):
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        bounds = {"MemAvailable": int(meminfo["MemAvailable"].split()[0]) * 1024}
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = 0
        with contextlib.suppress(OSError, KeyError, ValueError):
            status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            mapped = int(status["VmSize"].split()[0]) * 1024
        bounds["the address-space limit (ulimit -v) less what this process maps"] = soft - mapped
    for limit, usage in (("memory.max", "memory.current"),  # cgroup v2, then v1
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        with contextlib.suppress(OSError, ValueError):
            cap = (CGROUP / limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:  # v1 writes "no limit" as ~2^63
                bounds["the cgroup's memory limit less its usage"] = int(cap) - int((CGROUP / usage).read_text())
                break
    return bounds


def free_memory(device: str) -> tuple[int, str]:
    """(bytes this process can still allocate on `device`, what that figure is). CUDA: the driver's
    free memory (torch.cuda.mem_get_info); CPU: the least bound of `_cpu_memory`."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return free, f"free on the GPU (of {_size(total)}, torch.cuda.mem_get_info)"
    where, free = min(_cpu_memory().items(), key=lambda kv: kv[1])
    return max(free, 0), f"available on the CPU ({where})"


def _presets_that_fit(free: int) -> str:
    fitting = [name for name, cfg in PRESETS.items() if model_bytes(cfg) <= free]
    return f"presets that fit: {', '.join(fitting)}" if fitting else "no preset fits"


def check_fits(cfg: ModelConfig, device: str, size: RequestSize) -> None:
    """Refuse, before anything is built, a request the model or the machine cannot hold: more
    positions than the model's maximum (YaRN: yarn_original_max_pos x yarn_factor), a model whose
    weights alone exceed the device's free memory, or weights + cache + activations that do."""
    max_positions = int(cfg.yarn_original_max_pos * cfg.yarn_factor)
    if size.positions > max_positions:
        raise ToolError(f"{size.request}: {size.positions} positions exceed {cfg.name}'s maximum of {max_positions} "
                        f"(yarn_original_max_pos {cfg.yarn_original_max_pos} x yarn_factor {cfg.yarn_factor:g})")
    free, where = free_memory(device)
    if size.weights > free:
        raise ToolError(f"{cfg.name} ({cfg.dtype}) has {_size(size.weights)} of weights, more than the {_size(free)} "
                        f"{where}: use a smaller config ({_presets_that_fit(free)})")
    if size.total > free:
        raise ToolError(f"{size.request} needs at least {size}, more than the {_size(free)} {where}: "
                        f"use {size.advice}")


# How an allocation failure reads: torch.OutOfMemoryError (CUDA), the CPU allocator's RuntimeError
# (under ulimit -v or a cgroup limit), and either wrapped by Dynamo or Inductor while compiling.
_ALLOCATION_FAILED = ("out of memory", "can't allocate memory")


@contextlib.contextmanager
def out_of_memory_is_usage_error(size: RequestSize, device: str):
    """Run the block; an allocation that fails in it is a ToolError (exit status 2) naming the
    request's size, the memory free when the block began and the allocation that failed: the sizes
    `check_fits` adds are lower bounds, so a request can pass it and still not fit."""
    free, where = free_memory(device)
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
        message = str(e)
        if not isinstance(e, (torch.OutOfMemoryError, MemoryError)) and not any(
                marker in message for marker in _ALLOCATION_FAILED):
            raise
        tried = re.search(r"(?i)tried to allocate ([\d.]+ [KMG]iB|\d+ bytes)", message)
        failed = f"an allocation of {tried.group(1)}" if tried else "an allocation"
        raise ToolError(f"out of memory on {device}: {failed} failed; {size.request} needs at least {size}, and "
                        f"{_size(free)} was {where} when it began: use {size.advice}") from None


def random_ids(cfg: ModelConfig, batch: int, length: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=generator).to(device)


def compile_model(module: torch.nn.Module, names: list[str], device: str, dump_dir=None) -> passes.FusedModule:
    """`passes.compile` as every tool uses it: static shapes, one graph, the given passes.

    On CPU Inductor is asked to wrap each generated C++ kernel in a profiler record
    (`cpp.enable_kernel_profile`), which is how `count_kernels` sees them; on CUDA its Triton
    kernels are device events anyway. Compilation happens at the first call.
    """
    options = {"cpp.enable_kernel_profile": True} if device == "cpu" else {}
    return passes.compile(module, passes=list(names), fullgraph=True, dynamic=False, dump_dir=dump_dir,
                          options=options)


def reset_compiler() -> None:
    """Forget every compiled graph (between ablation configurations, so Dynamo's per-function
    recompile limit never turns a later configuration into silent eager execution)."""
    torch._dynamo.reset()


@contextlib.contextmanager
def step(message: str, quiet: bool = False):
    """Show `message` with a spinner and the elapsed time while the block runs; then print how
    long it took (unless quiet), on stderr. The printed lines are the progress a log keeps."""
    prefix = output.progress_prefix
    if not quiet:
        progress_console.print(f"{prefix}: [bold]{message}[/bold] ...")
    start = time.perf_counter()
    if progress_console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=progress_console, transient=True) as progress:
            progress.add_task(message, total=None)
            yield
    else:  # a log: the lines before and after are the progress
        yield
    if not quiet:
        progress_console.print(f"{prefix}: {message}: done in {time.perf_counter() - start:.1f} s")


# ------------------------------------------------------------------------------------------------
# the target: the whole model, or one block with the inputs the model gives it (--layer N)
# ------------------------------------------------------------------------------------------------

class LayerHarness(nn.Module):
    """One block of the model as a module of its own; `shared` is what earlier layers published."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, streams, pre, ids, positions, shared):
        # two-level copy: the block publishes into `shared` (new entries and new keys of its own)
        shared = {layer: dict(entries) for layer, entries in shared.items()}
        return self.block(streams, pre, ids, positions, shared)


class _Captured(Exception):
    pass


def layer_target(model, ids: torch.Tensor, layer: int) -> tuple[nn.Module, tuple]:
    """(harness around model.layers[layer], its inputs on `ids`), captured by running the eager
    model up to that block."""
    n_layers = len(model.layers)
    if not 0 <= layer < n_layers:
        raise ToolError(f"--layer {layer}: the model has layers 0..{n_layers - 1}")
    captured = {}

    def hook(module, args):
        streams, pre, ids_, positions, shared = args[:5]
        captured["inputs"] = (streams.clone(), pre.clone(), ids_, positions,
                              {k: dict(v) for k, v in shared.items()})
        raise _Captured

    handle = model.layers[layer].register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            model(ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    return LayerHarness(model.layers[layer]), captured["inputs"]


def add_layer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layer", type=in_range(at_least=0), metavar="N",
                        help="compile only model.layers[N], fed the inputs the whole model gives it on the prompt")


def target(model, ids: torch.Tensor, layer: int | None) -> tuple[nn.Module, tuple, str]:
    """(module to compile, its inputs, "model" | "layer N")."""
    if layer is None:
        return model, (ids,), "model"
    harness, inputs = layer_target(model, ids, layer)
    return harness, inputs, f"layer {layer}"


def prepare_target(args: argparse.Namespace, cuda_repeat: int, cpu_repeat: int):
    """What `ablate` and `inspect` start from: `--repeat` (default `cuda_repeat` / `cpu_repeat` per
    device), the model and a random prompt, and the target. Returns (enabled passes, config, target
    module, its inputs, "model" | "layer N")."""
    names = selected_passes(args)
    if args.repeat is None:
        args.repeat = cuda_repeat if args.device == "cuda" else cpu_repeat
    cfg, model = load_model(args)
    ids = random_ids(cfg, args.batch, args.prompt_len, args.seed, args.device)
    return (names, cfg, *target(model, ids, args.layer))


# ------------------------------------------------------------------------------------------------
# lowering modules: from a canonical op to its generated kernel
# ------------------------------------------------------------------------------------------------

def lowering_module(op: str):
    """`megafuse::<name>` -> the module `lowering.<name>` (None when there is none)."""
    name = op.split("::", 1)[-1]
    try:
        return importlib.import_module(f"megafuse.lowering.{name}")
    except ModuleNotFoundError:
        return None


def spec_object(module, spec: dict):
    """The FusionSpec dataclass of `module` (the type of `source_path`'s argument) built from a
    match's spec dict; keys that are not fields (notes such as `left_unfused`) are dropped."""
    hints = typing.get_type_hints(module.source_path)
    cls = next(iter(v for k, v in hints.items() if k != "return"))
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in spec.items() if k in fields})


def megafuse_kernel_names() -> dict[str, str]:
    """Triton function name of every registered pass's kernel -> the pass (profiler matching). A
    kernel module's other launches (a split launch's combine, `<KERNEL_NAME>_combine`) carry its
    name as their prefix: `kernel_owner` matches on it."""
    names = {}
    for name in passes.available():
        module = lowering_module(passes.registry.get(name).op)
        if module is not None and hasattr(module, "KERNEL_NAME"):
            names[module.KERNEL_NAME] = name
    return names


def kernel_owner(name: str, fused_names: dict[str, str], device: str) -> str:
    """Who launched a profiled kernel: the pass whose generated kernel it is (on CPU, where the
    kernel's launch is the op `megafuse::<kernel name>`), "inductor" for Inductor's own kernels,
    "other" for the rest (KERNEL_COUNT_METHOD)."""
    kernel = name.removeprefix("megafuse::") if device == "cpu" else name
    fused = next((p for k, p in fused_names.items() if kernel == k or kernel.startswith(k + "_")), None)
    if fused or (device == "cpu" and name.startswith("megafuse::")):
        return fused or name
    inductor = name.startswith("triton_") if device == "cuda" else "cpp_fused" in name  # CPU: graph_<i>_cpp_fused_*
    return "inductor" if inductor else "other"


# ------------------------------------------------------------------------------------------------
# comparison and timing
# ------------------------------------------------------------------------------------------------

def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Max abs error, cosine per position (min, mean) and top-1 agreement of `got` against `ref`
    (both [..., vocab]); statistics in float64."""
    ref = ref.detach().reshape(-1, ref.shape[-1]).double().cpu()
    got = got.detach().reshape(-1, got.shape[-1]).double().cpu()
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1, eps=1e-30)
    return {
        "positions": ref.shape[0],
        "max_abs": (got - ref).abs().max().item(),
        "cosine_min": cosine.min().item(),
        "cosine_mean": cosine.mean().item(),
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).double().mean().item(),
        "finite": bool(torch.isfinite(got).all()),
    }


def merge_metrics(parts: list[dict]) -> dict:
    """One metrics dict over several (weighted by positions)."""
    positions = sum(p["positions"] for p in parts)
    return {
        "positions": positions,
        "max_abs": max(p["max_abs"] for p in parts),
        "cosine_min": min(p["cosine_min"] for p in parts),
        "cosine_mean": sum(p["cosine_mean"] * p["positions"] for p in parts) / positions,
        "top1_agreement": sum(p["top1_agreement"] * p["positions"] for p in parts) / positions,
        "finite": all(p["finite"] for p in parts),
    }


def timing_method(device: str) -> str:
    if device == "cuda":
        return "CUDA events (torch.cuda.Event) around each call: GPU time"
    return "wall clock (time.perf_counter); indicative only on CPU, where Triton kernels run in the interpreter"


class Stopwatch:
    """Times one call: CUDA events on CUDA (the GPU's time from before the first launch to after
    the last), `time.perf_counter` on CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self, fn, *args, **kwargs):
        """(fn(*args, **kwargs), seconds)."""
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end) / 1e3
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        return out, time.perf_counter() - start


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------------
# kernels per forward
# ------------------------------------------------------------------------------------------------

KERNEL_COUNT_METHOD = {
    "cuda": "torch.profiler CUDA activity: device kernel events during the profiled forwards (memcpy and "
            "memset excluded), divided by the number of forwards; 'megafuse' = the generated fused "
            "kernels, 'inductor' = Inductor's triton_* kernels, 'other' = cuBLAS, ATen and the rest; "
            "time_us: each event's device duration summed per launcher (a pass's name for its fused "
            "kernels, a split launch's combine included) per forward",
    "cpu": "torch.profiler CPU activity: the calls Inductor's compiled graph makes, i.e. the direct children "
           "of its '## Call CompiledFxGraph' events: 'inductor' = generated C++ kernels (cpp_fused_*, "
           "recorded through cpp.enable_kernel_profile), 'megafuse' = fused-op launches (megafuse::*_kernel, "
           "one Triton kernel each, interpreted on CPU), 'other' = ATen extern calls (mm, bmm, sort, ...); "
           "divided by the number of forwards; time_us: each call's CPU duration summed per launcher (a "
           "pass's name for its fused op) per forward",
}


# `count_kernels` lists this many kernel names, the longest-running per forward first: enough to
# see what "inductor" and "other" are made of (a decode step has ~2,500 launches of ~100 names).
HEAVIEST_KERNELS = 30

# What libkineto writes to file descriptor 2 when a profile starts and stops ("USDT: ...
# profiler_start", "STAGE: ... Completed Stage: Warm Up"), with no switch to turn it off.
_PROFILER_CHATTER = ("USDT:", "STAGE:")


@contextlib.contextmanager
def profiling(activities: list):
    """torch.profiler.profile(activities) with libkineto's start/stop lines kept off stderr: fd 2
    is captured for the block and every other line written back to sys.stderr afterwards."""
    from torch.profiler import profile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with profile(activities=activities) as prof:
                yield prof
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(_PROFILER_CHATTER):
                    sys.stderr.write(line)


def count_kernels(fn, inputs: tuple, device: str, forwards: int = 1) -> dict:
    """What `forwards` calls of `fn(*inputs)` launch, per forward, by category, and the time each
    launcher's kernels take per forward (see KERNEL_COUNT_METHOD for exactly what is counted and
    timed on each device); `heaviest`: the HEAVIEST_KERNELS kernel names that take the most time,
    each with its launcher, launches and time per forward."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profiling(activities) as prof:
        for _ in range(forwards):
            fn(*inputs)
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        kernels = [e for e in prof.events()
                   if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    else:
        kernels = [c for e in prof.events() if e.name.startswith("## Call CompiledFxGraph") for c in e.cpu_children]
    fused_names = megafuse_kernel_names()
    counts = {"inductor": 0, "megafuse": 0, "other": 0}
    time_us: dict[str, float] = {}
    by_name: dict[str, dict] = {}
    for e in kernels:
        owner = kernel_owner(e.name, fused_names, device)
        counts[owner if owner in counts else "megafuse"] += 1
        us = e.time_range.elapsed_us() / forwards
        time_us[owner] = time_us.get(owner, 0.0) + us
        kernel = by_name.setdefault(e.name, {"name": e.name, "owner": owner, "launches": 0.0, "time_us": 0.0})
        kernel["launches"] += 1 / forwards
        kernel["time_us"] += us
    per_forward = {k: v / forwards for k, v in counts.items()}
    heaviest = sorted(by_name.values(), key=lambda k: -k["time_us"])[:HEAVIEST_KERNELS]
    return {"total": sum(per_forward.values()), "by_kind": per_forward, "forwards": forwards,
            "time_us": dict(sorted(time_us.items())), "heaviest": heaviest, "method": KERNEL_COUNT_METHOD[device]}


def display_path(path: str | Path, root: Path | None = None) -> str:
    """A path relative to `root` (default: the working directory) when it lies under it."""
    try:
        return str(Path(path).resolve().relative_to((root or Path.cwd()).resolve()))
    except ValueError:
        return str(path)
