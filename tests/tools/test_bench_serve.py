"""`megafuse bench-serve` on tiny: every configuration serves the whole workload, its JSON and plot;
what --eager runs; every example of --help."""

import json
import shlex

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megafuse.tools import bench_serve
from megafuse.tools.cli import build_parser, main
from tests.tools.schemas import documented_schema

# the configurations whose engine flags need no compiled step (no cuda_graphs, no passes)
EAGER = ["no-prefix-cache", "exact-replay", "bounded-replay", "bounded-no-trim"]
# one session of one 8-token turn: the cheapest workload that serves every configuration
ONE_TURN = ["--scale", "small", "--sessions", "1", "--turns", "1", "--system-prompt", "0", "--context", "8", "8",
            "--output-cap", "2", "--slots", "1", "--page-size", "8"]


def test_bench_serve_runs_each_configuration_over_the_whole_workload(tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["bench-serve", "--config", "tiny", "--sessions", "2", "--turns", "2", "--system-prompt", "24",
            "--context", "20", "20", "--tool-result", "4", "8", "--output-cap", "2", "--slots", "2", "--page-size", "8",
            "--configs", "no-prefix-cache,bounded-replay", "--eager", "--prefill-probe", "40", "--json", str(out), "--png", str(png)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["schema"] == "megafuse.bench_serve/4" and list(r["configurations"]) == ["no-prefix-cache", "bounded-replay"]
    assert r["workload"]["scale"] == "full" and r["workload"]["context"] == [20, 20] and r["workload"]["output_cap"] == 2
    assert r["step"] == {"mode": "eager", "buckets": None} and r["steps"] == {}
    probe = r["prefill_probe"]  # 40 tokens under a 4096-row budget: one step each way
    assert probe["tokens"] == 40 and probe["steps"] == 1 and probe["trim_ttft_s"] > 0 and probe["no_trim_ttft_s"] > 0
    assert probe["trim_speedup"] == probe["no_trim_ttft_s"] / probe["trim_ttft_s"]
    for key in ("workload", "cache", "ttft_s", "tpot_s", "tokens_per_s_per_gpu", "prefix_hit_rate", "makespan_s"):
        assert key in documented_schema("megafuse.bench_serve/4"), key
    for name, c in r["configurations"].items():
        assert c["requests"] == 4 and c["output_tokens"] == 8 and len(c["ttft_all_s"]) == 4
        assert 0 < c["ttft_s"]["p50"] <= c["ttft_s"]["p90"] <= c["ttft_s"]["p99"]
    plain, bounded = r["configurations"]["no-prefix-cache"]["stats"], r["configurations"]["bounded-replay"]["stats"]
    assert plain["prefix_hits"] == 0 and bounded["prefix_hits"] >= 2  # second turns and the shared system prompt
    assert bounded["replayed_tokens"] == bounded["prefix_hits"] * 8  # W = 8 per hit
    assert png.stat().st_size > 10_000
    assert "bounded-replay" in capsys.readouterr().out


def test_eager_serves_every_configuration_that_runs_uncompiled_and_names_those_left_out(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main(["bench-serve", "--config", "tiny", "--eager", *ONE_TURN, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["configurations"]) == EAGER and bench_serve.eager_configurations() == EAGER
    assert all(c["requests"] == 1 and c["output_tokens"] == 2 for c in r["configurations"].values())
    left_out = [line for line in capsys.readouterr().err.splitlines() if "left out" in line]
    assert left_out == ["megafuse bench-serve: --eager runs the step uncompiled, so bounded-no-graphs, "
                        "bounded-no-passes (they compare compiled steps) are left out"]


def test_bench_serve_names_an_unknown_configuration_and_one_eager_cannot_run(capsys):
    assert main(["bench-serve", "--config", "tiny", "--configs", "fast"]) == 2
    assert ("valid: no-prefix-cache, exact-replay, bounded-replay, bounded-no-trim, bounded-no-graphs, "
            "bounded-no-passes") in capsys.readouterr().err
    assert main(["bench-serve", "--config", "tiny", "--configs", "bounded-replay,bounded-no-graphs", "--eager"]) == 2
    assert ("--eager runs the step uncompiled, but bounded-no-graphs compare compiled steps; valid with --eager: "
            f"{', '.join(EAGER)}") in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # replaced by --scale and --context
        main(["bench-serve", "--config", "tiny", "--context-cap", "200"])
    assert usage.value.code == 2 and "unrecognized arguments: --context-cap 200" in capsys.readouterr().err


def test_quality_is_zero_where_bounded_replay_replays_the_whole_hit_and_not_past_l_times_w(tmp_path):
    """tiny: W = 8, L x W = 96. A 16-token context caches 2 pages of 8, a hit of 16 (the last token
    runs): bounded replay recomputes 8 of them. A 8-token context is a 8-token hit, all replayed
    either way, so bounded replay is exact replay there; at 128 tokens it drops what exact replay keeps."""
    out = tmp_path / "serve.json"
    argv = ["bench-serve", "--config", "tiny", "--eager", *ONE_TURN, "--configs", "exact-replay,bounded-no-trim",
            "--quality-contexts", "128,8", "--json", str(out)]
    assert main(argv) == 0
    q = json.loads(out.read_text())["quality"]
    assert q["reference"] == "exact-replay" and q["contexts"] == [8, 128] and (q["suffix"], q["tokens"]) == (8, 8)
    assert "quality" in documented_schema("megafuse.bench_serve/4")
    same, longer = q["by_context"]["8"]["bounded-no-trim"], q["by_context"]["128"]["bounded-no-trim"]
    assert same == {"positions": 8, "kl_mean": 0.0, "kl_max": 0.0, "top1": 1.0}
    assert 1 <= longer["positions"] <= 8 and longer["kl_max"] >= longer["kl_mean"] > 1e-7


def test_quality_distance_is_the_kl_of_the_next_token_distributions_while_the_inputs_agree():
    g = torch.Generator().manual_seed(0)
    exact_logits, other_logits = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    other_logits[1] = exact_logits[1] * 3  # the same argmax, another distribution
    exact = SimpleNamespace(logits=list(exact_logits), output=[3, 1, 4, 1])
    # outputs 0 and 1 agree, so positions 0-2 saw the same inputs; position 3 saw another token
    other = SimpleNamespace(logits=list(other_logits), output=[3, 1, 5, 9])
    d = bench_serve._distance(exact, other)
    kls = [F.kl_div(o.log_softmax(-1), e.log_softmax(-1), log_target=True, reduction="sum").item()
           for e, o in zip(exact_logits[:3], other_logits[:3])]
    assert d["positions"] == 3
    assert d["kl_mean"] == pytest.approx(sum(kls) / 3, rel=1e-5) and d["kl_max"] == pytest.approx(max(kls), rel=1e-5)
    assert d["top1"] == sum(int(e.argmax() == o.argmax()) for e, o in zip(exact_logits[:3], other_logits[:3])) / 3
    assert d["top1"] >= 1 / 3  # position 1 agrees by construction


def test_quality_contexts_need_exact_replay_and_another_configuration(capsys):
    assert main(["bench-serve", "--config", "tiny", "--eager", "--configs", "bounded-replay",
                 "--quality-contexts", "64"]) == 2
    assert "--quality-contexts compares configurations with exact-replay" in capsys.readouterr().err


def _examples() -> list[list[str]]:
    lines = [line.strip() for line in bench_serve.EXAMPLES.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("megafuse ")]


@pytest.mark.slow
def test_every_example_in_the_help_runs_as_written(tmp_path, monkeypatch, capsys):
    """Each example parses; those on the CPU (tiny, the small scale, eager) serve to the end, and a
    larger model's example names --device cuda (not run here)."""
    examples = _examples()
    assert len(examples) == 3 and all(argv[0] == "bench-serve" for argv in examples)
    parser = build_parser(["bench-serve"])
    monkeypatch.chdir(tmp_path)  # where the examples' --json and --png land
    ran = 0
    for argv in examples:
        args = parser.parse_args(argv)
        if args.config != "tiny":
            assert args.device == "cuda", argv
            continue
        assert (args.device, args.scale, args.eager) == ("cpu", "small", True), argv
        assert main(argv) == 0, argv
        ran += 1
        if args.json:
            r = json.loads((tmp_path / args.json).read_text())
            assert list(r["configurations"]) == (args.configs.split(",") if args.configs else EAGER)
            assert all(c["requests"] == 2 * args.sessions for c in r["configurations"].values())  # 2 turns each
            assert (tmp_path / args.png).stat().st_size > 10_000
        capsys.readouterr()
    assert ran == 2
