"""The whole model traces with torch.compile(fullgraph=True) and Inductor's output matches eager.

On tiny's roles at 5 layers (`tests/passes/tiny.every_role_tiny`), compiled twice: without
quantisation (the 1e-4 fp32 bound) and with the reference fake quantisation.
"""

import pytest
import torch

from megafuse.model import build_model
from tests.passes.tiny import every_role_tiny

pytestmark = pytest.mark.slow  # whole models compiled


def _compiled_vs_eager(cfg, seed):
    model = build_model(cfg, seed=seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)(ids)
    return compiled, model(ids)


def test_tiny_compiles_fullgraph_and_matches_eager():
    compiled, eager = _compiled_vs_eager(every_role_tiny(quant="none", dtype="float32"), seed=0)
    assert (compiled - eager).abs().max().item() <= 1e-4


def test_tiny_with_reference_quantisation_compiles_and_agrees():
    compiled, eager = _compiled_vs_eager(every_role_tiny(quant="ref", dtype="float32"), seed=1)
    # A ~1e-7 difference can move a value across an FP4/FP8 rounding boundary, and one FP4 step in a
    # cached key moves every later position's logits: on one 2-core Xeon, compiled and eager differ
    # by 3e-7 at most positions but by up to 5e-3 from the sixth position of the first sequence on
    # and by 0.12 at its last (a max-error bound of 2e-2 passed on the CI machine and failed there).
    # So the bound is on the typical logit, which such flips leave near 5e-4 even where they reach:
    # the median error stays under 2e-3, where dropping the quantisation altogether (quant="none"
    # against "ref") moves it to 1.9e-2 and the top-1 agreement to 0.90.
    err = (compiled - eager).abs()
    assert err.median().item() <= 2e-3
    assert (compiled.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.95
