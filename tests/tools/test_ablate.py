"""`megafuse ablate` on tiny's roles (one SWA block and two swept passes, to keep the four compiles cheap):
one row per configuration (with two passes "only a" is "all but b"),
matches equal to each compile's pass report, profiler kernel counts that agree with them; on CPU
interpreter wall clock and no speed-up (table, JSON) nor chart; on CUDA speed-ups and a PNG; tables
within 80 columns."""

import json
import re

import matplotlib.image
import pytest
import torch
from rich.console import Console

from megafuse import passes
from megafuse.tools import ablate
from megafuse.tools.cli import main
from megafuse.tools import common
from megafuse.tools.common import LayerHarness
from tests.tools.schemas import documented_schema

ABLATE_KEYS = {"schema", "config", "dtype", "quant", "device", "target", "compared", "batch", "tokens", "seed",
               "repeat", "passes", "timing", "kernel_count", "configurations", "rows", "png", "environment"}
ROW_KEYS = {"names", "passes", "matches", "report", "kernels_per_forward", "kernels", "kernel_time_us", "compile_s",
            "step_s", "step_times_s", "step_method", "step_spread_s", "speedup_vs_none", "speedup_resolved", "error"}


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    return tmp_path_factory.mktemp("ablate")


def test_ablate_has_one_row_per_configuration_with_counts_from_the_report(ablation, cached_compiles, tiny, tiny_config,
                                                                         capsys):
    out, png = ablation / "ablate.json", ablation / "ablate.png"
    swept = ["mega_mhc", "mega_gate"]  # registry order
    argv = ["ablate", "--config", tiny_config, "--layer", "0", "--passes", ",".join(swept), "--repeat", "1",
            "--json", str(out), "--png", str(png)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert set(r) == ABLATE_KEYS and r["schema"] == "megafuse.ablate/1"
    for key in ABLATE_KEYS | ROW_KEYS:  # the schema is the one documented
        assert key in documented_schema("megafuse.ablate/1"), key
    assert r["passes"] == swept and r["target"] == "layer 0"
    assert r["png"] is None and not png.exists()  # CPU: no chart
    assert r["timing"] == {"method": ablate.INTERPRETER_TIMING, "indicative": True}

    # one row per distinct configuration; every configuration name maps to exactly one row
    expected = {"none", "all", *(f"only {p}" for p in swept), *(f"all but {p}" for p in swept)}
    assert set(r["configurations"]) == expected
    rows = r["rows"]
    assert len(rows) == len(ablate.configurations(swept)) == len({frozenset(row["passes"]) for row in rows}) == 4
    assert r["configurations"]["only mega_gate"] == r["configurations"]["all but mega_mhc"]
    for name, index in r["configurations"].items():
        assert [i for i, row in enumerate(rows) if name in row["names"]] == [index]

    harness = LayerHarness(tiny.layers[0])
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["passes"] == [p for p in swept if p in row["passes"]]  # registry order
        report = cached_compiles.report(harness, row["passes"])
        assert row["matches"] == report.counts() == row["report"]["counts"]
        assert set(row["matches"]) == set(row["passes"])
        # each fused op is one kernel launch: the profiler agrees with the report
        assert row["kernels"]["megafuse"] == sum(row["matches"].values())
        assert row["kernels_per_forward"] == sum(row["kernels"].values()) > 0
        # the time is split by launcher: each matching pass's kernels, Inductor's generated C++
        assert set(row["kernel_time_us"]) - {"inductor", "other"} == set(row["matches"])
        assert row["kernel_time_us"]["inductor"] > 0 and all(t > 0 for t in row["kernel_time_us"].values())
        assert row["error"]["max_abs"] < 1e-3 and row["error"]["finite"]
        assert row["step_s"] > 0 and len(row["step_times_s"]) == 1
        assert row["step_spread_s"] == [row["step_s"]] * 2 and row["step_method"] == ablate.INTERPRETER_TIMING
        assert row["speedup_vs_none"] is None and not row["speedup_resolved"]  # interpreter times: no speed-up
    none, every = rows[r["configurations"]["none"]], rows[r["configurations"]["all"]]
    assert none["matches"] == {}
    assert every["matches"]["mega_gate"] == 1 and sum(every["matches"].values()) >= 2
    assert every["kernels_per_forward"] < none["kernels_per_forward"]  # fusion cuts launches

    captured = capsys.readouterr()
    assert "megafuse ablate" in captured.out and "all but mega_gate" in captured.out and f"wrote {png}" not in captured.out
    assert " ".join(captured.err.split()).count(
        f"no chart ({png}) on CPU: its times are the Triton interpreter's wall clock, not a speed-up") == 1
    fused, timed = ablate._tables(r)
    headers = [str(column.header) for column in timed.columns]
    assert headers == ["configuration", "interpreter wall ms\nmedian \\[min-max]", "max\n|err|", "top-1\nagree"]
    assert "not a speed-up" in str(timed.title) and "kernels per forward" in str(fused.title)
    assert [str(column.header) for column in fused.columns] == ["configuration", *(p.replace("_", "_\n", 1) for p in swept),
                                                           "kernels"]  # "mega_" over the rest


def _result(device: str, swept: list[str], step_s: list[list[float]]) -> dict:
    """An ablate result with the given step times per row (the rest made up)."""
    rows = ablate.configurations(swept)
    for row, times in zip(rows, step_s, strict=True):
        row.update(matches={p: 1 for p in row["passes"]}, kernels_per_forward=1234.0, step_times_s=times,
                   step_s=sorted(times)[len(times) // 2], error={"max_abs": 1.25e-5, "top1_agreement": 0.875})
    ablate.speedups(rows, device, len(step_s[0]))
    method = "CUDA-graph replay (CUDA events)" if device == "cuda" else ablate.INTERPRETER_TIMING
    return {"config": "tiny", "target": "model", "device": device, "batch": 2, "tokens": 8, "passes": swept,
            "timing": {"method": method, "indicative": device != "cuda"}, "rows": rows}


def test_speed_ups_are_the_no_pass_rows_time_over_each_rows_on_cuda_only():
    swept = ["mega_mhc", "mega_gate"]  # rows: none, only mhc = all but gate, only gate = all but mhc, all
    times = [[4.0, 4.1, 4.2], [2.0, 2.1, 2.2], [3.9, 4.0, 4.15], [1.0, 1.05, 1.1]]
    rows = _result("cuda", swept, times)["rows"]
    assert [r["speedup_vs_none"] for r in rows] == [1.0, 4.1 / 2.1, 4.1 / 4.0, 4.1 / 1.05]
    # resolved only where the spreads do not overlap none's [4.0, 4.2]: not the row of [3.9, 4.15]
    assert [r["speedup_resolved"] for r in rows] == [False, True, False, True]
    assert [r["step_spread_s"] for r in rows] == [[t[0], t[-1]] for t in times]
    for r in _result("cpu", swept, times)["rows"]:
        assert r["speedup_vs_none"] is None and not r["speedup_resolved"]
    assert not any(r["speedup_resolved"] for r in _result("cuda", swept, [t[:2] for t in times])["rows"])  # < MIN_RUNS


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_both_tables_fit_80_columns_with_every_registered_pass_and_nothing_cut(device):
    swept = passes.registry.available()
    n = len(ablate.configurations(swept))
    # the widest times: 12.35 ms [12.34-98.77] (five characters each); the last row within none's spread
    result = _result(device, swept, [[0.01234, 0.012345, 0.09877]] + [[0.001, 0.002, 0.003]] * (n - 2)
                     + [[0.05, 0.06, 0.07]])
    console = Console(width=80, record=True)
    for table in ablate._tables(result):
        console.print(table)
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text
    assert "12.35 [12.34-98.77]" in text and "2.00 [1.00-3.00]" in text and "1234" in text and "88%" in text
    speedups = re.findall(r"\d\.\d\dx", text)
    if device == "cuda":  # none's 1.00x, the resolved rows' 6.17x, the last row unresolved
        assert speedups == ["1.00x"] + ["6.17x"] * (n - 2) and text.count("unresolved") == 1
    else:  # no speed-up column
        assert speedups == [] and "vs none" not in text and "unresolved" not in text
    for row in result["rows"]:
        for name in row["names"]:
            assert name in text


def test_the_chart_on_cuda_draws_a_bar_per_row(tmp_path):
    result = _result("cuda", ["mega_mhc", "mega_gate"], [[4.0, 4.1, 4.2], [2.0, 2.1, 2.2], [3.9, 4.0, 4.15], [1.0, 1.05, 1.1]])
    png = tmp_path / "ablate.png"
    ablate._chart(result, str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0.05


@pytest.mark.parametrize("device, name, owner", [
    ("cuda", "mega_attention_kernel", "mega_attention"),
    ("cuda", "mega_attention_kernel_combine", "mega_attention"),  # a split launch's merge
    ("cuda", "mega_gate_kernel", "mega_gate"),
    ("cuda", "triton_per_fused_amax_exp_0", "inductor"),
    ("cuda", "mega_attention_kernelx", "other"),  # a prefix only at a name boundary
    ("cuda", "sm90_xmma_gemm_bf16", "other"),
    ("cpu", "megafuse::mega_mhc_kernel", "mega_mhc"),
    ("cpu", "megafuse::unregistered_kernel", "megafuse::unregistered_kernel"),
    ("cpu", "graph_0_cpp_fused_add_0", "inductor"),
    ("cpu", "aten::mm", "other"),
])
def test_profiled_kernels_are_owned_by_the_pass_that_generated_them(device, name, owner):
    assert common.kernel_owner(name, common.megafuse_kernel_names(), device) == owner


def test_the_heaviest_kernels_add_up_to_their_launchers_time(monkeypatch):
    # a module of three Inductor kernels (a reduction between pointwise ops) and one ATen mm: every
    # name is listed, and each launcher's listed kernels add up to its time and launch count
    class Module(torch.nn.Module):
        def forward(self, x, w):
            h = torch.relu(x @ w)
            return (h - h.amax(-1, keepdim=True)).exp() * 2
    x, w = torch.randn(64, 32), torch.randn(32, 48)
    compiled = common.compile_model(Module().eval(), [], "cpu")
    compiled(x, w)
    counted = common.count_kernels(compiled, (x, w), "cpu", forwards=3)
    heaviest = counted["heaviest"]
    assert {k["owner"] for k in heaviest} == set(counted["time_us"]) == {"inductor", "other"}
    assert [k["time_us"] for k in heaviest] == sorted((k["time_us"] for k in heaviest), reverse=True)
    for owner, us in counted["time_us"].items():
        assert sum(k["time_us"] for k in heaviest if k["owner"] == owner) == pytest.approx(us, rel=1e-9)
        assert sum(k["launches"] for k in heaviest if k["owner"] == owner) == pytest.approx(counted["by_kind"][owner])
    assert any(k["name"] == "aten::mm" and k["launches"] == pytest.approx(1) for k in heaviest)

    monkeypatch.setattr(common, "HEAVIEST_KERNELS", 1)  # the list is cut to the longest-running name
    top = common.count_kernels(compiled, (x, w), "cpu")["heaviest"]
    assert len(top) == 1 and top[0]["name"] in {k["name"] for k in heaviest}
