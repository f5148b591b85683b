"""`megafuse run` on tiny's roles at 5 layers: the JSON schema, counts equal to the pass report, the
comparison with eager over the prompt and every decode step, and an exit status that follows
--tolerance."""

import json
import re

import pytest

from megafuse import passes
from megafuse.runtime.graphs import CompiledStep
from megafuse.tools import run
from megafuse.tools.cli import main
from tests.tools.schemas import documented_schema
from tests.passes.tiny import step_counts
from tests.test_readme import make_run_sample
RUN_KEYS = {"schema", "config", "dtype", "quant", "device", "batch", "prompt_len", "decode_steps", "seed",
            "seq_len", "passes", "parameters", "cache", "graph", "counts", "report", "comparison", "timing", "generated",
            "exit_status", "environment"}
METRIC_KEYS = {"positions", "max_abs", "cosine_min", "cosine_mean", "top1_agreement", "finite"}
TIMING_KEYS = {"ttft_s", "step_s", "per_token_s", "tokens_per_s"}

# One worker, in order: the first test compiles tiny's kinds of layer, the others find them in
# Inductor's cache (a worker compiling them at the same time would compile them again).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("run_tool")]


def test_run_compares_prompt_and_every_decode_step_with_eager(tmp_path, tiny, tiny_config, capsys):
    out = tmp_path / "run.json"
    assert main(["run", "--config", tiny_config, "--prompt-len", "6", "--decode", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r) == RUN_KEYS and r["schema"] == "megafuse.run/2"
    for key in RUN_KEYS | METRIC_KEYS | TIMING_KEYS:  # the schema is the one documented
        assert key in documented_schema("megafuse.run/2"), key
    assert (r["config"], r["batch"], r["prompt_len"], r["decode_steps"], r["seq_len"]) == ("tiny", 1, 6, 2, 8)
    assert r["passes"] == passes.available()
    graph = r["graph"]
    assert graph["buckets"] == {"prefill": [6, 6], "decode": [1, 1]} and graph["compile_s"] > 0
    # one graph per kind of layer, each serving both buckets: the 5 layers are 5 kinds, and the head
    assert graph["graphs_compiled"] == 6
    assert sorted(graph["graph_blocks"]) == [["Transformer"]] + [[f"layers.{i}"] for i in range(5)]

    # the counts are per step: the layers' seams, gates and attentions and the head's collapse
    # (`step_counts`, which the README's sample of tiny's 12 layers follows too)
    encoder, decoder = step_counts(tiny.cfg)
    assert (encoder, decoder) == ({"mega_mhc": 6, "mega_gate": 3, "mega_attention": 3, "mega_moe": 3, "mega_indexer": 2},
                                  {"mega_mhc": 5, "mega_gate": 2, "mega_attention": 2, "mega_moe": 2, "mega_indexer": 1})
    assert r["counts"] == r["report"]["counts"] == {name: encoder[name] + decoder[name] for name in r["counts"]}
    for name, count in r["counts"].items():  # one match per graph, each graph run by one layer here
        assert len(r["report"]["per_pass"][name]["matches"]) == count

    comparison = r["comparison"]
    assert set(comparison) == {"prompt", "steps", "overall", "tolerance", "passed"}
    assert set(comparison["prompt"]) == METRIC_KEYS and comparison["prompt"]["positions"] == 6
    assert [s["step"] for s in comparison["steps"]] == [1, 2]
    for s in comparison["steps"]:
        assert set(s) == METRIC_KEYS | {"step", "eager_token", "compiled_token"} and s["positions"] == 1
    overall = comparison["overall"]
    assert overall["positions"] == 8 and overall["finite"]
    # tiny is quant="ref": the kernels' last-bit differences may flip an MXFP8 rounding, a grid step
    # that moves tiny's logits by up to ~0.2 (docs/mega_attention.md "Rounding flips"); the fused
    # step's exact agreement is tests/runtime/test_compiled_engine.py's, at quant="none"
    assert comparison["tolerance"] == run.DEFAULT_TOLERANCE["float32", "ref"] == 0.5
    assert overall["max_abs"] <= 0.5 and overall["cosine_min"] > 0.99 and overall["top1_agreement"] == 1.0
    assert comparison["passed"] and r["exit_status"] == 0

    # eager's greedy tokens drive both models; the compiled model's choices agree
    eager, compiled = r["generated"]["eager"], r["generated"]["compiled"]
    assert len(eager) == 1 and len(eager[0]) == 3 and eager == compiled
    assert [s["eager_token"][0] for s in comparison["steps"]] == eager[0][1:]

    timing = r["timing"]
    assert timing["indicative"] and "indicative" in timing["method"]
    for side in ("eager", "compiled"):
        assert TIMING_KEYS <= set(timing[side]) and len(timing[side]["step_s"]) == 2
        assert timing[side]["ttft_s"] > 0 and timing[side]["tokens_per_s"] > 0
    captured = capsys.readouterr()
    printed = captured.out + captured.err  # results on stdout, progress ("compiling ...") on stderr
    for words in ("megafuse passes", "compiled vs eager logits", "step 2", "TTFT", "PASS", "compiling each kind of layer"):
        assert words in printed
    # the README's sample of `make run` (the same tool on tiny's 12 layers): the form of its verdict line
    verdict = r"PASS: max \|logits error\| \S+ <= tolerance \S+; top-1 agreement 100\.0% over \d+ positions; exit status 0"
    assert re.search(verdict, make_run_sample()) and re.search(verdict, " ".join(captured.out.split()))  # (wrapped or not)
    for name in passes.available():
        assert re.search(rf"│ {name}\s+│ {r['counts'][name]}\s+│ 0\s+│", captured.out), name


def _logit_bound(model) -> float:
    """The largest |logit| any evaluation of the model's head can give, from its weights alone: the
    head is y @ W^T with y = rms_normalize(x) * g, and rms_normalize leaves a row of mean square at
    most 1, so ||y|| <= sqrt(dim) max|g| and |logit_v| <= ||W_v|| sqrt(dim) max|g| (Cauchy-Schwarz),
    whatever the layers before it computed."""
    rows = model.head.weight.double().norm(dim=1)
    return (rows.max() * model.cfg.dim ** 0.5 * model.norm.weight.double().abs().max()).item()


def _shifted(offset: float):
    """The runtime's compiled step with every logit it returns moved by `offset`."""
    class ShiftedStep(CompiledStep):
        def run(self, batch, cache):
            return super().run(batch, cache) + offset
    return ShiftedStep


def test_run_exit_status_follows_the_tolerance(tiny, tiny_config, capsys, monkeypatch):
    # The compiled step's logits are moved by a known offset. Eager's and the compiled step's own
    # logits both lie within +-bound (`_logit_bound`, from the weights), so the max |error| the tool
    # measures is offset +- 2 bound, whatever the kernels' rounding did: with offset = 8 bound it
    # exceeds offset / 2 (exit 1) and stays under 2 offset (exit 0). The graphs compiled above, from
    # Inductor's cache; prompt 6, no decode.
    bound = _logit_bound(tiny)
    offset = 8 * bound
    monkeypatch.setattr(run, "CompiledStep", _shifted(offset))
    for tolerance, status in ((offset / 2, 1), (2 * offset, 0)):
        argv = ["run", "--config", tiny_config, "--prompt-len", "6", "--decode", "0", "--tolerance", repr(tolerance)]
        assert main([*argv, "--json", "-"]) == status
        captured = capsys.readouterr()
        r = json.loads(captured.out)  # JSON alone on stdout, the tables went to stderr
        assert r["exit_status"] == status and r["comparison"]["passed"] is (status == 0)
        assert r["comparison"]["tolerance"] == tolerance
        assert offset - 2 * bound <= r["comparison"]["overall"]["max_abs"] <= offset + 2 * bound
        assert ("PASS" if status == 0 else "FAIL") in captured.err
    assert r["comparison"]["steps"] == [] and r["timing"]["compiled"]["per_token_s"] is None


def test_run_takes_a_config_json_or_a_checkpoint_directory(tmp_path, tiny, capsys):
    from megafuse.model.checkpoint import save_checkpoint

    (tmp_path / "tiny.json").write_text(json.dumps(tiny.cfg.to_dict()))
    checkpoint = save_checkpoint(tiny, tmp_path / "checkpoint")
    for source in (tmp_path / "tiny.json", checkpoint):
        assert main(["run", "--config", str(source), "--prompt-len", "6", "--decode", "0", "--json", "-"]) == 0
        r = json.loads(capsys.readouterr().out)
        assert r["config"] == "tiny" and r["comparison"]["passed"]
        encoder, decoder = step_counts(tiny.cfg)
        assert r["counts"] == {name: encoder[name] + decoder[name] for name in r["counts"]}
    # the second run (the checkpoint, same kinds of layer) compiled nothing: a warm start
    assert r["graph"]["graphs_from_cache"] == r["graph"]["graphs_compiled"] == 6
