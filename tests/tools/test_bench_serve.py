"""`megafuse bench-serve` on tiny: every configuration serves the whole workload, its JSON and plot."""

import json

from megafuse.tools import bench_serve
from megafuse.tools.cli import main


def test_bench_serve_runs_each_configuration_over_the_whole_workload(tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["bench-serve", "--config", "tiny", "--sessions", "2", "--turns", "2", "--system-prompt", "24",
            "--context-cap", "20", "--tool-result", "4", "8", "--output-cap", "2", "--slots", "2", "--page-size", "8",
            "--configs", "no-prefix-cache,bounded-replay", "--eager", "--prefill-probe", "40", "--json", str(out), "--png", str(png)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == "megafuse.bench_serve/2" and list(r["configurations"]) == ["no-prefix-cache", "bounded-replay"]
    assert r["step"] == {"mode": "eager", "buckets": None} and r["steps"] == {}
    probe = r["prefill_probe"]  # 40 tokens under a 4096-row budget: one step each way
    assert probe["tokens"] == 40 and probe["steps"] == 1 and probe["trim_ttft_s"] > 0 and probe["no_trim_ttft_s"] > 0
    assert probe["trim_speedup"] == probe["no_trim_ttft_s"] / probe["trim_ttft_s"]
    for key in ("workload", "cache", "ttft_s", "tpot_s", "tokens_per_s_per_gpu", "prefix_hit_rate", "makespan_s"):
        assert key in bench_serve.__doc__, key
    for name, c in r["configurations"].items():
        assert c["requests"] == 4 and c["output_tokens"] == 8 and len(c["ttft_all_s"]) == 4
        assert 0 < c["ttft_s"]["p50"] <= c["ttft_s"]["p90"] <= c["ttft_s"]["p99"]
    plain, bounded = r["configurations"]["no-prefix-cache"]["stats"], r["configurations"]["bounded-replay"]["stats"]
    assert plain["prefix_hits"] == 0 and bounded["prefix_hits"] >= 2  # second turns and the shared system prompt
    assert bounded["replayed_tokens"] == bounded["prefix_hits"] * 8  # W = 8 per hit
    assert png.stat().st_size > 10_000
    assert "bounded-replay" in capsys.readouterr().out


def test_bench_serve_names_an_unknown_configuration(capsys):
    assert main(["bench-serve", "--config", "tiny", "--configs", "fast"]) == 2
    assert ("valid: no-prefix-cache, exact-replay, bounded-replay, bounded-no-trim, bounded-no-graphs, "
            "bounded-no-passes") in capsys.readouterr().err
    assert main(["bench-serve", "--config", "tiny", "--configs", "bounded-replay,bounded-no-graphs", "--eager"]) == 2
    assert "--eager runs the step uncompiled; bounded-no-graphs compare compiled steps" in capsys.readouterr().err
