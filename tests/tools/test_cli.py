"""The `megafuse` command line: info on real configs, help with examples, usage errors that name the
valid choices (exit status 2), pass flags generated from the registry. Nothing here compiles."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megafuse import passes
from megafuse.passes import registry
from megafuse.tools import ablate, common
from megafuse.tools.cli import TOOLS, build_parser, main

COMPILE_TOOLS = ("run", "ablate", "inspect")


def test_info_flash_json(capsys):
    assert main(["info", "--config", "flash", "--json", "-"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["global_kv_bytes_per_token"] == 890
    assert abs(facts["parameters"]["backbone"] / 552e9 - 1) < 1e-3
    assert facts["parameters"]["engram_tables"] > 0
    assert [r["role"] for r in facts["roles"]][:3] == ["swa", "swa", "full"]
    assert len(facts["roles"]) == 40


@pytest.mark.parametrize("tool", list(TOOLS))
def test_help_has_examples(tool, capsys):
    with pytest.raises(SystemExit) as e:
        main([tool, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"megafuse {tool} --config" in out


@pytest.mark.parametrize("tool", ["info", *COMPILE_TOOLS])
def test_unknown_preset_is_an_error_listing_the_presets(tool, capsys):
    assert main([tool, "--config", "huge"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"megafuse {tool}: error: ") and "tiny, proxy, flash" in captured.err
    assert captured.out == ""  # stdout stays the results' (--json - | jq)


@pytest.mark.parametrize("tool", COMPILE_TOOLS)
def test_unknown_pass_is_an_error_listing_the_passes(tool, capsys):
    with pytest.raises(SystemExit) as e:
        main([tool, "--config", "tiny", "--passes", "mega_gate,nope"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown pass 'nope'" in err and f"valid passes: {', '.join(passes.available())}" in err


@pytest.mark.parametrize("tool", COMPILE_TOOLS)
def test_unknown_flag_is_an_error_listing_the_options(tool, capsys):
    with pytest.raises(SystemExit) as e:  # a near miss is not taken as an abbreviation
        main([tool, "--config", "tiny", "--no-mega-gat"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-mega-gat" in err
    assert "did you mean --no-mega-gate" in err and "valid options:" in err and "--passes" in err


def test_bad_choice_lists_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", "tiny", "--quant", "fp8"])
    assert e.value.code == 2
    assert "'ref', 'none'" in capsys.readouterr().err


def test_usage_errors_found_after_parsing_exit_2(capsys):
    assert main(["inspect", "--config", "tiny", "--layer", "12"]) == 2
    assert "layers 0..11" in capsys.readouterr().err


@pytest.mark.parametrize("argv, enabled", [
    ([], ["mega_mhc", "mega_gate", "mega_attention", "mega_moe", "mega_indexer"]),
    (["--passes", "none"], []),
    (["--passes", "mega_gate"], ["mega_gate"]),
    (["--no-mega-gate"], ["mega_mhc", "mega_attention", "mega_moe", "mega_indexer"]),
    (["--no-mega_mhc", "--no-mega-gate", "--no-mega-moe", "--no-mega-indexer"], ["mega_attention"]),
    (["--passes", "mega_gate,mega_mhc", "--no-mega-mhc"], ["mega_gate"]),
])
def test_pass_selection(argv, enabled):
    for tool in COMPILE_TOOLS:
        args = build_parser().parse_args([tool, "--config", "tiny", *argv])
        assert common.selected_passes(args) == enabled


def test_pass_flags_follow_the_registry(monkeypatch):
    """A newly registered pass gets its --no-<pass> flag in every tool with no change to the tools."""
    class NewPass(passes.registry.get("mega_gate")):
        name = "new_pass"
        description = "a pass registered after the tools were written"
        run_order = 10_000

    monkeypatch.setitem(registry._PASSES, "new_pass", NewPass)
    for tool in COMPILE_TOOLS:
        args = build_parser().parse_args([tool, "--config", "tiny", "--no-new-pass"])
        assert common.selected_passes(args) == ["mega_mhc", "mega_gate", "mega_attention", "mega_moe", "mega_indexer"]
        args = build_parser().parse_args([tool, "--config", "tiny", "--passes", "new_pass"])
        assert common.selected_passes(args) == ["new_pass"]


def _meaning(name, swept):
    if name in ("none", "all"):
        return [] if name == "none" else swept
    if name.startswith("only "):
        return [name.removeprefix("only ")]
    return [p for p in swept if p != name.removeprefix("all but ")]


@pytest.mark.parametrize("swept, rows", [([], 1), (["a"], 2), (["a", "b"], 4), (["a", "b", "c"], 8)])
def test_ablation_configurations_are_deduplicated_by_pass_set(swept, rows):
    configs = ablate.configurations(swept)
    assert len(configs) == rows
    assert len({frozenset(c["passes"]) for c in configs}) == rows
    names = [n for c in configs for n in c["names"]]
    expected = ["none", *(f"only {p}" for p in swept), *(f"all but {p}" for p in swept), "all"]
    assert sorted(names) == sorted(set(expected))  # every configuration, each in exactly one row
    for c in configs:
        for n in c["names"]:
            assert set(_meaning(n, swept)) == set(c["passes"]), n
    if swept == ["a", "b"]:
        assert [c["names"] for c in configs] == [["none"], ["only a", "all but b"], ["only b", "all but a"], ["all"]]


def test_an_internal_error_exits_3_with_one_line_and_the_traceback_on_request(monkeypatch, capsys):
    from megafuse.tools import info

    def broken(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(info, "main", broken)
    assert main(["info", "--config", "tiny"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("megafuse info: internal error: RuntimeError: boom\n") and "Traceback" not in err
    monkeypatch.setenv("MEGAFUSE_TRACEBACK", "1")
    assert main(["info", "--config", "tiny"]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_help_and_an_unknown_tool_answer_without_importing_torch(tmp_path):
    # a fresh interpreter: `megafuse --help` and `megafuse nosuch` must not import torch (seconds on
    # a small machine)
    code = ("import sys, contextlib, io\nfrom megafuse.tools.cli import main\n"
            "for argv in (['--help'], ['nosuch']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), "
            "contextlib.redirect_stderr(io.StringIO()):\n        main(argv)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("argv, message", [
    (["--prompt-len", "1100000"], "megafuse run: error: --batch 1 x 1100008 positions (--prompt-len 1100000 + "
                                  "--decode 8): 1100008 positions exceed tiny's maximum of 1048576 "
                                  "(yarn_original_max_pos 65536 x yarn_factor 16)\n"),
    (["--batch", "100000000"], "megafuse run: error: --batch 100000000 x 16 positions (--prompt-len 8 + --decode 8) "
                               "needs at least "),
])
def test_a_request_that_cannot_fit_is_refused_up_front_with_the_limit(argv, message, capsys):
    assert main(["run", "--config", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_profiling_keeps_libkineto_start_stop_lines_off_stderr(capfd):
    from torch.profiler import ProfilerActivity

    with common.profiling([ProfilerActivity.CPU]) as prof:
        torch.ones(4).sum()
        os.write(2, b"a line of our own\n")  # anything else written to fd 2 still reaches stderr
    err = capfd.readouterr().err
    assert err == "a line of our own\n"
    assert any(e.name == "aten::sum" for e in prof.events())
