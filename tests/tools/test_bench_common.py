"""The H200 benchmarks' command lines on a machine without CUDA: a usage error, not a traceback."""

import pytest
import torch

from tools.bench_gate import main as bench_gate_main
from tools.bench_mhc import main as bench_mhc_main


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine these would run the benchmark")
@pytest.mark.parametrize("main, argv", [(bench_mhc_main, []), (bench_mhc_main, ["--leave-out"]),
                                        (bench_gate_main, []), (bench_gate_main, ["--check-only"])])
def test_a_gpu_run_without_cuda_is_a_usage_error(main, argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    assert "no CUDA device; --dry-run runs its correctness part on CPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written
