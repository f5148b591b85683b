"""tools/bench_attention.py on the CPU: the dry run checks the kernel against the chain at toy sizes,
split and unsplit, and that the attention module written outside the project fuses once through
`passes.compile` and equals eager (the GPU run adds the V4 widths and the timings).

The runs that compile do so in a process of their own: the benchmark resets Dynamo between T, which
would throw away the compiled modules the other tool tests share (tests/tools/conftest.py)."""

import json
import re
import subprocess
import sys

import pytest
import torch

from megafuse.lowering import mega_attention as ma
from megafuse.tools import bench_attention
from megafuse.tools.bench_attention import OutsideAttention, Tiles, launch_tiles
from megafuse.tools.bench_common import peak_hbm_bytes_per_s
from tests.tools.schemas import documented_schema

SCHEMA = "megafuse.bench_attention/2"


def run_python(code: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def documented(keys) -> None:
    doc = documented_schema(SCHEMA)
    for key in keys:
        assert re.sub(r"_T\d+$", "_T<T>", key) in doc, key


def test_dry_run_checks_the_kernel_and_fuses_the_outside_module_once(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "megafuse.tools.bench_attention", "--dry-run", "--out", str(out),
                          "--configs", "16x16x4x2,32x32x8x3"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == SCHEMA
    rows = result["correctness"]
    assert {(r["T"], r["splits"]) for r in rows} == {(1, 1), (1, 2), (1, 3), (3, 1), (3, 2), (3, 3)}
    assert all(r["ok"] and r["rel_err"] <= 1e-2 for r in rows)
    assert [r["T"] for r in result["results"]] == [1, 3]
    for r in result["results"]:
        assert r["fusion"]["counts"] == {"mega_attention": 1} and r["fusion"]["matched"] == 1, r["fusion"]
        assert r["fusion"]["ok"] and r["fusion"]["rel_err_vs_eager"] <= 1e-2 and r["fusion"]["spec"]["q_rope"]
        assert r["module_vs_chain_rel_err"] <= 1e-2
        assert "fused_graph_us" not in r  # no timings on the CPU
    for T in (1, 3):
        tiles = result[f"configs_T{T}"]
        assert [(t["block_h"], t["block_j"], t["num_warps"], t["num_stages"]) for t in tiles] == [(16, 16, 4, 2),
                                                                                               (32, 32, 8, 3)]
        assert all(t["check"]["ok"] and "graph_us" not in t and "error" not in t for t in tiles)
    assert result["floor"]["hbm_peak_bytes_per_s"] is None and "dry run" in result["floor"]["note"]
    assert all(stage["ok"] for stage in result["stages"].values())
    documented([*result, *result["floor"], *result["results"][0], *result["results"][0]["fusion"],
                *result["correctness"][0], *result["configs_T1"][0]])
    assert (tmp_path / "bench.log").read_text().endswith(
        "6 checks, 0 failed; mega_attention matches of the outside module: T=1: 1, T=3: 1; failed stages: none\n")


def sink_attention_fp64(q, keys, valid, sink, angles, scale):
    """The outside module's function in fp64, written apart from it: the sink as the softmax's last
    column, the pairs read as even and odd elements; q's rotated tail rounded to bf16, as specified."""
    rd = 2 * angles.shape[-1]
    cos, sin = angles.double().cos()[:, None], angles.double().sin()[:, None]

    def rotate(x, sign):  # pairs (2i, 2i + 1) by sign x angle_i
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - sign * odd * sin, sign * even * sin + odd * cos], dim=-1).flatten(-2)

    q = q.double()
    q = torch.cat([q[..., :-rd], rotate(q[..., -rd:], 1).to(torch.bfloat16).double()], dim=-1)
    k = keys.double()
    scores = torch.einsum("thd,tjd->thj", q, k) * scale
    scores = torch.where(valid[:, None, :], scores, float("-inf"))
    column = sink.double()[None, :, None].expand(*scores.shape[:-1], 1)
    p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    o = torch.einsum("thj,tjd->thd", p, k)
    return torch.cat([o[..., :-rd], rotate(o[..., -rd:], -1)], dim=-1)


def test_the_outside_module_is_sink_attention_with_rope_in_and_out():
    heads, head_dim, rope_dim, T, J = 4, 32, 8, 5, 12
    g = torch.Generator().manual_seed(7)
    q = torch.randn(T, heads, head_dim, generator=g).bfloat16()
    keys = torch.randn(T, J, head_dim, generator=g).bfloat16()
    valid = torch.rand(T, J, generator=g) < 0.6
    valid[0] = False  # no valid key: exactly 0
    angles = torch.rand(T, rope_dim // 2, generator=g) * 100
    module = OutsideAttention(heads, head_dim, rope_dim)
    with torch.no_grad():
        module.sink.copy_(torch.randn(heads, generator=g) * 2)
        out = module(q, keys, valid, angles)
    ref = sink_attention_fp64(q, keys, valid, module.sink.detach(), angles, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (T, heads, head_dim)
    assert not out[0].any() and not ref[0].any()
    # rounded to bf16 from fp32: half a bf16 step of each value (2^-8 relative), and fp32's roundings
    allowed = 2.0 ** -8 * ref.abs() + 2.0 ** -16 * ref.abs().max()
    assert bool(((out.double() - ref).abs() <= allowed).all()), float((out.double() - ref).abs().max())
    assert ref[1:].abs().max() > 0.1  # a function of the inputs, not zeros
    # and the chain the kernel is checked against (the model's functions) is the same function
    inputs = (q, keys, valid, module.sink.detach(), angles)
    spec = ma.AttentionSpec(heads, head_dim, rope_dim, head_dim ** -0.5, "bfloat16", "bfloat16", False, q_rope=True)
    assert torch.equal(ma.reference(*inputs, spec), out)


def test_the_outside_module_fuses_in_the_gpus_graph_forms():
    # torch 2.11's CUDA graph forms (the batch-one bmm as an mm, shape padding, the online softmax) on
    # the CPU: the forms the GPU's headline numbers depend on
    run = run_python(
        "import json, torch\n"
        "from torch._inductor import config\n"
        "from tests.passes.cuda_forms import TORCH_2_11_FORMS\n"
        "from tests.passes.post_grad import fuse\n"
        "from megafuse.tools import bench_attention as ba\n"
        "found = {}\n"
        "for T in (1, 3):\n"
        "    inputs = ba.make_inputs(ba.TOY, T, 20, 'cpu', seed=T)\n"
        "    module, args = ba.outside_module(ba.TOY, inputs[3]), inputs[:3] + inputs[4:]\n"
        "    with torch.no_grad(), config.patch(TORCH_2_11_FORMS):\n"
        "        fused = fuse(module, ['mega_attention'], fullgraph=True)\n"
        "        out = fused(*args)  # compiles\n"
        "        found[T] = [fused.report.counts(), ba.rel_err(out, module(*args))]\n"
        "print(json.dumps(found))\n")
    for counts, rel in json.loads(run.stdout.splitlines()[-1]).values():
        assert counts == {"mega_attention": 1} and rel <= 1e-2


def test_a_timed_row_sets_each_ratio_beside_its_target():
    # the GPU path on the CPU with made-up times: 10 us fused, 40 compile, 50 eager, 60 the kernel
    run = run_python(
        "import json\n"
        "from megafuse.tools import bench_attention as ba\n"
        "times = iter([10.0, 40.0, 50.0, 60.0])\n"
        "ba.time_graph_us = lambda fn: (fn(), next(times))[1]\n"
        "row = ba.bench_T(ba.TOY, 20, 64, 'cpu', lambda msg: None, 3.35e12)\n"
        "print(json.dumps({'row': row, 'table': ba.table([row])}))\n")
    got = json.loads(run.stdout.splitlines()[-1])
    row = got["row"]
    assert row["fusion"]["matched"] == 1
    assert (row["fused_graph_us"], row["compile_graph_us"], row["eager_graph_us"], row["kernel_graph_us"]) == (10, 40, 50, 60)
    assert row["speedup_vs_compile"] == 4.0 and row["speedup_vs_eager"] == 5.0
    assert row["floor_mem_us"] == bench_attention.attention_bytes(bench_attention.TOY, 64, 20) / 3.35e12 * 1e6
    assert row["x_of_practical_floor"] == 10.0 / 4.0  # the toy's floor is below the launch floor
    assert row["target_vs_compile"] == 3.0 and row["meets_vs_compile"] is True
    assert row["target_x_floor"] is None and row["meets_x_floor"] is None
    assert row["config"] == {"block_h": 4, "block_j": 16, "splits": 1, "keys_per_split": 32, "num_warps": 4,
                             "num_stages": 2}
    documented(row)
    header, line = got["table"]
    assert header.split()[:6] == ["T", "fused", "compile", "eager", "kernel", "floor"]
    assert line.split()[:7] == ["64", "10.00", "40.00", "50.00", "60.00", "0.07", "4.00"] and "!" not in line


def test_the_targets_are_the_issues_acceptance():
    assert [bench_attention.target_vs_compile(T) for T in (1, 16, 64, 128, 512, 4096)] == [1.0, None, 3.0, 3.0, 3.0, 3.0]
    assert bench_attention.TARGET_X_FLOOR == {512: 2.0, 4096: 2.0}
    assert bench_attention.TOKENS == (1, 16, 64, 128, 512, 4096)


def test_the_roofline_counts_keys_q_out_and_mask_over_the_devices_peak():
    spec = bench_attention.V4
    assert bench_attention.attention_bytes(spec, 1, 640) == 640 * 512 * 2 + 2 * 64 * 512 * 2 + 640
    assert bench_attention.attention_flops(spec, 2, 640) == 4 * 2 * 64 * 640 * 512
    h100 = peak_hbm_bytes_per_s("NVIDIA H100 80GB HBM3")
    floor = bench_attention.floor_of(spec, 4096, 640, h100)
    assert floor["floor_mem_us"] == bench_attention.attention_bytes(spec, 4096, 640) / 3.35e12 * 1e6
    assert floor["floor_us"] == max(floor["floor_mem_us"], floor["floor_flop_us"])
    assert bench_attention.floor_of(spec, 1, 640, None)["floor_us"] is None  # a device with no known bandwidth
    assert bench_attention.hbm_floor("NVIDIA H200")["hbm_peak_bytes_per_s"] == 4.8e12
    unknown = bench_attention.hbm_floor("NVIDIA A100-SXM4-80GB")
    assert unknown["hbm_peak_bytes_per_s"] is None and "A100" in unknown["note"]


def test_a_wrong_kernel_fails_the_check(monkeypatch):
    inputs = bench_attention.make_inputs(bench_attention.TOY, 3, 20, "cpu", seed=0)
    monkeypatch.setattr(ma, "mega_attention", lambda *a, **k: ma.reference(*a[:6]) * 1.1)
    assert not bench_attention.check(bench_attention.TOY, inputs)["ok"]


def test_configs_are_tiles_at_choose_configs_split():
    tiles = launch_tiles("16x32x4x2, 64X32x8x3")
    assert tiles == (Tiles(16, 32, 4, 2), Tiles(64, 32, 8, 3))
    base = ma.choose_config(bench_attention.V4, 1, bench_attention.KEYS)
    config = tiles[1].config(base)
    assert config == ma.LaunchConfig(64, 32, base.splits, base.keys_per_split, num_warps=8, num_stages=3)


@pytest.mark.parametrize("text", ["16x32x4", "16x32x4x2x1", "16x32x4x2,", "axbxcxd", "24x32x4x2", "16x8x4x2",
                                  "16x32x3x2", "16x32x4x0", "16-32-4-2", ""])
def test_a_bad_configs_string_is_a_usage_error_naming_the_form(text, capsys):
    with pytest.raises(SystemExit) as e:
        bench_attention.main(["--dry-run", "--configs", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --configs: expected comma-separated BLOCK_HxBLOCK_JxNUM_WARPSxNUM_STAGES, e.g. " \
           "16x32x4x2,64x32x8x2" in err and repr(text) in err


@pytest.mark.parametrize("argv", [["--dry-run", "--tokens", "0"], ["--dry-run", "--splits", "x"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        bench_attention.main(argv)
    assert e.value.code == 2
