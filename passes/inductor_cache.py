"""Inductor's on-disk cache, checked before it is trusted: an interrupted C++ build leaves an entry
that breaks every later compile, and this module finds such entries and removes them.

    hazard  Inductor builds each C++ kernel straight into its cache path (`g++ ... -o <key>.so`,
            `cpp_builder.CppBuilder.build`), not into a temporary file it renames. The linker
            creates the output first and fills it last, so a SIGINT in between leaves a 0-byte or
            truncated `.so`. Later compiles build only targets that do not exist
            (`codecache._worker_compile_cpp`), so they keep the broken file and fail to load it
            ("file too short"), every run, after compiling everything else. A truncated
            precompiled header (`.h.gch`) fails every C++ compile ("cannot read PCH file").
    sign    A build runs in a scratch folder `<name>_CxxBuild` beside its output, removed only once
            the build succeeds: an output beside its scratch folder is an unfinished build.
    where   `cache_roots()`: $TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER), and the
            precompiled headers, which Inductor keeps under the default folder whatever
            TORCHINDUCTOR_CACHE_DIR says (`<default>/precompiled_headers`).
    check   `find_corrupt()`: a build product (.so, .o, .gch) that is empty, unfinished, or (on
            Linux) an ELF file without the ELF magic or shorter than its own headers say.
    repair  `repair()`: removes each corrupt entry (and its scratch folder) while holding
            Inductor's build lock for it; an entry whose lock another process holds is being built
            now, and is left alone. Inductor builds a removed entry again on the next compile.
            `repair_once()`: the same, once per process and cache (before its first compile).
    after   `remove_named_in(error)`: a load failure that names a cache file (a corruption the
            checks cannot see) removes that file; `clear_command()` is the command that clears
            everything, for a message to name.

Nothing here runs at import: the command line calls `repair_once()` before a compiling tool runs,
and `repair()` on a Ctrl-C (tools/cli.py); a library user may call either before `passes.compile`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import filelock

PRODUCTS = (".so", ".o", ".gch")  # what a C++ build writes non-atomically (sources go through write_atomic)
SCRATCH = "_CxxBuild"  # cpp_builder._BUILD_TEMP_DIR: `<output dir>/<name>_CxxBuild`
HEADERS = "precompiled_headers"  # codecache._HEADER_DIR, under the default cache folder
PCH_MAGIC = (b"gpch", b"CPCH")  # GCC's and clang's precompiled headers
LOCK_WAIT_S = 0.5  # per suspect: time for a build thread of this process to unwind after a Ctrl-C
SHT_NOBITS = 8  # .bss and its kind occupy no bytes of the file
# a loader's or compiler's words for a cache file that is not what its build wrote
LOAD_FAILURES = ("file too short", "invalid ELF header", "ELF load command", "file truncated",
                 "file format not recognized", "cannot read PCH file", "not a PCH file")


@dataclasses.dataclass(frozen=True)
class CorruptEntry:
    """A cache file no compile can use, and why."""
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


# ------------------------------------------------------------------------------------------------
# where
# ------------------------------------------------------------------------------------------------

def default_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default
    return Path(inductor_default())


def cache_dir() -> Path:
    """Inductor's cache folder, as Inductor resolves it (without creating it)."""
    return Path(os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()))


def cache_roots() -> list[Path]:
    """The folders a C++ build writes into: the cache folder, and the precompiled headers' folder
    where it lies outside it."""
    roots, headers = [cache_dir()], Path(os.path.abspath(default_cache_dir())) / HEADERS
    if not headers.is_relative_to(roots[0]):
        roots.append(headers)
    return roots


def clear_command() -> str:
    """The shell command that empties Inductor's cache (every compile starts cold after it)."""
    return "rm -rf " + " ".join(shlex.quote(str(root)) for root in cache_roots())


# ------------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------------

def scratch_folder(product: Path) -> Path:
    """The folder a build of `product` runs in: `<name>_CxxBuild` for `<name><suffix>`."""
    return product.with_name(product.name[: -len(product.suffix)] + SCRATCH)


def _elf_problem(path: Path, size: int) -> str | None:
    """Why an ELF file cannot be whole: no magic (the linker writes the header last), or its
    program headers, section headers or a section's bytes lying past the end of the file."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF":
            return "not an ELF file"
        if len(head) < 52 or head[4] not in (1, 2) or head[5] not in (1, 2):
            return "a damaged ELF header"
        wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
        if wide and len(head) < 64:
            return "shorter than its ELF header"
        # e_phoff, e_shoff, then e_phentsize, e_phnum, e_shentsize, e_shnum (ELF32 / ELF64 layouts)
        phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head, 32 if wide else 28)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54 if wide else 42)
        end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
        if end > size:
            return f"truncated: its headers end at byte {end}, the file has {size}"
        # each section header: sh_type at 4, then (ELF64) sh_offset at 24, sh_size at 32
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        for i in range(shnum):
            entry = table[i * shentsize:(i + 1) * shentsize]
            kind = struct.unpack_from(order + "I", entry, 4)[0]
            offset, length = struct.unpack_from(order + ("QQ" if wide else "II"), entry, 24 if wide else 16)
            if kind != SHT_NOBITS and offset + length > size:
                return f"truncated: section {i} ends at byte {offset + length}, the file has {size}"
    return None


def problem(path: Path) -> str | None:
    """Why the build product `path` cannot be used, or None if nothing shows."""
    try:
        size = path.stat().st_size
        if size == 0:
            return "empty"
        if scratch_folder(path).is_dir():
            return "its build never finished"
        if path.suffix == ".gch":
            with open(path, "rb") as f:
                return None if f.read(4) in PCH_MAGIC else "not a precompiled header"
        if sys.platform.startswith("linux"):  # Inductor's .so/.o are ELF here (Mach-O on macOS)
            return _elf_problem(path, size)
    except struct.error:  # a header table entry shorter than its fields
        return "damaged ELF headers"
    except OSError:  # removed meanwhile (another process repaired or rebuilt it), or not ours to read
        return None
    return None


def _products(roots: Iterable[Path]) -> Iterator[Path]:
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d != "locks" and not d.endswith(SCRATCH)]
            for name in files:
                if name.endswith(PRODUCTS):
                    yield Path(folder, name)


def find_corrupt(roots: Iterable[Path] | None = None) -> list[CorruptEntry]:
    """Every build product under `roots` (default `cache_roots()`) that no compile can use.
    Reading only: an entry being built by another process right now shows here too."""
    return [CorruptEntry(p, why) for p in _products(cache_roots() if roots is None else roots)
            if (why := problem(p)) is not None]


# ------------------------------------------------------------------------------------------------
# repair
# ------------------------------------------------------------------------------------------------

def build_locks(product: Path) -> list[Path]:
    """The file locks Inductor holds while it builds `product`: `locks/<key>.lock` beside the
    cache's subfolders (`<root>/<xy>/<key>[.main].so`) or inside `precompiled_headers/`; an
    `.optimized.o` is linked under the lock of a `.main` in its folder."""
    folder = product.parent
    locks = folder / "locks" if folder.name == HEADERS else folder.parent / "locks"
    keys = {product.name.split(".")[0]}
    if ".optimized." in product.name:
        keys |= {p.name.split(".")[0] for p in folder.glob("*.main.cpp")}
    return [locks / f"{key}.lock" for key in sorted(keys)]


@contextlib.contextmanager
def _holding(locks: list[Path], wait_s: float):
    """Hold every lock, or raise filelock.Timeout if another holder keeps one past `wait_s`."""
    with contextlib.ExitStack() as stack:
        for lock in locks:
            lock.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(filelock.FileLock(str(lock), timeout=wait_s))
        yield


def _remove(entry: CorruptEntry) -> None:
    entry.path.unlink(missing_ok=True)
    shutil.rmtree(scratch_folder(entry.path), ignore_errors=True)


def repair(roots: Iterable[Path] | None = None, *, budget_s: float = 5.0) -> list[CorruptEntry]:
    """Remove every corrupt entry under `roots` (default `cache_roots()`), each checked again under
    Inductor's build lock for it; return those removed. An entry whose lock stays held is being
    built (another process, or a thread of this one) and is skipped, as is everything once
    `budget_s` has gone by waiting on locks."""
    removed, deadline = [], time.monotonic() + budget_s
    for suspect in find_corrupt(roots):
        wait_s = min(LOCK_WAIT_S, deadline - time.monotonic())
        if wait_s <= 0:
            break
        try:
            with _holding(build_locks(suspect.path), wait_s):
                why = problem(suspect.path)  # the holder we waited for may have finished it
                if why is not None:
                    entry = CorruptEntry(suspect.path, why)
                    _remove(entry)
                    removed.append(entry)
        except (filelock.Timeout, OSError):  # being built now, or a lock we may not create
            continue
    return removed


_repaired: set[tuple[Path, ...]] = set()  # the roots repair_once() has checked in this process


def repair_once() -> list[CorruptEntry]:
    """`repair()` the first time this process asks for the current roots, [] after: what earlier
    processes left is gone by then, and this process's own builds are Inductor's to finish. (Tests
    run the command line many times in one process, each over the same cache.)"""
    roots = tuple(cache_roots())
    if roots in _repaired:
        return []
    _repaired.add(roots)
    return repair(roots)


# ------------------------------------------------------------------------------------------------
# after a failure
# ------------------------------------------------------------------------------------------------

def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error, its causes and contexts, and what InductorError wraps (`inner_exception`)."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]


def remove_named_in(error: BaseException, roots: Iterable[Path] | None = None) -> list[CorruptEntry]:
    """If `error` is a load or compile failure over a cache file (`LOAD_FAILURES`) and names build
    products under `roots`, remove them (under their locks) and return them; else nothing. The
    file behind a PCH failure is `<header>.gch` beside the `<header>` the command line names."""
    roots = cache_roots() if roots is None else list(roots)
    text = "\n".join(str(e) for e in _chain(error))
    if not any(phrase in text for phrase in LOAD_FAILURES):
        return []
    named = set()
    for root in roots:
        for match in re.findall(re.escape(str(root)) + r"/[^\s:'\"]+", text):
            path = Path(match.rstrip(".,;)]}"))  # a path at the end of a sentence
            for candidate in (path, path.with_name(path.name + ".gch")):
                if candidate.suffix in PRODUCTS and candidate.is_file():
                    named.add(candidate)
    removed = []
    for path in sorted(named):
        with contextlib.suppress(filelock.Timeout, OSError), _holding(build_locks(path), LOCK_WAIT_S):
            entry = CorruptEntry(path, problem(path) or "it did not load")
            _remove(entry)
            removed.append(entry)
    return removed
