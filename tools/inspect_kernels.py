"""`megafuse inspect`: what code actually runs. Compile a model or one layer and list every fused kernel.

The target is the whole model (`--config`) on a random prompt [B, T], or one block
(`--layer N`): `model.layers[N]` compiled alone, fed the inputs the whole eager model gives it on
that prompt (the residual streams, the carried pre, ids, positions and what earlier layers
published: compressed KV, index keys, top-k), captured with a forward pre-hook.

A kernel is one generated source: every match of a pass whose FusionSpec is the same runs the
same kernel (identical layers share it). For each kernel:

    pass, op, spec      the pass that made it and its FusionSpec (the match's spec dict)
    sites               each match: the new FX node, the FX nodes it replaced and their file:line in
                        the model source (from the nodes' stack traces: `Match.sources`)
    source              the generated Triton file: `lowering.<op>.source_path(spec)`, the kernel
                        cache (`MEGAFUSE_KERNEL_CACHE`); `kernel_attr` is the @triton.jit function
    time                CUDA: device time per launch from torch.profiler (launches matched in order
                        to the profiler's kernels of that name), mean over
                        --repeat forwards; CPU: wall time per launch of the Triton interpreter,
                        indicative only
    floor               CUDA: bytes the launch must move (its tensor inputs read once, outputs
                        written once; the extent each view addresses) / HBM bandwidth, and
                        floor / measured time; FLOP floors are not computed (the memory floor is
                        a lower bound); not available for a device without a bandwidth figure
    triton              CUDA: registers, spills, shared memory, warps and stages of each compiled
                        variant, from the CompiledKernel a launch returns
    hopper_build        CPU: the same kernel built ahead of time for sm_90 (`lowering.offline`) with
                        the launch configuration the GPU would choose for this launch's tokens:
                        registers, stack / local bytes (spills), shared memory, warps, stages,
                        programs; a build, not a measurement (this machine's Triton)

How launches are observed: for one forward, each involved lowering module's launcher
(`lowering.<op>.<op>`) and `load(spec, interpret)` are wrapped (and restored after), so every
launch records its spec key, bytes and wall time, and on CUDA the
CompiledKernel Triton returns.

`--show NAME` prints a kernel's source with syntax highlighting (NAME: a kernel name, a site's FX
node, or a unique prefix such as the pass name). `--out DIR` writes DIR/index.json (the JSON
below), DIR/sources/<kernel>.py (copies of the sources) and DIR/graphs/ (each compiled graph
before and after each pass, from passes.compile(dump_dir=...)).

JSON (`--json PATH`, '-' for stdout): schema "megafuse.inspect/1", documented in docs/tools.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.syntax import Syntax
from rich.table import Table

from . import bench_common, common, hopper_builds
from .common import ToolError, display_path, profiling, step
from .output import console, environment, tables_to_stderr, write_json

EXAMPLES = """examples:
  megafuse inspect --config tiny                          # every fused kernel of the whole model
  megafuse inspect --config tiny --layer 2                # one block, with the inputs the model gives it
  megafuse inspect --config tiny --show mega_gate         # print the (one) mega_gate kernel's source
  megafuse inspect --config tiny --out inspect_tiny       # index.json, sources/, graphs/ (before/after each pass)
  megafuse inspect --config proxy --device cuda --json inspect_proxy.json   # + registers, spills, time, floor
"""

# HBM bandwidth used for the memory floor (bytes / bandwidth), by device-name substring. H200: the
# figure the project's benchmarks use (docs/measuring.md, "Method"); other devices: no floor rather than a guess.
HBM_BYTES_PER_S = {"H200": bench_common.HBM_BYTES_PER_S}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_model_arguments(parser, prompt_len=8)
    common.add_layer_argument(parser)
    common.add_pass_arguments(parser)
    parser.add_argument("--show", metavar="NAME", help="print this kernel's source (a kernel name, a site's FX node or a unique prefix)")
    parser.add_argument("--out", metavar="DIR", help="write index.json, sources/ and graphs/ here")
    parser.add_argument("--repeat", type=common.in_range(at_least=1), metavar="N", help="profiled forwards for CUDA timings (default 10; CPU: 1)")
    parser.add_argument("--json", metavar="PATH", help="write the kernel list as JSON ('-' for stdout)")


# ------------------------------------------------------------------------------------------------
# kernels from the pass report
# ------------------------------------------------------------------------------------------------

def kernels_from_report(report) -> list[dict]:
    """One entry per generated source: matches grouped by (op, spec key), in the order passes run."""
    kernels: dict[tuple, dict] = {}
    for pass_name in report.pass_names:
        for match in report.matches(pass_name):
            module = common.lowering_module(match.op)
            op_name = match.op.split("::")[-1]
            if module is not None and hasattr(module, "source_path"):
                spec = common.spec_object(module, match.spec)
                key = (match.op, spec.key())
                if key not in kernels:
                    source = Path(module.source_path(spec))
                    name = module.kernel_name(spec) if hasattr(module, "kernel_name") else source.stem
                    kernels[key] = _entry(name, pass_name, match, spec.key(), str(source),
                                          getattr(module, "KERNEL_NAME", None))
            else:  # a lowering that does not follow the convention: listed, saying what is missing
                key = (match.op, json.dumps(match.spec, sort_keys=True, default=str))
                if key not in kernels:
                    kernels[key] = _entry(f"{op_name}_{len(kernels)}", pass_name, match, None,
                                          f"not available: lowering.{op_name} has no source_path(spec)", None)
            entry = kernels[key]
            entry["sites"].append({"node": match.node, "replaced": match.replaced, "sources": match.sources})
            entry["model_sources"] += [s for s in match.sources if s not in entry["model_sources"]]
    return list(kernels.values())


def _entry(name, pass_name, match, key, source, attr) -> dict:
    return {"name": name, "pass": pass_name, "op": match.op, "spec": match.spec, "spec_key": key,
            "source": source, "kernel_attr": attr, "copied_source": None, "sites": [], "model_sources": [],
            "launches_per_forward": None, "time": {"method": None, "per_launch_s": None},
            "bytes_per_launch": None, "floor_s": None, "floor_fraction": None, "floor_note": "",
            "triton": None, "triton_note": "", "hopper_build": None}


# ------------------------------------------------------------------------------------------------
# observing launches
# ------------------------------------------------------------------------------------------------

def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes a view addresses (broadcast dims count once), not numel * itemsize."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return span * t.element_size()


def _tensor_bytes(values) -> int:
    if isinstance(values, torch.Tensor):
        return _extent_bytes(values)
    if isinstance(values, (list, tuple)):
        return sum(_tensor_bytes(v) for v in values)
    if isinstance(values, dict):
        return sum(_tensor_bytes(v) for v in values.values())
    return 0


class _CapturingKernel:
    """A Triton JIT kernel whose launches keep the CompiledKernel they return."""

    def __init__(self, kernel, key: str, sink: dict):
        self._kernel, self._key, self._sink = kernel, key, sink

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def run(*args, **kwargs):
            compiled = launch(*args, **kwargs)
            if compiled is not None:
                self._sink.setdefault(self._key, {})[id(compiled)] = compiled
            return compiled
        return run

    def __getattr__(self, name):
        return getattr(self._kernel, name)


@contextlib.contextmanager
def observe_launches(ops: list[str]):
    """Wrap the launcher and `load` of each op's lowering module; yields (launches, compiled, first):
    launches = [{op, key, bytes, wall_s}] in launch order, compiled = {spec key: {id: CompiledKernel}}, first = {spec key: (op, launcher, args, kwargs)}
    of the first launch of each spec."""
    launches, compiled, first, restore = [], {}, {}, []
    for op in dict.fromkeys(ops):
        module = common.lowering_module(op)
        name = op.split("::")[-1]
        launcher, load = getattr(module, name, None), getattr(module, "load", None)
        if not callable(launcher) or not callable(load):
            continue

        def wrapped_launcher(*args, _launcher=launcher, _op=op, **kwargs):
            spec = next((a for a in (*args, *kwargs.values()) if dataclasses.is_dataclass(a) and hasattr(a, "key")), None)
            start = time.perf_counter()
            out = _launcher(*args, **kwargs)
            wall = time.perf_counter() - start
            key = spec.key() if spec is not None else None
            launches.append({"op": _op, "key": key,
                             "bytes": _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out), "wall_s": wall})
            first.setdefault(key, (_op, _launcher, args, kwargs))
            return out

        def wrapped_load(spec, *args, _load=load, **kwargs):
            kernel = _load(spec, *args, **kwargs)
            interpret = kwargs.get("interpret", args[0] if args else True)
            return kernel if interpret else _CapturingKernel(kernel, spec.key(), compiled)

        restore += [(module, name, launcher), (module, "load", load)]
        setattr(module, name, wrapped_launcher)
        module.load = wrapped_load
    try:
        yield launches, compiled, first
    finally:
        for module, attr, original in restore:
            setattr(module, attr, original)


# The sizes each op's `choose_config` takes after the spec, from a launch's tensors: the tokens (the
# launchers take the token-major tensor first), and for attention the keys per row too.
_LAUNCH_SIZES = {"megafuse::mega_attention": lambda args: (args[0].shape[0], args[1].shape[1])}


def _hopper_build(op: str, launcher, args: tuple, kwargs: dict) -> dict:
    """The kernel of this launch as an H200 would build it (`lowering.offline`): the GPU's launch
    configuration for the same sizes."""
    module = common.lowering_module(op)
    spec = next(a for a in (*args, *kwargs.values()) if dataclasses.is_dataclass(a) and hasattr(a, "key"))
    sizes = _LAUNCH_SIZES.get(op, lambda args: (args[0].shape[0],))(args)
    config = module.choose_config(spec, *sizes, device="cuda")
    try:
        build = hopper_builds.h200_build(module, launcher, *args, **{**kwargs, "config": config})
    except Exception as e:  # e.g. a Triton without its bundled ptxas: say so; the rest of inspect stands
        return {"note": f"not available: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
    return {"target": build.target, "registers": build.registers, "stack_bytes": build.stack_bytes,
            "shared_bytes": build.shared_bytes, "num_warps": build.num_warps, "num_stages": build.num_stages,
            "programs": build.grid[0], "config": dataclasses.asdict(config)}


def _triton_metadata(kernel) -> dict:
    meta = getattr(kernel, "metadata", None)
    get = (lambda k: getattr(meta, k, None) if not isinstance(meta, dict) else meta.get(k))
    return {"n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None),
            "shared_bytes": get("shared"), "num_warps": get("num_warps"), "num_stages": get("num_stages")}


def measure(fused, inputs: tuple, kernels: list[dict], device: str, repeat: int) -> None:
    """Fill each kernel's launches, time, floor and Triton metadata (see the module docstring)."""
    ops = [k["op"] for k in kernels]
    by_key = {k["spec_key"]: k for k in kernels if k["spec_key"]}
    with torch.no_grad(), observe_launches(ops) as (launches, compiled, first):
        if device == "cuda":
            from torch.autograd import DeviceType
            from torch.profiler import ProfilerActivity

            fused(*inputs)  # warm: every variant compiled before the profiled forwards
            torch.cuda.synchronize()
            launches.clear()
            with profiling([ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(repeat):
                    fused(*inputs)
                torch.cuda.synchronize()
            device_times = defaultdict(list)  # kernel name -> durations (us), in start order
            kernels_run = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                                 key=lambda e: e.time_range.start)
            for e in kernels_run:
                device_times[e.name].append(e.time_range.end - e.time_range.start)
        else:
            repeat = 1
            fused(*inputs)
    forwards = repeat
    bandwidth = next((bw for name, bw in HBM_BYTES_PER_S.items()
                      if device == "cuda" and name in torch.cuda.get_device_name()), None)
    per_key = defaultdict(list)
    if device == "cuda":
        for op in dict.fromkeys(ops):
            pair_device_times([l for l in launches if l["op"] == op], device_times,
                              common.lowering_module(op).KERNEL_NAME)
    for launch in launches:
        per_key[launch["key"]].append(launch)
    for key, entry in by_key.items():
        mine = per_key.get(key, [])
        entry["launches_per_forward"] = len(mine) / forwards
        if not mine:
            entry["time"] = {"method": "no launch observed", "per_launch_s": None}
            continue
        entry["bytes_per_launch"] = int(sum(l["bytes"] for l in mine) / len(mine))
        if device == "cuda":
            timed = [l["device_s"] for l in mine if "device_s" in l]
            entry["time"] = {"method": "torch.profiler device time per launch, mean",
                             "per_launch_s": sum(timed) / len(timed) if timed else None}
            if not timed:
                entry["time"]["method"] = "not available: launches and profiler kernels did not pair up"
            variants = compiled.get(key, {})
            entry["triton"] = [_triton_metadata(k) for k in variants.values()] or None
            entry["triton_note"] = "" if variants else "not available: no CompiledKernel was returned by a launch"
            per_launch = entry["time"]["per_launch_s"]
            if bandwidth and per_launch:
                entry["floor_s"] = entry["bytes_per_launch"] / bandwidth
                entry["floor_fraction"] = entry["floor_s"] / per_launch
                entry["floor_note"] = (f"memory floor: bytes / {bandwidth / 1e12:.1f} TB/s; fraction = floor / measured "
                                       "(1.0 = at the floor); FLOP floor not computed")
            else:
                entry["floor_note"] = (f"not available: no HBM bandwidth figure for {torch.cuda.get_device_name()}"
                                       if not bandwidth else "not available: no measured time")
        else:
            entry["time"] = {"method": "wall time per launch in the Triton interpreter (CPU), indicative only",
                             "per_launch_s": sum(l["wall_s"] for l in mine) / len(mine)}
            entry["triton_note"] = "not available on CPU: the Triton interpreter compiles nothing"
            entry["hopper_build"] = _hopper_build(*first[key])
            entry["floor_note"] = "not available on CPU"


def pair_device_times(launches: list[dict], device_times: dict, kernel_name: str) -> None:
    """Set `device_s` of one op's launches, in launch order, from the profiler's kernel durations
    (us) by name, in start order: the i-th launch is the i-th kernel named `kernel_name`. All or
    nothing: where the counts differ, no launch is paired (the caller then says the times are not
    available) rather than a launch given another's time."""
    times = device_times.get(kernel_name, [])
    if len(times) != len(launches):
        return
    for launch, us in zip(launches, times):
        launch["device_s"] = us / 1e6


# ------------------------------------------------------------------------------------------------
# the tool
# ------------------------------------------------------------------------------------------------

def find_kernel(kernels: list[dict], name: str) -> dict:
    """A kernel by name, by one of its sites' FX node, or by a unique prefix of a kernel name."""
    for k in kernels:
        if k["name"] == name or any(s["node"] == name for s in k["sites"]):
            return k
    prefixed = [k for k in kernels if k["name"].startswith(name)]
    if len(prefixed) == 1:
        return prefixed[0]
    valid = ", ".join(k["name"] for k in kernels) or "(no fused kernels)"
    what = "matches several kernels" if prefixed else "is no kernel or site"
    raise ToolError(f"--show {name!r} {what}; valid kernels: {valid} (or a site's FX node name)")


def main(args: argparse.Namespace) -> int:
    with tables_to_stderr(args.json == "-"):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    names, cfg, target, inputs, what = common.prepare_target(args, cuda_repeat=10, cpu_repeat=1)
    repeat = args.repeat
    out = Path(args.out) if args.out else None
    scratch = None
    if out is not None:
        graphs_dir = out / "graphs"
        shutil.rmtree(graphs_dir, ignore_errors=True)  # only this run's graphs
    else:
        scratch = tempfile.TemporaryDirectory(prefix="megafuse_graphs_")
        graphs_dir = Path(scratch.name)

    fused = common.compile_model(target, names, args.device, dump_dir=graphs_dir)
    with torch.no_grad(), step(f"compiling {cfg.name} {what} on [{args.batch}, {args.prompt_len}] tokens "
                               f"with {', '.join(names) or 'no passes'}"):
        fused(*inputs)
    report = fused.report
    kernels = kernels_from_report(report)
    with step(f"observing the fused kernels' launches ({repeat} forward{'s' if repeat > 1 else ''})", quiet=True):
        measure(fused, inputs, kernels, args.device, repeat)

    result = {
        "schema": "megafuse.inspect/1",
        "config": cfg.name, "dtype": cfg.dtype, "quant": cfg.quant, "device": args.device, "target": what,
        "batch": args.batch, "tokens": args.prompt_len, "seed": args.seed, "passes": names,
        "counts": report.counts(), "report": report.to_dict(), "kernels": kernels, "graphs": [],
        "environment": environment(),
    }
    shown = find_kernel(kernels, args.show) if args.show else None
    console.print(report.table())
    console.print(_table(result))
    console.print(_triton_table(result) if args.device == "cuda" else _hopper_table(result))
    _details(result)
    if out is not None:
        sources = out / "sources"
        shutil.rmtree(sources, ignore_errors=True)  # only this run's kernels
        sources.mkdir(parents=True)
        for k in kernels:
            if Path(k["source"]).is_file():
                copy = sources / Path(k["source"]).name
                shutil.copyfile(k["source"], copy)
                k["copied_source"] = str(copy)
        result["graphs"] = sorted(str(p) for p in graphs_dir.glob("*.txt"))
        write_json(result, str(out / "index.json"))
        console.print(f"wrote {len(kernels)} sources to {sources} and {len(result['graphs'])} graphs to {graphs_dir}")
    if shown is not None:
        if not Path(shown["source"]).is_file():
            raise ToolError(f"--show {args.show}: {shown['source']}")
        console.print(f"[bold]{shown['name']}[/bold]  {display_path(shown['source'])}")
        console.print(Syntax(Path(shown["source"]).read_text(), "python", line_numbers=True, word_wrap=True,
                             theme="ansi_dark"))
    if args.json:
        write_json(result, args.json)
    if scratch is not None:
        scratch.cleanup()
    return 0


def _seconds(s) -> str:
    if s is None:
        return "-"
    if s < 1e-6:  # a tiny model's memory floor is nanoseconds
        return f"{s * 1e9:.1f} ns"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _table(result: dict) -> Table:
    table = Table(title=f"fused kernels: {result['config']} {result['target']} on {result['device']}, "
                        f"{result['batch']} x {result['tokens']} tokens")
    table.add_column("kernel", no_wrap=True)
    table.add_column("pass", no_wrap=True)
    for col in ("sites", "replaced\nFX nodes", "launches\n/forward",
                "time" if result["device"] == "cuda" else "time\n(interp.)"):
        table.add_column(col, justify="right")
    for k in result["kernels"]:
        table.add_row(k["name"], k["pass"], str(len(k["sites"])), str(sum(len(s["replaced"]) for s in k["sites"])),
                      "-" if k["launches_per_forward"] is None else f"{k['launches_per_forward']:g}",
                      _seconds(k["time"]["per_launch_s"]))
    return table


def _triton_table(result: dict) -> Table:
    """CUDA only: each compiled variant's metadata, the measured time and the memory floor."""
    table = Table(title="Triton metadata (CUDA), time per launch, memory floor")
    table.add_column("kernel", no_wrap=True)
    for col in ("regs", "spills", "smem", "warps", "stages", "time", "floor", "floor /\ntime"):
        table.add_column(col, justify="right")
    for k in result["kernels"]:
        for i, v in enumerate(k["triton"] or [{}]):
            cell = lambda f: "-" if v.get(f) is None else str(v[f])
            first = i == 0
            table.add_row(k["name"] if first else "", cell("n_regs"), cell("n_spills"), cell("shared_bytes"),
                          cell("num_warps"), cell("num_stages"), _seconds(k["time"]["per_launch_s"]) if first else "",
                          _seconds(k["floor_s"]) if first else "",
                          ("n/a" if k["floor_fraction"] is None else f"{k['floor_fraction']:.2g}") if first else "")
    return table


def _hopper_table(result: dict) -> Table:
    """CPU only: each kernel built for sm_90 with the GPU's launch configuration (no timings)."""
    table = Table(title="built for sm_90 without a GPU (the GPU's launch configuration)")
    table.add_column("kernel", no_wrap=True)
    for col in ("programs", "regs", "stack/local B", "smem B", "warps", "stages"):
        table.add_column(col, justify="right")
    for k in result["kernels"]:
        build = k["hopper_build"] or {"note": "no launch observed"}
        if "note" in build:
            table.add_row(k["name"], build["note"], "", "", "", "", "")
            continue
        table.add_row(k["name"], *(str(build[f]) for f in ("programs", "registers", "stack_bytes", "shared_bytes",
                                                            "num_warps", "num_stages")))
    return table


def _compact_sources(sources: list[str]) -> str:
    """'model/mhc.py:30,31,42; model/layers.py:10' from ['/repo/model/mhc.py:30', ...] (paths relative
    to the repository when they lie in it)."""
    lines = defaultdict(list)
    for s in sources:
        path, _, line = s.rpartition(":")
        lines[display_path(path, common.REPO_ROOT)].append(int(line) if line.isdigit() else line)
    return "; ".join(f"{path}:{','.join(str(n) for n in sorted(set(ns)))}" for path, ns in lines.items())


def _details(result: dict) -> None:
    for k in result["kernels"]:
        spec = ", ".join(f"{key}={value!r}" for key, value in k["spec"].items())
        sites = [s["node"] for s in k["sites"]]
        console.print(f"[bold]{k['name']}[/bold] ({k['op']}, {len(sites)} site{'s' if len(sites) > 1 else ''}: "
                      f"{', '.join(sites[:4])}{', ...' if len(sites) > 4 else ''})")
        console.print(f"  spec    {spec}", highlight=False)
        console.print(f"  model   {_compact_sources(k['model_sources'])}", highlight=False)
        console.print(f"  source  {display_path(k['source'])}", highlight=False)
        notes = [n for n in (k["triton_note"], k["floor_note"]) if n]
        if result["device"] == "cuda" and notes:
            console.print(f"  notes   {'; '.join(notes)}", highlight=False)
