"""`megafuse inspect` on tiny's roles at 5 layers: index.json's schema, one entry per generated kernel with every match as
a site, sources that import under the Triton interpreter, file:line in the model's own source,
each pass's before/after graphs, one layer on its own, --show."""

import json
from pathlib import Path

from megafuse import passes
from megafuse.lowering.kernel_cache import load_kernel
from megafuse.tools import inspect_kernels
from megafuse.tools.cli import main
from megafuse.tools.common import MODEL_DIR
from tests.tools.schemas import documented_schema

INSPECT_KEYS = {"schema", "config", "dtype", "quant", "device", "target", "batch", "tokens", "seed", "passes",
                "counts", "report", "kernels", "graphs", "environment"}
KERNEL_KEYS = {"name", "pass", "op", "spec", "spec_key", "source", "kernel_attr", "copied_source", "sites",
               "model_sources", "launches_per_forward", "time", "bytes_per_launch", "floor_s", "floor_fraction",
               "floor_note", "triton", "triton_note", "hopper_build"}


def _check_model_sources(kernels):
    for k in kernels:
        assert k["model_sources"]
        for site in k["sites"]:
            assert site["sources"] and set(site["sources"]) <= set(k["model_sources"])
        for entry in k["model_sources"]:
            path, line = entry.rsplit(":", 1)
            path = Path(path)
            assert path.resolve().parent == MODEL_DIR, entry  # model/*.py, the model's own source
            assert 1 <= int(line) <= len(path.read_text().splitlines()), entry


def test_inspect_out_writes_index_sources_and_graphs(tmp_path, cached_compiles, tiny, tiny_config, capsys):
    out = tmp_path / "inspect"
    assert main(["inspect", "--config", tiny_config, "--out", str(out)]) == 0
    index = json.loads((out / "index.json").read_text())
    assert set(index) == INSPECT_KEYS and index["schema"] == "megafuse.inspect/1"
    for key in INSPECT_KEYS | KERNEL_KEYS:  # the schema is the one documented
        assert key in documented_schema("megafuse.inspect/1"), key
    assert index["target"] == "model" and index["passes"] == passes.available()
    report = cached_compiles.report(tiny, passes.available())
    assert index["counts"] == report.counts() == index["report"]["counts"]

    kernels = index["kernels"]
    # every match is a site of exactly one kernel, and a kernel is one (op, spec)
    for name in passes.available():
        nodes = [s["node"] for k in kernels if k["pass"] == name for s in k["sites"]]
        assert sorted(nodes) == sorted(m.node for m in report.matches(name))
    assert len({(k["op"], k["spec_key"]) for k in kernels}) == len(kernels)
    for k in kernels:
        assert set(k) == KERNEL_KEYS
        assert k["op"] == f"megafuse::{k['pass']}" and k["spec_key"] in k["name"]
        assert k["launches_per_forward"] == len(k["sites"]) and k["time"]["per_launch_s"] > 0
        assert k["triton"] is None and "not available on CPU" in k["triton_note"]
        # ... but the kernel is built for the H200 ahead of time, as the GPU would launch it
        build = k["hopper_build"]
        assert build["target"] == "cuda sm_90" and build["registers"] > 0 and build["stack_bytes"] == 0
        assert build["programs"] >= 1 and build["num_warps"] == build["config"]["num_warps"]
        # the copy is the generated source, and it imports (so its @triton.jit functions build)
        # under the Triton interpreter and compiles as Python
        copy = Path(k["copied_source"])
        assert copy.parent == out / "sources" and copy.read_text() == Path(k["source"]).read_text()
        compile(copy.read_text(), str(copy), "exec")
        kernel = load_kernel(copy, k["kernel_attr"], interpret=True)
        assert callable(kernel.__getitem__((1,)))
    _check_model_sources(kernels)

    graphs = out / "graphs"
    assert sorted(index["graphs"]) == sorted(str(p) for p in graphs.glob("*.txt"))
    for name in passes.available():  # the model's forward: Mega-Indexer fuses the step's indexer only
        before = (graphs / f"graph000_{name}_before.txt").read_text()
        after = (graphs / f"graph000_{name}_after.txt").read_text()
        assert f"megafuse.{name}.default" not in before
        assert (f"megafuse.{name}.default" in after) == (name != "mega_indexer"), name
    printed = capsys.readouterr().out
    # (rich wraps at the console's width, which depends on where pytest runs: words at spaces, a
    # path anywhere)
    assert "fused kernels: tiny model on cpu" in " ".join(printed.split())
    assert f"wrote {out / 'index.json'}" in printed.replace("\n", "")


def test_inspect_one_layer_and_show_a_kernel(cached_compiles, tiny_config, capsys):
    # layer 0: the block `megafuse ablate`'s test compiled with every pass (the same cached compile)
    assert main(["inspect", "--config", tiny_config, "--layer", "0", "--show", "mega_gate", "--json", "-"]) == 0
    captured = capsys.readouterr()
    r = json.loads(captured.out)
    assert set(r) == INSPECT_KEYS and r["target"] == "layer 0"
    assert r["counts"]["mega_gate"] == 1  # one MoE per block
    gate = next(k for k in r["kernels"] if k["pass"] == "mega_gate")
    _check_model_sources(r["kernels"])
    assert any(s.rsplit(":", 1)[0].endswith("moe.py") for s in gate["model_sources"])
    assert gate["name"] in captured.err and "@triton.jit" in captured.err  # --show, on stderr beside --json -

    assert main(["inspect", "--config", tiny_config, "--layer", "0", "--show", "nope"]) == 2
    assert "valid kernels: " in (err := capsys.readouterr().err) and gate["name"] in err


def test_device_times_pair_launches_with_their_kernels():
    """CUDA time per launch (the profiler's kernels by name, in start order): the seam kernel of the
    i-th launch; all or nothing when the counts differ."""
    times = {"mega_mhc_kernel": [10.0, 170.0, 11.0, 168.0], "other": [1.0]}
    got = [{}, {}, {}, {}]
    inspect_kernels.pair_device_times(got, times, "mega_mhc_kernel")
    assert [round(l["device_s"] * 1e6, 6) for l in got] == [10.0, 170.0, 11.0, 168.0]
    got = [{}, {}, {}, {}]
    inspect_kernels.pair_device_times(got, {"mega_mhc_kernel": [10.0, 170.0, 11.0]}, "mega_mhc_kernel")  # one missing
    assert not any("device_s" in l for l in got)
