"""The H200 benchmarks' command lines on a machine without CUDA: a usage error, not a traceback; where
their results go; a run cut off by its time limit, resumed."""

import json
import tempfile

import pytest
import torch

from megafuse.tools.bench_common import Stages, default_out
from megafuse.tools.bench_decode import main as bench_decode_main
from megafuse.tools.bench_gate import main as bench_gate_main
from megafuse.tools.bench_mhc import main as bench_mhc_main


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine these would run the benchmark")
@pytest.mark.parametrize("main, argv", [(bench_mhc_main, []), (bench_mhc_main, ["--leave-out"]),
                                        (bench_gate_main, []), (bench_gate_main, ["--check-only"])])
def test_a_gpu_run_without_cuda_is_a_usage_error(main, argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    assert "no CUDA device; --dry-run runs its correctness part on CPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_dry_run_never_writes_the_committed_results_by_default(tmp_path, monkeypatch):
    # results/<op>/bench.json holds H200 runs; a dry run without --out goes to the temp dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert default_out("mega_mhc", dry_run=False) == "results/mega_mhc/bench.json"
    assert default_out("mega_mhc", dry_run=True) == str(tmp_path / "mega_mhc_bench_dry_run.json")


ENV = {"date": "2026-01-01T00:00:00+00:00", "python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "device": "H200"}


def _stages(out, env=ENV, batches=(1, 32), log=None):
    return Stages({"config": "flash-lite", "batches": batches, "environment": env}, out, log or (lambda msg: None))


def test_resume_keeps_the_finished_stages_and_runs_the_failed_the_missing_and_the_rerun_ones(tmp_path):
    out, ran = str(tmp_path / "bench.json"), []

    def stage(name, value):
        return lambda: ran.append(name) or {"value": value}

    first = _stages(out)
    first.run("build", stage("build", 1))
    first.run("passes-1", stage("passes-1", 1))
    first.run("passes-32", lambda: 1 / 0)  # failed: runs again; "no-passes-1" never ran (the cut)
    logged = []
    second = _stages(out, env=ENV | {"date": "2026-01-02T00:00:00+00:00"}, log=logged.append)
    second.resume(same=("config", "batches"), rerun=("build",))
    for name in ("build", "passes-1", "passes-32", "no-passes-1"):
        second.run(name, stage(name, 2))

    assert ran == ["build", "passes-1", "build", "passes-32", "no-passes-1"]
    saved = json.load(open(out))
    assert saved["passes-1"] == {"value": 1} and saved["stages"]["passes-1"]["kept_from"] == ENV["date"]
    assert saved["build"] == saved["passes-32"] == saved["no-passes-1"] == {"value": 2}
    assert saved["resumed"] == {"from": ENV["date"], "kept": ["passes-1"]}
    assert f"== passes-1: kept from the run of {ENV['date']}" in logged


def test_resume_refuses_another_runs_results_and_names_what_differs(tmp_path):
    out = str(tmp_path / "bench.json")
    _stages(out).run("passes-1", lambda: {"value": 1})
    with pytest.raises(ValueError) as e:
        _stages(out, env=ENV | {"device": "NVIDIA H100"}, batches=(1, 2)).resume(same=("config", "batches"))
    assert "batches: [1, 32] there, [1, 2] here" in str(e.value)
    assert "environment.device: 'H200' there, 'NVIDIA H100' here" in str(e.value)
    assert "config" not in str(e.value)  # what agrees is not listed
    with pytest.raises(ValueError, match="nothing to resume: .* does not exist"):
        _stages(str(tmp_path / "missing.json")).resume(same=("config",))


def test_bench_decode_resume_without_an_earlier_run_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_decode_main(["--config", "tiny", "--dry-run", "--resume", "--out", str(tmp_path / "none.json")])
    assert e.value.code == 2
    assert "nothing to resume" in capsys.readouterr().err
