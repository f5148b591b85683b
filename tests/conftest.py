import pytest
import torch

from model import build_model, preset


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
