"""Mega-mHC's launch modes on CUDA (skipped without a GPU; run on the H200 with
`python3 -m pytest tests/lowering/test_mega_mhc_gpu.py`)."""

import dataclasses

import pytest
import torch

from lowering import mega_mhc as mm
from tests.lowering.test_mega_mhc import assert_matches_reference, make_inputs, make_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_co_resident_only_where_the_grid_fits(monkeypatch):
    # V4.1's widths: at T=64 the tuned grid (128 programs) fits on an H200 at once and launches
    # cooperatively with job = program id; at T=4096 (768 programs) it does not, and the jobs are
    # claimed. Both equal the reference, and so does the T=64 launch with its jobs claimed.
    spec = make_spec("delayed", "bfloat16", dim=5120)
    decided = []
    fits = mm._fits_at_once
    monkeypatch.setattr(mm, "_fits_at_once", lambda *a: decided.append(fits(*a)) or decided[-1])
    for T in (64, 4096):
        args = tuple(a.cuda() for a in make_inputs(spec, T, seed=T))
        assert_matches_reference(spec, args, mm.mega_mhc(*args, spec))
    assert decided == [True, False]
    args = tuple(a.cuda() for a in make_inputs(spec, 64, seed=1))
    claimed = dataclasses.replace(mm.choose_config(spec, 64), co_resident=False)
    assert_matches_reference(spec, args, mm.mega_mhc(*args, spec, config=claimed))
