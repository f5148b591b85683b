"""Mega-mHC's launch modes on CUDA (skipped without a GPU; run on the H200 with
`python3 -m pytest tests/lowering/test_mega_mhc_gpu.py`)."""

import dataclasses

import pytest
import torch

from megafuse.lowering import mega_mhc as mm
from tests.lowering.test_mega_mhc import assert_matches_reference, make_inputs, make_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_co_resident_only_where_the_grid_fits(monkeypatch):
    # V4.1's widths: at T=64 the tuned grid (128 programs) fits on an H200 at once and launches
    # cooperatively with job = program id; at T=4096 (768 programs) it does not, and the jobs are
    # claimed. Both equal the reference, and so does the T=64 launch with its jobs claimed.
    spec = make_spec("delayed", "bfloat16", dim=5120)
    mm.forget_kept_launches()  # an earlier test's launch of the same layout would skip the check
    decided = []
    fits = mm.fits_at_once
    monkeypatch.setattr(mm, "fits_at_once", lambda *a: decided.append(fits(*a)) or decided[-1])
    for T in (64, 4096):
        args = tuple(a.cuda() for a in make_inputs(spec, T, seed=T))
        assert_matches_reference(spec, args, mm.mega_mhc(*args, spec))
    assert decided == [True, False]
    args = tuple(a.cuda() for a in make_inputs(spec, 64, seed=1))
    claimed = dataclasses.replace(mm.choose_config(spec, 64), dispatch=mm.Dispatch.CLAIMED)
    assert_matches_reference(spec, args, mm.mega_mhc(*args, spec, config=claimed))


def test_handoff_launches_equal_the_reference_in_every_job_order(monkeypatch):
    # Dispatch.HANDOFF: job = program id with neither a claim nor a cooperative launch (no
    # co-resident build is compiled to decide). At T=64 and T=4096 (768 programs: not all resident)
    # it equals the reference, in program order and with the rescale jobs numbered first.
    spec = make_spec("delayed", "bfloat16", dim=5120)
    monkeypatch.setattr(mm, "fits_at_once", lambda *a: pytest.fail("a handoff launch asked for a co-resident build"))
    for T in (64, 4096):
        cfg = dataclasses.replace(mm.choose_config(spec, T), dispatch=mm.Dispatch.HANDOFF)
        plan = mm.plan(spec, cfg, T)
        assert plan["handoff"]
        args = tuple(a.cuda() for a in make_inputs(spec, T, seed=T + 5))
        for rotation in (0, plan["n_tiles"] * plan["n_splits"]):
            assert_matches_reference(spec, args, mm.mega_mhc(*args, spec, config=cfg, job_rotation=rotation))
        torch.cuda.synchronize()
        assert not mm.states[mm.device_key(args[0].device)].sync.any()


def test_monotonic_pdl_launches_stay_whole_across_sizes_and_forms():
    # The tuned T=64 launch runs MONOTONIC (co-resident, carried pre) and, on sm_90+, as a
    # programmatic dependent launch. Back to back with other sizes (T=37 on the same tile counters,
    # T=1's hand-off, T=512's claimed jobs), given fn pieces and the fresh form, every launch
    # equals the reference; afterwards the sync words are zero and every tile counter holds whole
    # launches (arrivals / n_splits == rescale tickets / r_splits).
    spec = make_spec("delayed", "bfloat16", dim=5120)
    fresh = make_spec("v4_fresh", "bfloat16", dim=5120)
    for i, (s, T, pieces) in enumerate([(spec, 64, False), (spec, 37, False), (spec, 1, False), (spec, 64, True),
                                        (spec, 512, False), (fresh, 64, False), (spec, 64, False)]):
        args = tuple(a.cuda() for a in make_inputs(s, T, seed=300 + i))
        kw = {"fn_pieces": mm.split_fn(args[5], s)} if pieces else {}
        assert_matches_reference(s, args, mm.mega_mhc(*args, s, **kw))
    torch.cuda.synchronize()
    state = mm.states[mm.device_key(torch.device("cuda"))]
    assert not state.sync.any()
    plan = mm.plan(spec, mm.choose_config(spec, 64), 64)
    counters = state.tiles[(plan["n_splits"], plan["r_splits"])]
    assert counters.any() and mm.counters_consistent(counters, plan["n_splits"], plan["r_splits"])


def test_repeat_launches_of_a_layout_reuse_the_first_decisions_and_equal_the_reference(monkeypatch):
    # lowering.launch: the first call of a layout decides (validation, config, co-resident check,
    # JIT); later calls of that layout launch the kept build directly. Every size's tuned launch
    # protocol, each called five times on fresh inputs, equals the reference every time, asks the
    # co-resident question at most once, and leaves the sync state zero.
    spec = make_spec("delayed", "bfloat16", dim=5120)
    mm.forget_kept_launches()
    decided = []
    fits = mm.fits_at_once
    monkeypatch.setattr(mm, "fits_at_once", lambda *a: decided.append(fits(*a)) or decided[-1])
    for T in (1, 64, 512):
        decided.clear()
        for seed in range(5):
            args = tuple(a.cuda() for a in make_inputs(spec, T, seed=1000 * T + seed))
            assert_matches_reference(spec, args, mm.mega_mhc(*args, spec))
        assert len(decided) <= 1
    torch.cuda.synchronize()
    assert not mm.states[mm.device_key(torch.device("cuda"))].sync.any()
