"""The kernel cache: where sources go, atomic idempotent writes, one module per Triton mode."""

import os

import pytest

from megafuse.lowering import kernel_cache

SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def double(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)
'''


@pytest.fixture(autouse=True)
def _reset_override():
    yield
    kernel_cache.set_cache_dir(None)


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_cache.ENV_VAR, raising=False)
    assert kernel_cache.cache_dir() == kernel_cache.DEFAULT_DIR.expanduser()
    monkeypatch.setenv(kernel_cache.ENV_VAR, str(tmp_path / "env"))
    assert kernel_cache.cache_dir() == tmp_path / "env"
    kernel_cache.set_cache_dir(tmp_path / "explicit")
    assert kernel_cache.cache_dir() == tmp_path / "explicit"
    kernel_cache.set_cache_dir(None)
    assert kernel_cache.cache_dir() == tmp_path / "env"


def test_write_is_idempotent_and_leaves_no_temporaries(tmp_path):
    kernel_cache.set_cache_dir(tmp_path)
    path = kernel_cache.write_source("k_abc", SOURCE)
    assert path == tmp_path / "k_abc.py" and path.read_text() == SOURCE
    mtime = path.stat().st_mtime_ns
    assert kernel_cache.write_source("k_abc", SOURCE) == path and path.stat().st_mtime_ns == mtime
    kernel_cache.write_source("k_abc", SOURCE + "\n# changed\n")
    assert path.read_text().endswith("# changed\n")
    assert sorted(os.listdir(tmp_path)) == ["k_abc.py"]
    with pytest.raises(ValueError, match="identifier"):
        kernel_cache.write_source("not-a-module", SOURCE)


def test_each_mode_gets_its_own_module(tmp_path):
    """TRITON_INTERPRET is read at decoration: the same file must give one function per mode."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kernel_cache.set_cache_dir(tmp_path)
    path = kernel_cache.write_source("k_double", SOURCE)
    before = os.environ.get("TRITON_INTERPRET")
    interpreted = kernel_cache.load_kernel(path, "double", interpret=True)
    compiled = kernel_cache.load_kernel(path, "double", interpret=False)
    assert os.environ.get("TRITON_INTERPRET") == before  # restored
    assert isinstance(interpreted, InterpretedFunction) and isinstance(compiled, JITFunction)
    assert kernel_cache.load_kernel(path, "double", interpret=True) is interpreted  # memoised
    x = torch.arange(5, dtype=torch.float32)
    interpreted[(1,)](x, 5, BLOCK=8)
    assert x.tolist() == [0, 2, 4, 6, 8]
    rows = kernel_cache.list_generated()
    assert rows[0]["name"] == "k_double" and sorted(rows[0]["loaded"]) == ["cuda", "interpreter"]
