"""`megafuse generate`: the engine's tokens for token-id prompts, its stats, named errors."""

import json

import torch

from megafuse.model import build_model, preset
from megafuse.tools.cli import main
from tests.tools.schemas import documented_schema


def test_generate_in_exact_mode_returns_the_plain_models_greedy_tokens(tmp_path, capsys):
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    argv = ["generate", "--config", "tiny", "--quant", "none", "--prompts", str(tmp_path / "prompts.json"),
            "--max-new-tokens", "3", "--no-swa-bounded-replay", "--no-trim", "--eager", "--json", "-"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["schema"] == "megafuse.generate/3"
    for key in ("engine", "sampling", "requests", "stats", "environment", "output_tokens_per_s", "evictions"):
        assert key in documented_schema("megafuse.generate/3") and key in json.dumps(r), key
    model = build_model(preset("tiny").replace(quant="none"), seed=0)
    for prompt, request in zip(prompts, r["requests"]):
        tokens = list(prompt)
        for _ in range(3):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert request == {"prompt_len": len(prompt), "output": tokens[len(prompt):]}
    assert r["stats"]["steps"] == 3 and not r["engine"]["trim_decoder"]
    assert (r["engine"]["step"], r["engine"]["passes"], r["engine"]["graphs"]) == ("eager", None, None)


def test_generate_names_bad_prompts(capsys):
    assert main(["generate", "--config", "tiny", "--prompt", "1,2,x"]) == 2
    assert "--prompt takes comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--config", "tiny", "--prompt", "1,5000", "--max-new-tokens", "2"]) == 2
    assert "token ids [5000] lie outside 0..1023" in capsys.readouterr().err
    assert main(["generate", "--config", "tiny", "--prompt", "1,", "--prompt", ","]) == 2
    assert "prompt 1 is empty; a request needs at least one token" in capsys.readouterr().err


def test_generate_over_two_ranks_returns_the_one_rank_tokens(capsys):
    argv = ["generate", "--config", "tiny", "--quant", "none", "--batch", "3", "--prompt-len", "20",
            "--max-new-tokens", "3", "--token-budget", "8", "--no-swa-bounded-replay", "--no-trim", "--eager",
            "--json", "-"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(argv + ["--world-size", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["requests"] == one["requests"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert [r["experts"] for r in one["ranks"]] == [[0, 8]]
    assert [(r["experts"], r["requests"]) for r in two["ranks"]] == [([0, 4], [0, 2]), ([4, 8], [1])]
    assert two["stats"]["steps"] == max(r["stats"]["steps"] for r in two["ranks"])
    for key in ("world_size", "ranks"):
        assert key in documented_schema("megafuse.generate/3")


def test_generate_names_bad_world_sizes(capsys):
    assert main(["generate", "--config", "tiny", "--prompt", "1,2", "--world-size", "9", "--eager"]) == 2
    assert "--world-size 9 exceeds the 8 routed experts of tiny" in capsys.readouterr().err
