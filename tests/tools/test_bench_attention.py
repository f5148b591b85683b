"""tools/bench_attention.py on the CPU: the dry run checks the kernel against the chain at toy
sizes, split and unsplit (the H200 run adds the V4 widths and the timings)."""

import json

import pytest

from megafuse.lowering import mega_attention as ma
from megafuse.tools import bench_attention


def test_dry_run_checks_every_split_against_the_chain(tmp_path):
    out = tmp_path / "bench.json"
    assert bench_attention.main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["correctness"]
    assert {(r["T"], r["splits"]) for r in rows} == {(1, 1), (1, 2), (1, 3), (3, 1), (3, 2), (3, 3)}
    assert all(r["ok"] and r["rel_err"] <= 1e-2 for r in rows)
    assert "results" not in result  # no timings on the CPU
    assert (tmp_path / "bench.log").read_text().endswith("6 checks, 0 failed\n")


def test_the_roofline_counts_keys_q_out_and_mask():
    spec = bench_attention.V4
    assert bench_attention.attention_bytes(spec, 1, 640) == 640 * 512 * 2 + 2 * 64 * 512 * 2 + 640
    assert bench_attention.attention_flops(spec, 2, 640) == 4 * 2 * 64 * 640 * 512


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    inputs = bench_attention.make_inputs(bench_attention.TOY, 3, 20, "cpu", seed=0)
    monkeypatch.setattr(ma, "mega_attention", lambda *a, **k: ma.reference(*a[:6]) * 1.1)
    assert not bench_attention.check(bench_attention.TOY, inputs)["ok"]


@pytest.mark.parametrize("argv", [["--dry-run", "--tokens", "0"], ["--dry-run", "--splits", "x"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        bench_attention.main(argv)
    assert e.value.code == 2
