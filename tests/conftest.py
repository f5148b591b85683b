import pytest
import torch

from megafuse.model import build_model, preset


@pytest.fixture(scope="session")
def tiny_fp32():
    """The tiny config in fp32 without fake quantisation: exact comparisons are meaningful."""
    return preset("tiny").replace(quant="none", dtype="float32")


@pytest.fixture(scope="session")
def tiny_model(tiny_fp32):
    return build_model(tiny_fp32, seed=0)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items):
    # a test that compiles a whole model through the tool tests' shared cache is slow, and runs on
    # the worker that holds the cache's compiles (`make test`: --dist loadgroup), not compiling again
    for item in items:
        if "cached_compiles" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("compile_cache"))
