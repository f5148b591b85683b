"""passes/inductor_cache.py: the entries an interrupted C++ build leaves in Inductor's cache (empty,
truncated, unfinished) are found, removed under Inductor's build lock and reported; whole entries,
sources and entries being built stay. The cache here is a folder laid out as Inductor lays it out
(`<root>/<xy>/<key>.main.so`, `<root>/locks/<key>.lock`, `precompiled_headers/<h>.h.gch`)."""

import shutil
import sys
from pathlib import Path

import filelock
import pytest
import torch

from megafuse.passes import inductor_cache
from megafuse.passes.inductor_cache import CorruptEntry, find_corrupt, remove_named_in, repair

ELF = Path(torch._C.__file__)  # a whole shared library (torch's 9 KB extension stub)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the ELF checks run on Linux")


def _entry(root: Path, name: str, content: bytes | Path = b"") -> Path:
    path = root / name[1:3] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, Path):
        shutil.copyfile(content, path)
    else:
        path.write_bytes(content)
    return path


def _reasons(root: Path) -> dict[str, str]:
    return {entry.path.name: entry.reason for entry in find_corrupt([root])}


def test_an_empty_library_is_found_removed_and_reported(tmp_path):
    empty = _entry(tmp_path, "cab12.main.so")
    assert find_corrupt([tmp_path]) == [CorruptEntry(empty, "empty")]
    assert repair([tmp_path]) == [CorruptEntry(empty, "empty")]
    assert not empty.exists()
    assert find_corrupt([tmp_path]) == [] and repair([tmp_path]) == []


@linux_only
def test_a_truncated_or_headless_library_is_found(tmp_path):
    data = ELF.read_bytes()
    _entry(tmp_path, "cab12.main.so", data[:100])  # cut inside its program headers
    _entry(tmp_path, "ccd34.main.so", data[: len(data) // 2])  # cut inside its sections
    _entry(tmp_path, "cef56.so", bytes(64) + data[64:])  # the ELF header never written (the linker writes it last)
    _entry(tmp_path, "cgh78.o", b"\x7fELF\x09")  # a header cut short
    _entry(tmp_path, "cij90.so", data[:58] + (2).to_bytes(2, "little") + data[60:])  # 2-byte section headers
    reasons = _reasons(tmp_path)
    assert reasons["cab12.main.so"].startswith("truncated: its headers end at byte ")
    assert reasons["ccd34.main.so"].startswith("truncated: ")
    assert reasons["ccd34.main.so"].endswith(f"the file has {len(data) // 2}")
    assert reasons["cef56.so"] == "not an ELF file"
    assert reasons["cgh78.o"] == "a damaged ELF header"
    assert reasons["cij90.so"] == "damaged ELF headers"
    assert len(repair([tmp_path])) == 5 and find_corrupt([tmp_path]) == []


def test_an_unfinished_build_is_found_and_its_scratch_folder_removed(tmp_path):
    # the linker may have written a whole-looking file; the scratch folder says it never returned
    product = _entry(tmp_path, "cab12.main.so", ELF)
    scratch = product.parent / "cab12.main_CxxBuild"
    scratch.mkdir()
    assert inductor_cache.scratch_folder(product) == scratch
    assert repair([tmp_path]) == [CorruptEntry(product, "its build never finished")]
    assert not product.exists() and not scratch.exists()


def test_whole_entries_and_sources_are_kept(tmp_path):
    kept = [_entry(tmp_path, "cab12.main.so", ELF), _entry(tmp_path, "cab12.main.cpp", b""),
            _entry(tmp_path, "ccd34.py", b""), _entry(tmp_path, "fxgraph_entry", b"")]
    headers = tmp_path / "precompiled_headers"
    headers.mkdir()
    (headers / "cgh.h").write_text("#include <x.h>\n")
    (headers / "cgh.h.gch").write_bytes(b"gpch.014" + bytes(100))
    assert find_corrupt([tmp_path]) == [] and repair([tmp_path]) == []
    assert all(p.exists() for p in kept) and (headers / "cgh.h.gch").exists()


def test_a_precompiled_header_is_checked_under_its_own_lock(tmp_path):
    headers = tmp_path / "precompiled_headers"
    headers.mkdir()
    unfinished, foreign = headers / "cgh.h.gch", headers / "cij.h.gch"
    unfinished.write_bytes(b"gpch.014" + bytes(100))
    (headers / "cgh.h_CxxBuild").mkdir()
    foreign.write_bytes(b"\0" * 100)
    assert inductor_cache.build_locks(unfinished) == [headers / "locks" / "cgh.lock"]
    assert _reasons(tmp_path) == {"cgh.h.gch": "its build never finished", "cij.h.gch": "not a precompiled header"}
    assert len(repair([tmp_path])) == 2 and not unfinished.exists() and not foreign.exists()


def test_an_entry_being_built_is_left_alone_until_its_lock_is_free(tmp_path):
    building = _entry(tmp_path, "cab12.main.so")
    lock = tmp_path / "locks" / "cab12.lock"
    assert inductor_cache.build_locks(building) == [lock]
    lock.parent.mkdir()
    with filelock.FileLock(str(lock)):  # Inductor's protocol: the builder holds it until the file is whole
        assert find_corrupt([tmp_path]) == [CorruptEntry(building, "empty")]  # reading sees it
        assert repair([tmp_path], budget_s=1.0) == [] and building.exists()  # removing waits its turn
    assert repair([tmp_path]) == [CorruptEntry(building, "empty")]


def test_an_optimized_object_is_guarded_by_the_locks_of_its_folder_mains(tmp_path):
    # Inductor links `<okey>.optimized.o` into the folder of the `.main` that needs it, under that main's lock
    folder = tmp_path / "qa"
    folder.mkdir()
    optimized = folder / "cxy.optimized.o"
    for name in ("cxy.optimized.o", "cqa.main.cpp", "cqb.main.cpp"):
        (folder / name).write_bytes(b"")
    locks = tmp_path / "locks"
    assert inductor_cache.build_locks(optimized) == [locks / "cqa.lock", locks / "cqb.lock", locks / "cxy.lock"]


def test_the_roots_follow_the_cache_variable_and_keep_the_headers_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(inductor_cache, "default_cache_dir", lambda: tmp_path / "torchinductor_me")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache.cache_roots() == [tmp_path / "mine", tmp_path / "torchinductor_me" / "precompiled_headers"]
    assert inductor_cache.clear_command() == (f"rm -rf {tmp_path / 'mine'} "
                                              f"{tmp_path / 'torchinductor_me' / 'precompiled_headers'}")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert inductor_cache.cache_roots() == [tmp_path / "torchinductor_me"]  # the headers lie inside it


def test_a_load_failure_naming_a_cache_file_removes_it(tmp_path):
    library = _entry(tmp_path, "cab12.main.so", ELF)  # whole to the checks, and still it failed to load
    other = _entry(tmp_path, "ccd34.main.so", ELF)
    try:
        try:
            raise ImportError(f"{library}: file too short")
        except ImportError as e:
            raise RuntimeError(f"InductorError: ImportError: {e}") from e
    except RuntimeError as e:
        failure = e
    assert remove_named_in(RuntimeError(f"boom near {other}"), [tmp_path]) == []  # not a load failure
    assert remove_named_in(failure, [tmp_path]) == [CorruptEntry(library, "it did not load")]
    assert not library.exists() and other.exists()


def test_a_pch_failure_removes_the_header_the_command_line_includes(tmp_path):
    headers = tmp_path / "precompiled_headers"
    headers.mkdir()
    header = headers / "cgh.h"
    header.write_text("#include <x.h>\n")
    (headers / "cgh.h.gch").write_bytes(b"gpch.014" + bytes(100))
    failure = RuntimeError(f"C++ compile error\nCommand:\ng++ x.cpp -include {header} -o {tmp_path}/ab/cab.so\n"
                           "<command-line>: fatal error: cannot read PCH file: No such file or directory")
    assert remove_named_in(failure, [tmp_path]) == [CorruptEntry(headers / "cgh.h.gch", "it did not load")]
    assert header.exists()


def test_repair_once_checks_each_cache_once_a_process(monkeypatch, tmp_path):
    monkeypatch.setattr(inductor_cache, "default_cache_dir", lambda: tmp_path / "default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "first"))
    first = _entry(tmp_path / "first", "cab12.main.so")
    assert inductor_cache.repair_once() == [CorruptEntry(first, "empty")]
    again = _entry(tmp_path / "first", "ccd34.main.so")  # this process's own build, from here on
    assert inductor_cache.repair_once() == [] and again.exists()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "second"))
    second = _entry(tmp_path / "second", "cef56.main.so")
    assert inductor_cache.repair_once() == [CorruptEntry(second, "empty")]
