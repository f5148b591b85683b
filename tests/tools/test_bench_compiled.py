"""tools/bench_compiled.py on the CPU: the dry run compiles each plain-torch chain with the passes and
checks that it fuses whole and equals eager (the H200 run adds the timings); its command line."""

import json
import subprocess
import sys

import pytest
import torch

from megafuse.tools.bench_compiled import main


def test_dry_run_fuses_each_chain_whole_and_equals_eager(tmp_path):
    # in a process of its own: the benchmark resets Dynamo between chains, which would throw away
    # the compiled modules the other tool tests share (tests/tools/conftest.py)
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "megafuse.tools.bench_compiled", "--dry-run", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.read_text())
    chains = {name: r for name, r in results.items() if isinstance(r, dict) and "fused_whole" in r}
    assert sorted(chains) == ["gate_T1", "gate_T16", "mhc_T1", "mhc_T16", "moe_T1", "moe_T16"]
    for name, r in chains.items():
        assert r["fused_whole"] and r["rejections"] == [], name
        assert "fused_graph_us" not in r  # no timings on the CPU
        for errors in (r["errors"], r["errors_repeat"]):  # the first call, then the same layout again
            if name.startswith("gate"):
                assert errors["ids_equal_fraction"] == 1.0 and errors["weights_rel_err"] <= 1e-5, name
            elif name.startswith("moe"):  # bf16 out; an MXFP8 activation may land one e4m3 step away on a tie
                assert errors["out"] <= 2.0**-7, name
            else:  # X' and u are bf16 like the streams; the coefficients fp32
                assert max(errors[k] for k in ("X", "u")) <= 1e-2, name
                assert max(errors[k] for k in ("pre", "post", "comb")) <= 1e-5, name
    assert [s["has_coefficients"] and s["has_post"] for s in chains["mhc_T1"]["specs"]] == [True]
    assert [(s["weight_dtype"], s["mxfp8"]) for s in chains["moe_T1"]["specs"]] == [("bfloat16", True)]


@pytest.mark.parametrize("argv, message", [
    (["--dry-run", "--tokens", "0"], "--tokens takes comma-separated positive integers"),
    (["--dry-run", "--ops", "attention"], "unknown ops ['attention']; valid: mhc, gate, moe"),
])
def test_bad_arguments_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_timed_run_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--ops", "gate"])
    assert exit_.value.code == 2 and "no CUDA device" in capsys.readouterr().err
