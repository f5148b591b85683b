"""A cache of generated kernel sources on disk, and the loader that turns a file into a kernel.

Every generator in `lowering/` writes the Triton source it produced for a spec to one directory,
so a user can read exactly what runs (`megafuse inspect` prints it; docs/compiling.md, "Warm starts") and a later process reuses it.

    directory   set_cache_dir(path)  >  $MEGAFUSE_KERNEL_CACHE  >  ~/.cache/megafuse/kernels
    file        <name>.py, where the caller makes <name> content-addressed (a hash of the spec and
                of the generator's template), so two specs never share a file
    write       atomic: a temporary file in the same directory, then os.replace

Loading has one hazard. Triton decides between the interpreter and the compiler when `@triton.jit`
*decorates* a function, reading TRITON_INTERPRET at that moment. CPU tensors need the interpreter,
CUDA tensors the compiler, and one process may hold both. So `load_kernel` imports the same file
once per mode, under a distinct module name, with TRITON_INTERPRET set (and restored) around the
import, and memoises the result per (path, mode).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path

ENV_VAR = "MEGAFUSE_KERNEL_CACHE"
DEFAULT_DIR = Path("~/.cache/megafuse/kernels")

_override: Path | None = None
_loaded: dict[tuple[str, bool], object] = {}
_generated: dict[tuple[str, bool, str, str], object] = {}
_lock = threading.Lock()


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Use `path` for every later write and listing; `None` goes back to the env var / default."""
    global _override
    _override = None if path is None else Path(path).expanduser()


def cache_dir() -> Path:
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else DEFAULT_DIR.expanduser()


def write_source(name: str, source: str) -> Path:
    """Write `source` to `<cache>/<name>.py` atomically and return the path.

    An existing file with the same content is left untouched (its mtime too), so concurrent
    processes generating the same kernel never race on a half-written file.
    """
    if not name.isidentifier():
        raise ValueError(f"kernel name {name!r} must be a Python identifier (it becomes a module name)")
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    data = source.encode()
    if path.exists() and path.read_bytes() == data:
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_kernel(path: str | os.PathLike, attr: str, interpret: bool):
    """Import the kernel module at `path` in the given mode and return its attribute `attr`.

    `interpret=True` gives Triton interpreter functions (CPU tensors), `False` compiled JIT
    functions (CUDA tensors). Memoised per (resolved path, mode).
    """
    path = Path(path).resolve()
    key = (str(path), interpret)
    with _lock:
        module = _loaded.get(key)
        if module is None:
            module = _import(path, interpret)
            _loaded[key] = module
    return getattr(module, attr)


def load_generated(name: str, generate, attr: str, interpret: bool):
    """The kernel `attr` of the generated module `name` for one mode: `generate()` gives the source,
    written to `<cache>/<name>.py` the first time this process loads `name` from that directory.
    Every lowering loads its kernels through here; `name` must be content-addressed (a hash of the
    source). Memoised per (name, attr, mode, cache directory): launches that are not kept ones call it."""
    memo = (name, interpret, attr, str(cache_dir()))
    kernel = _generated.get(memo)
    if kernel is None:
        kernel = load_kernel(write_source(name, generate()), attr, interpret)
        _generated[memo] = kernel
    return kernel


def _import(path: Path, interpret: bool):
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    mode = "interp" if interpret else "jit"
    module_name = f"_megafuse_kernel_{path.stem}_{digest}_{mode}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


def list_generated() -> list[dict]:
    """The kernel files in the cache directory, newest first: name, path, bytes, mtime, loaded modes."""
    directory = cache_dir()
    if not directory.is_dir():
        return []
    rows = []
    for path in directory.glob("*.py"):
        stat = path.stat()
        resolved = str(path.resolve())
        modes = [m for m, flag in (("interpreter", True), ("cuda", False)) if (resolved, flag) in _loaded]
        rows.append({"name": path.stem, "path": str(path), "bytes": stat.st_size,
                     "mtime": stat.st_mtime, "loaded": modes})
    rows.sort(key=lambda r: r["mtime"], reverse=True)
    return rows
