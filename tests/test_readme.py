"""The README's Python blocks run as written, in order, in one namespace (a reader runs them one
after the other), and what they print is what the README says they print; its commands are valid
command lines."""

import contextlib
import importlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def printed_claims(block: str) -> list[str]:
    """`print(...)  # <what it prints> on tiny`: the claims a block makes about its output."""
    return [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s+#\s*(.*?)\s+on tiny\s*$", block, flags=re.M)]


def make_run_sample() -> str:
    """The README's sample output of `make run` (`megafuse run --config tiny --decode 4`)."""
    return README.read_text().split("$ make run", 1)[1].split("```", 1)[0]


def test_the_make_run_sample_has_the_counts_of_tinys_compiled_step():
    # tests/tools/test_run.py checks `step_counts` against a compile of the same tool on 5 layers
    from megafuse import passes
    from megafuse.model import preset
    from tests.passes.tiny import step_counts

    encoder, decoder = step_counts(preset("tiny"))
    for name in passes.available():  # per step: each layer's sites once, whatever graph it ran
        assert re.search(rf"│ {name}\s+│ {encoder[name] + decoder[name]}\s+│ 0\s+│", make_run_sample()), name


def test_the_readme_has_the_blocks_this_test_runs():
    blocks = python_blocks()
    assert len(blocks) == 2, "a Python block was added or removed: run it here too"
    assert printed_claims(blocks[0]) == ["torch.Size([8, 1024]) 24"]
    assert printed_claims(blocks[1]) == ["{'mega_mhc': 25, 'mega_gate': 12, 'mega_attention': 12, 'mega_moe': 12, 'mega_indexer': 0}"]


@pytest.mark.slow  # the second block compiles the whole tiny model
def test_every_python_block_runs_as_written_and_prints_what_the_readme_says():
    torch._dynamo.reset()
    namespace: dict = {}
    for block in python_blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out), torch.enable_grad():  # as a reader runs them (the suite runs under no_grad)
            exec(compile(block, str(README), "exec"), namespace)
        assert out.getvalue().splitlines() == printed_claims(block), block
    # what the blocks' comments say of their results: [1, 32, vocab] logits, one decode step a token
    # (that the steps equal the one-shot forward is tests/model/test_step.py's to check: under
    # tiny's quant="ref" a fake-quant rounding flip moves them apart on some prompts)
    vocab = namespace["cfg"].vocab_size
    assert namespace["logits"].shape == (1, 32, vocab)
    assert [tuple(d.shape) for d in namespace["decoded"]] == [(1, vocab)] * 24
    assert not namespace["logits"].requires_grad  # passes.compile compiles for inference


def readme_commands() -> list[list[str]]:
    """Every `megafuse ...` and `python3 -m megafuse.tools....` command the README shows, as argv
    (placeholders such as DIR stay as written; `megafuse <tool>: ...`, the form of a message, is none)."""
    text = README.read_text()
    found = re.findall(r"`((?:megafuse|python3 -m megafuse\.tools\.\w+)(?: [^`]*)?)`", text)
    commands = [shlex.split(command) for command in dict.fromkeys(found)]
    return [argv for argv in commands if len(argv) > 1 and not argv[1].startswith("<")]


def help_examples() -> list[list[str]]:
    """Every command of every tool's `--help` examples, as argv (comments dropped)."""
    from megafuse.tools.cli import TOOLS

    commands = []
    for module, _ in TOOLS.values():
        for line in importlib.import_module(module).EXAMPLES.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("megafuse "):
                commands.append(shlex.split(line))
    return commands


def runs_here(argv: list[str]) -> str | None:
    """Why a command is only parsed here, not run (None: it runs in this test)."""
    if "cuda" in argv:
        return "needs a GPU"
    if argv[1] in ("run", "ablate", "inspect") or (argv[1] == "generate" and "--eager" not in argv):
        return f"compiles tiny (minutes on a CPU): tests/tools/test_{argv[1]}.py runs the tool on tiny's roles"
    if argv[1] == "bench-serve":
        return "tests/tools/test_bench_serve.py runs each of its examples"
    return None


def test_every_readme_command_is_a_valid_command_line():
    # each command parses with the real CLI (tool names, flags and choices as the README writes
    # them); `info` runs; `megafuse run --config tiny` is what tests/tools/test_run.py runs and
    # checks against the README's sample output
    from megafuse.tools.cli import build_parser, main

    commands = readme_commands()
    tools = {argv[1] for argv in commands if argv[0] == "megafuse" and not argv[1].startswith("-")}
    assert tools >= {"info", "run", "ablate", "inspect"}, commands
    parser = build_parser()
    for argv in commands:
        if argv[0] == "megafuse":
            if argv[1] in ("--help", "--version"):
                continue
            args = parser.parse_args(argv[1:])
            assert args.tool == argv[1]
        else:  # a benchmark module: its own parser, --help only (they time on the H200)
            module = importlib.import_module(argv[2])
            with pytest.raises(SystemExit) as exit_:
                with contextlib.redirect_stdout(io.StringIO()):
                    module.main(argv[3:] + ["--help"])
            assert exit_.value.code == 0, argv
    assert main(["info", "--config", "flash"]) == 0


@pytest.mark.slow  # the eager generate examples serve tiny, one over two processes
def test_every_help_example_parses_and_the_ones_without_a_compile_run_as_written(tmp_path, monkeypatch, capsys):
    from megafuse.model import build_model, preset
    from megafuse.model.checkpoint import save_checkpoint
    from megafuse.tools.cli import build_parser, main

    # the files the examples name, in the folder they run in
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_config.json").write_text(json.dumps(preset("tiny").to_dict()))
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3], [4, 5, 6, 7]]))
    save_checkpoint(build_model(preset("tiny"), seed=0), tmp_path / "checkpoint_dir")

    parser, ran = build_parser(), []
    for argv in help_examples():
        args = parser.parse_args(argv[1:])
        assert args.tool == argv[1], argv
        if runs_here(argv) is None:
            assert main(argv[1:]) == 0, argv
            ran.append(argv[1])
    capsys.readouterr()
    assert ran.count("info") == 3 and ran.count("generate") == 4, ran
