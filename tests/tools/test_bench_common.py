"""The H200 benchmarks' command lines on a machine without CUDA: a usage error, not a traceback; where
their results go."""

import tempfile

import pytest
import torch

from megafuse.tools.bench_common import default_out
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
