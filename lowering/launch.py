"""Repeat launches that cost what a launch costs: the decisions of a fused op's first call, kept.

A fused op runs once per layer and step with the same spec and, in decode, the same token count.
Its first call for an input layout validates the inputs, chooses the launch configuration and
plan, asks whether the grid fits the device at once (which may compile a build) and launches
through Triton's JIT, which binds and specialises ~50 arguments. None of that changes until the
layout does, so `PreparedLaunches` keeps, per key, the decisions and the compiled kernel's
launcher; later calls allocate their outputs, fetch the persistent buffers and launch.

The key is the layout Triton specialises on and the launcher validates against: every input's
dtype, shape, strides, device and 16-byte alignment (`layout_key`), with the spec. A call whose
key is new takes the whole path, so nothing a first call would refuse is launched unchecked.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch._C._dynamo.guards import _empty_strided_cuda  # as Inductor's generated wrappers import it


# Compiler options every generated kernel launches with. FP fusion (a*b+c as one FMA) is what Triton
# has always compiled and what the kernels' tolerances were measured with; Triton 3.9 warns that its
# default will flip, so the choice is stated rather than inherited.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def layout_key(*tensors) -> tuple:
    """What Triton's specialisation and the launchers' input checks read of each tensor (None stays None)."""
    return tuple([None if t is None else (t.dtype, t.device, t.shape, t.stride(), t.data_ptr() % 16 == 0)
                  for t in tensors])


def device_key(device: torch.device) -> str:
    """The key of a device's persistent state: "cuda:<index>" (the current device where none is
    given), else the device's name."""
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


def require_one_device(op: str, *tensors: torch.Tensor) -> None:
    """ValueError naming the devices when a launcher's inputs are not all on one."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: inputs on several devices: {sorted(map(str, devices))}")


def empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty(shape) contiguous. On the current CUDA device it goes through the allocator entry
    Inductor's generated wrappers use, which skips torch.empty's argument parsing: a few
    microseconds a tensor, a large part of a small launch's host cost."""
    if device.type == "cuda" and device.index == torch.cuda.current_device():
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= max(size, 1)
        return _empty_strided_cuda(shape, tuple(reversed(strides)), dtype)
    return torch.empty(shape, dtype=dtype, device=device)


class PreparedLaunch:
    """One compiled kernel's launcher for a fixed grid, and the constexpr values that follow the
    runtime arguments in its signature (Triton's launcher takes every parameter, in order)."""

    def __init__(self, compiled, grid: tuple, constexprs: tuple, device: torch.device, **decisions):
        self.runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]  # the launcher reads all three
        self.constexprs = constexprs
        self.device = device
        self.decisions = decisions  # what the first call decided, for the launcher's own use

    def __call__(self, *args) -> None:
        index = self.device.index
        # the build's module is loaded in its device's context; the raw stream handle, as Inductor's
        # wrappers fetch it (torch.cuda.current_stream builds a Stream object: several microseconds)
        on_device = contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)
        with on_device:
            self.runner(*args, *self.constexprs, stream=torch._C._cuda_getCurrentRawStream(index))


class PreparedLaunches:
    """PreparedLaunch by key, per kernel family (thread-safe; entries are never evicted: a
    serving process sees a bounded set of token counts per spec)."""

    def __init__(self):
        self._by_key: dict = {}
        self._lock = threading.Lock()

    def get(self, key) -> PreparedLaunch | None:
        return self._by_key.get(key)

    def keep(self, key, compiled, grid: tuple, kernel, options: dict, device: torch.device, **decisions) -> None:
        """Keep the launch `kernel[grid](..., **options)` just made, which returned `compiled`.
        `options` holds the constexprs by name and Triton's launch options (num_warps...), which
        the compiled kernel already carries."""
        params = list(kernel.arg_names)
        named = [name for name in params if name in options]
        if params[len(params) - len(named):] != named:
            raise ValueError(f"{kernel}: the constexprs {named} must be its last parameters, after the "
                             "runtime arguments, for a kept launch to pass them in order")
        constexprs = tuple(options[name] for name in named)
        with self._lock:
            self._by_key[key] = PreparedLaunch(compiled, grid, constexprs, device, **decisions)

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()
