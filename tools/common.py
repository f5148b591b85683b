"""What the compile tools (`run`, `ablate`, `inspect`) share.

    model       a preset, a config JSON or a checkpoint directory            `load_model`
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
import importlib
import os
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
from megafuse.model.checkpoint import load_checkpoint
from megafuse.model.config import DTYPES, PRESETS, QUANT_MODES, ModelConfig, resolve_config
from megafuse.model.transformer import Transformer, build_model

from .output import ToolError, console, progress_console  # noqa: F401  (ToolError: the tools raise it from here)

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "model"
PAD_ID = 0  # what fills the positions of a static sequence graph that are not yet decoded


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------

def add_model_arguments(parser: argparse.ArgumentParser, *, prompt_len: int) -> None:
    parser.add_argument("--config", required=True,
                        help=f"a preset ({', '.join(PRESETS)}), a config JSON or a checkpoint directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", choices=DTYPES, help="override the config's dtype")
    parser.add_argument("--quant", choices=QUANT_MODES, help="override the config's quant mode")
    parser.add_argument("--prompt-len", type=int, default=prompt_len, metavar="T", help=f"tokens per request (default {prompt_len})")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="requests (default 1)")
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


def selected_passes(args: argparse.Namespace) -> list[str]:
    """`--passes` minus every `--no-<pass>`, in registry order."""
    chosen = args.passes if isinstance(args.passes, list) else passes.registry.resolve(args.passes)
    return [n for n in chosen if not getattr(args, f"no_{n}", False)]


def check_sizes(args: argparse.Namespace, **minimums: int) -> None:
    """`check_sizes(args, batch=1)`: --batch must be >= 1, else a usage error."""
    for name, minimum in minimums.items():
        value = getattr(args, name)
        if value < minimum:
            raise ToolError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


# ------------------------------------------------------------------------------------------------
# model, inputs, compile
# ------------------------------------------------------------------------------------------------

def check_fits(cfg: ModelConfig, args: argparse.Namespace) -> None:
    """Refuse, before anything is built, a request the model or the machine cannot hold: more
    positions than the model's maximum (YaRN: yarn_original_max_pos x yarn_factor), or more
    activation memory than the device has, counting only what a forward must hold at once per
    position (the n residual streams a few times over in fp32, and the fp32 logits): a lower bound."""
    positions = args.prompt_len + getattr(args, "decode", 0)
    max_positions = int(cfg.yarn_original_max_pos * cfg.yarn_factor)
    if positions > max_positions:
        raise ToolError(f"--prompt-len + --decode = {positions} positions exceed {cfg.name}'s maximum of "
                        f"{max_positions} (yarn_original_max_pos {cfg.yarn_original_max_pos} x yarn_factor "
                        f"{cfg.yarn_factor:g})")
    per_position = 4 * (4 * cfg.hc_mult * cfg.dim + cfg.vocab_size)
    need = args.batch * positions * per_position
    if args.device == "cuda" and torch.cuda.is_available():
        have = torch.cuda.mem_get_info()[1]
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ToolError(f"--batch {args.batch} x {positions} positions need at least {need / 2**30:,.1f} GiB of "
                        f"activations ({per_position:,} bytes a position), more than the {have / 2**30:,.1f} GiB "
                        f"of this {args.device} device: use a smaller --batch or --prompt-len")


def resolve_model_config(args: argparse.Namespace) -> ModelConfig:
    """The config `--config` names, with --dtype/--quant applied (nothing built)."""
    cfg = resolve_config(args.config)
    overrides = {k: v for k, v in (("dtype", args.dtype), ("quant", args.quant)) if v}
    return cfg.replace(**overrides) if overrides else cfg


def load_model(args: argparse.Namespace) -> tuple[ModelConfig, Transformer]:
    """The model `--config` names (preset, JSON, checkpoint directory), with --dtype/--quant applied."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ToolError("--device cuda: no CUDA device is available here; use --device cpu")
    cfg = resolve_model_config(args)
    check_fits(cfg, args)
    with step(f"building {cfg.name} ({cfg.dtype}, quant={cfg.quant}) on {args.device}", quiet=True):
        if Path(args.config).is_dir():
            model = load_checkpoint(args.config, device=args.device, cfg=cfg)
        else:
            model = build_model(cfg, seed=args.seed, device=args.device)
    return cfg, model


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
    if not quiet:
        progress_console.print(f"[bold]{message}[/bold] ...")
    start = time.perf_counter()
    if progress_console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=progress_console, transient=True) as progress:
            progress.add_task(message, total=None)
            yield
    else:  # a log: the lines before and after are the progress
        yield
    if not quiet:
        progress_console.print(f"  done in {time.perf_counter() - start:.1f} s")


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
    parser.add_argument("--layer", type=int, metavar="N",
                        help="compile only model.layers[N], fed the inputs the whole model gives it on the prompt")


def target(model, ids: torch.Tensor, layer: int | None) -> tuple[nn.Module, tuple, str]:
    """(module to compile, its inputs, "model" | "layer N")."""
    if layer is None:
        return model, (ids,), "model"
    harness, inputs = layer_target(model, ids, layer)
    return harness, inputs, f"layer {layer}"


def prepare_target(args: argparse.Namespace, cuda_repeat: int, cpu_repeat: int):
    """What `ablate` and `inspect` start from: validate the sizes (`--repeat` defaults to
    `cuda_repeat` / `cpu_repeat` per device), build the model and a random prompt, and pick the
    target. Returns (enabled passes, config, target module, its inputs, "model" | "layer N")."""
    names = selected_passes(args)
    if args.repeat is None:
        args.repeat = cuda_repeat if args.device == "cuda" else cpu_repeat
    check_sizes(args, prompt_len=1, batch=1, repeat=1)
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
