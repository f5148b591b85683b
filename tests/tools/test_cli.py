"""The `megafuse` command line: info and run on real configs, JSON schemas, clear errors."""

import json

import pytest

from tools.cli import main


def test_info_flash_json(capsys):
    assert main(["info", "--config", "flash", "--json", "-"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["global_kv_bytes_per_token"] == 890
    assert abs(facts["parameters"]["backbone"] / 552e9 - 1) < 1e-3
    assert facts["parameters"]["engram_tables"] > 0
    assert [r["role"] for r in facts["roles"]][:3] == ["swa", "swa", "full"]
    assert len(facts["roles"]) == 40


def test_run_tiny_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["run", "--config", "tiny", "--prompt-len", "6", "--decode", "3", "--batch", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"] == "tiny" and result["decode_steps"] == 3
    assert len(result["generated"]) == 2 and len(result["generated"][0]) == 4  # first token + 3 steps
    assert result["first_logits"]["finite"] and result["first_logits"]["std"] > 0.1
    assert result["parameters"]["total"] == 13_669_176
    for key in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "environment"):
        assert key in result
    assert "TTFT" in capsys.readouterr().out


def test_unknown_preset_is_an_error_listing_the_presets(capsys):
    assert main(["info", "--config", "huge"]) == 2
    assert "tiny, proxy, flash" in capsys.readouterr().out


def test_unknown_flag_and_choice_are_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", "tiny", "--quant", "fp8"])
    assert e.value.code == 2
    assert "'ref', 'none'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--config", "tiny", "--nope"])


def test_help_has_examples(capsys):
    for tool in ("info", "run"):
        with pytest.raises(SystemExit):
            main([tool, "--help"])
        assert "examples:" in capsys.readouterr().out
