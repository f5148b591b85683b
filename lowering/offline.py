"""Build a generated kernel for a GPU that is not here (Triton's ahead-of-time compile).

CPU machines, CI among them, run the generated kernels in Triton's interpreter, which never meets
the compiler: a kernel that fails to compile for the GPU, or asks for more shared memory than a
Hopper SM has, would pass every CPU test. `build_launch` closes that gap:

1. it runs a launcher (`mega_mhc.mega_mhc`, `mega_gate.mega_gate`, ...) on CPU tensors with the
   launch configuration it would choose on the GPU, its kernel swapped for a recorder;
2. it turns the recorded call into a Triton signature: a tensor is a pointer to its dtype, an int
   an i32 (i64 past 2^31), a keyword a constexpr, with INTERPRETED forced False so that the
   compiler's branches are the ones built; and it specialises it as Triton's launcher does (an
   int equal to 1 is compiled in, 16-divisible pointers and ints say so), without which the same
   kernel builds with other registers (32 + 3.4 KB of stack instead of 242 for the seam at T=64,
   measured when this was written);
3. it compiles that for `target` (default sm_90, the H200) to PTX and a cubin, with the ptxas in
   Triton's wheel, and reads the cubin's resource usage with its cuobjdump.

What it returns is a build, not a measurement: registers and spills come from this machine's
Triton, which may differ from the GPU's (the H200 runs torch 2.11's Triton 3.6).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

from .occupancy import HOPPER_SM, programs_per_sm

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_SMEM_PER_BLOCK = 227 * 1024  # the opt-in maximum of dynamic shared memory per block on sm_90

_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
                 torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")


@dataclass
class Build:
    """One kernel compiled for a GPU target."""
    name: str
    target: str  # e.g. "cuda sm_90"
    grid: tuple
    constexprs: dict
    num_warps: int
    num_stages: int
    shared_bytes: int  # static + dynamic shared memory Triton asks for at launch
    registers: int | None  # per thread, from the cubin
    stack_bytes: int | None  # per thread, stack + local memory; > 0 means spills (or a non-inlined call)
    ptx: str
    cubin: bytes

    def loops(self) -> list[Loop]:
        """The cubin's loops, largest first (`sass_loops`); empty without cuobjdump."""
        sass = _cuobjdump(self.cubin, "-sass")
        return sass_loops(sass) if sass else []

    def programs_per_sm(self, sm: dict = HOPPER_SM) -> int | None:
        """How many programs of this kernel one SM holds at once: the tightest of its registers,
        shared memory, warps and block limits (None without a register count)."""
        if self.registers is None:
            return None
        return programs_per_sm(self.registers, self.shared_bytes, self.num_warps, sm)


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records and launches nothing."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.calls.append((tuple(grid), args, kwargs))
        return record


@contextmanager
def _recording(module):
    """Swap `module.load(spec, interpret)` (every lowering module loads its kernel through it) for
    a recorder of the compiler-mode kernel (the interpreter's is not a JITFunction)."""
    load, recorders = module.load, []

    def recording_load(spec, _interpret=None, *args, **kwargs):
        recorders.append(_Recorder(load(spec, False, *args, **{k: v for k, v in kwargs.items() if k != "interpret"})))
        return recorders[-1]

    module.load = recording_load
    try:
        yield recorders
    finally:
        module.load = load


def _signature(kernel, args: tuple, kwargs: dict, backend) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, launch options) of a recorded call of `kernel`, specialised
    the way Triton's launcher would specialise it: an int equal to 1 becomes a constexpr, and a
    pointer or int divisible by 16 carries that divisibility (it is what allows 16-byte
    vector accesses), except for the kernel's `do_not_specialize` arguments."""
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
    constexprs = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS}
    if "INTERPRETED" in constexprs:
        constexprs["INTERPRETED"] = False  # build the compiler's branches, not the interpreter's
    frozen = {kernel.arg_names[a] if isinstance(a, int) else a for a in kernel.do_not_specialize}
    signature, attrs = {}, {}
    for index, (name, value) in enumerate(zip(kernel.arg_names, args)):
        divisible = False
        if isinstance(value, torch.Tensor):
            if value.dtype not in _TRITON_TYPES:
                raise TypeError(f"{name}: no Triton pointer type for {value.dtype}")
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and name not in frozen:
                constexprs[name] = 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            divisible = value % 16 == 0 and name not in frozen
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type a {type(value).__name__} argument")
        if divisible:
            attrs[(index,)] = backend.parse_attr("D")
    missing = [n for n in kernel.arg_names if n not in signature and n not in constexprs]
    if missing:
        raise TypeError(f"the recorded call leaves {missing} unset")
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs, attrs, options


def _cuobjdump(cubin: bytes, flag: str) -> str | None:
    """cuobjdump's output for the cubin (None without the tool)."""
    tool = triton.knobs.nvidia.cuobjdump
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([tool.path, flag, str(path)], capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers, stack + local bytes) per thread, from cuobjdump's resource usage of the cubin."""
    text = _cuobjdump(cubin, "--dump-resource-usage")
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text or "")
    return (int(usage.group(1)), int(usage.group(2)) + int(usage.group(3))) if usage else (None, None)


@dataclass
class Loop:
    """One loop of a kernel's SASS: the instructions from a backward branch's target to the branch."""
    start: int  # byte address of the first instruction
    end: int  # byte address of the backward branch
    instructions: int
    opcodes: Counter  # base opcode (HMMA, LDG, FFMA, ...) -> count in the body


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_loops(sass: str) -> list[Loop]:
    """Every loop of a SASS listing (cuobjdump -sass), largest body first. A loop's instructions
    run once per iteration, so their count is the cost of one trip (for Mega-mHC's stage A, one
    chunk), which is what a change to the generated code moves."""
    code = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    index = {addr: i for i, (addr, _) in enumerate(code)}
    loops = []
    for i, (addr, text) in enumerate(code):
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target < addr and target in index:
            body = code[index[target]:i + 1]
            ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
            loops.append(Loop(body[0][0], addr, len(body), ops))
    return sorted(loops, key=lambda loop: -loop.instructions)


def build_launch(module, launch, *args, target: GPUTarget = HOPPER, **kwargs) -> list[Build]:
    """Compile for `target` every kernel `launch(*args, **kwargs)` would launch (see the module
    docstring). `module` is the lowering module whose `load` the launcher calls; pass the launch
    configuration the GPU would use (`config=module.choose_config(spec, T, device="cuda")`): on
    CPU tensors the launcher would otherwise pick the interpreter's."""
    with _recording(module) as recorders:
        launch(*args, **kwargs)
    backend = make_backend(target)
    builds = []
    for recorder in recorders:
        for grid, call_args, call_kwargs in recorder.calls:
            signature, constexprs, attrs, options = _signature(recorder.kernel, call_args, call_kwargs, backend)
            source = triton.compiler.ASTSource(fn=recorder.kernel, signature=signature, constexprs=constexprs,
                                               attrs=attrs)
            compiled = triton.compile(source, target=target, options=options)
            registers, stack = _resources(compiled.asm["cubin"])
            builds.append(Build(
                name=recorder.kernel.__name__, target=f"{target.backend} sm_{target.arch}", grid=grid,
                constexprs=constexprs, num_warps=compiled.metadata.num_warps,
                num_stages=compiled.metadata.num_stages, shared_bytes=compiled.metadata.shared,
                registers=registers, stack_bytes=stack, ptx=compiled.asm["ptx"], cubin=compiled.asm["cubin"]))
    return builds


def build_kernel(module, launch, *args, target: GPUTarget = HOPPER, **kwargs) -> Build:
    """The build of the module's own kernel (`module.KERNEL_NAME`) among those `build_launch`
    compiles."""
    builds = build_launch(module, launch, *args, target=target, **kwargs)
    return next(b for b in builds if b.name == module.KERNEL_NAME)
