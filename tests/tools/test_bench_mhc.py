"""tools/bench_mhc.py's trace summary (the GPU fills the traces; here they are built by hand) and its
command line."""

import pytest
import torch

from megafuse.lowering import mega_mhc as mm
from megafuse.tools.bench_mhc import _sharing_an_sm, summarise_traces
from megafuse.tools.bench_mhc import main as bench_main


def launch(rescale_end_ns: int, base_ns: int) -> torch.Tensor:
    """Three programs of one launch: two stage-A jobs (the second is the tile's last arrival and
    merges it) and one rescale job, which runs on the first job's SM while it runs; 0 where a
    program never reached the event."""
    ev = {name: i for i, name in enumerate(mm.TRACE_EVENTS)}
    role = {name: i for i, name in enumerate(mm.TRACE_ROLES)}
    t = torch.zeros(3, len(mm.TRACE_EVENTS), dtype=torch.int64)
    rows = [dict(start=1000, claimed=1500, work=3000, arrived=4000, end=5000, job=0, role=role["stage A"], sm=7),
            dict(start=1100, claimed=1600, work=3500, arrived=4500, finished=7000, end=7100, job=1,
                 role=role["stage A"], sm=3),
            dict(start=1050, claimed=1550, ready=7200, work=8000, end=rescale_end_ns, job=2, role=role["rescale"],
                 sm=7)]
    for p, row in enumerate(rows):
        for name, value in row.items():
            t[p, ev[name]] = value + (base_ns if name in mm.TRACE_TIMES else 0)
    return t


def test_summary_is_relative_to_the_first_start_per_role_and_median_over_launches():
    # the GPU's clock differs between launches (base_ns); the rescale job ends 8, 9, 10 us in
    out = summarise_traces([launch(9000, 0), launch(10000, 10 ** 9), launch(11000, 5 * 10 ** 9)])
    assert out["span_us"] == 9.0
    stage_a, rescale = out["roles"]["stage A"], out["roles"]["rescale"]
    assert set(out["roles"]) == {"stage A", "rescale"}
    assert stage_a["programs"] == 2 and rescale["programs"] == 1
    assert stage_a["sharing_sm"] == 1 and rescale["sharing_sm"] == 1  # jobs 0 and 2 on SM 7
    assert stage_a["work"] == {"n": 2, "median_us": 2.0, "max_us": 2.5}  # torch's median: the lower middle
    assert stage_a["finished"] == {"n": 1, "median_us": 6.0, "max_us": 6.0}  # only the last arrival merges
    assert "ready" not in stage_a and "finished" not in rescale  # events a role never reaches are absent
    assert rescale["ready"]["median_us"] == 6.2 and rescale["end"]["max_us"] == 9.0


@pytest.mark.parametrize("other", ["--dry-run", "--sweep"])
def test_leave_out_is_its_own_mode(other, capsys):
    with pytest.raises(SystemExit) as e:
        bench_main(["--leave-out", other])
    assert e.value.code == 2 and "--leave-out times the tuned launch on CUDA" in capsys.readouterr().err


def test_programs_share_an_sm_only_while_both_run():
    ev = {name: i for i, name in enumerate(mm.TRACE_EVENTS)}
    t = torch.zeros(4, len(mm.TRACE_EVENTS), dtype=torch.int64)
    # SM 1: the second program starts as the first ends (back to back, not beside it); SM 2: two
    # programs overlap by one ns
    for p, (sm, start, end) in enumerate([(1, 100, 200), (1, 200, 300), (2, 100, 200), (2, 199, 250)]):
        t[p, ev["sm"]], t[p, ev["start"]], t[p, ev["end"]] = sm, start, end
    assert _sharing_an_sm(t).tolist() == [False, False, True, True]
