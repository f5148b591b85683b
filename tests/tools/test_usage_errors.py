"""User mistakes are never called bugs: a size out of range, a checkpoint that is not the config's
model, a model or request larger than the device's memory all exit with status 2 and one line that
names the valid range, the file, or the sizes. Nothing here compiles: every request is refused
before the step runs, or runs with --eager."""

import argparse
import json
import resource
from pathlib import Path

import pytest
import torch

from megafuse.model import CacheLayout, KVCache, build_model, preset
from megafuse.model.checkpoint import WEIGHTS_FILE, save_checkpoint
from megafuse.runtime import Engine
from megafuse.tools import common
from megafuse.tools.cli import TOOLS, build_parser, main
from tests.passes.tiny import every_role_tiny

GiB = 2**30


def _usage_error(argv, capsys) -> str:
    """The one error line argparse prints for argv (after the usage), checking the exit status."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


# --- sizes: every flag states its valid range at parse time ---------------------------------------

@pytest.mark.parametrize("tool, flag, value, rule", [
    ("run", "--batch", "-1", ">= 1"),
    ("run", "--prompt-len", "0", ">= 1"),
    ("run", "--decode", "-1", ">= 0"),
    ("run", "--tolerance", "-0.5", ">= 0"),
    ("ablate", "--repeat", "0", ">= 1"),
    ("ablate", "--layer", "-1", ">= 0"),
    ("inspect", "--repeat", "0", ">= 1"),
    ("generate", "--batch", "-1", ">= 1"),
    ("generate", "--slots", "0", ">= 1"),
    ("generate", "--max-new-tokens", "0", ">= 1"),
    ("generate", "--token-budget", "0", ">= 1"),
    ("generate", "--world-size", "0", ">= 1"),
    ("generate", "--temperature", "-1", ">= 0"),
    ("generate", "--top-p", "0", "> 0 and <= 1"),
    ("generate", "--top-p", "1.5", "> 0 and <= 1"),
    ("generate", "--rank-timeout", "0", "> 0"),
    ("bench-serve", "--sessions", "0", ">= 1"),
    ("bench-serve", "--turns", "0", ">= 1"),
    ("bench-serve", "--system-prompt", "-1", ">= 0"),
    ("bench-serve", "--output-cap", "0", ">= 1"),
    ("bench-serve", "--arrival-rate", "0", "> 0"),
    ("bench-serve", "--think-time", "-1", ">= 0"),
    ("bench-serve", "--slots", "0", ">= 1"),
    ("bench-serve", "--page-size", "0", ">= 1"),
    ("bench-serve", "--token-budget", "0", ">= 1"),
    ("bench-serve", "--prefill-probe", "1", ">= 2"),
])
def test_a_size_out_of_range_is_refused_at_parse_time_stating_the_range(tool, flag, value, rule, capsys):
    line = _usage_error([tool, "--config", "tiny", flag, value], capsys)
    assert line == f"megafuse {tool}: error: argument {flag}: must be {rule}, got {value}"


@pytest.mark.parametrize("flag", ["--context", "--tool-result"])
def test_bench_serve_token_ranges_are_refused_below_one(flag, capsys):
    line = _usage_error(["bench-serve", "--config", "tiny", flag, "0", "10"], capsys)
    assert line == f"megafuse bench-serve: error: argument {flag}: must be >= 1, got 0"


def test_a_size_that_is_not_a_number_names_the_range(capsys):
    line = _usage_error(["generate", "--config", "tiny", "--batch", "two"], capsys)
    assert line == "megafuse generate: error: argument --batch: expected an integer >= 1, got 'two'"


def test_every_numeric_flag_of_every_tool_states_its_range():
    """A new size flag declared with a bare type=int or type=float would accept any value: the
    seed is the one number every value of which is valid."""
    for tool in TOOLS:
        parser = build_parser([tool])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[tool]
        bare = [a.option_strings[0] for a in sub._actions if a.type in (int, float) and a.dest != "seed"]
        assert not bare, f"{tool}: {bare} take any number; use common.in_range"


# --- checkpoints: a truncated or mismatched model.safetensors names the file ---------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return save_checkpoint(build_model(preset("tiny"), seed=0), tmp_path_factory.mktemp("checkpoint"))


@pytest.mark.parametrize("tool", ["run", "generate", "inspect"])
def test_a_truncated_checkpoint_is_a_usage_error_naming_the_file(tool, tiny_checkpoint, tmp_path, capsys):
    for name in ("config.json", WEIGHTS_FILE):
        (tmp_path / name).write_bytes((tiny_checkpoint / name).read_bytes())
    weights = tmp_path / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main([tool, "--config", str(tmp_path), "--prompt-len", "4"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after generate's progress line
    assert error.startswith(f"megafuse {tool}: error: checkpoint file {str(weights)!r} cannot be read (")
    assert error.endswith("truncated or corrupt; write it again with save_checkpoint")


def test_a_checkpoint_of_another_config_is_a_usage_error_naming_the_tensors(tiny_checkpoint, tmp_path, capsys):
    """config.json of a 5-layer tiny beside the 12-layer weights: layers 5..11 are unexpected."""
    (tmp_path / WEIGHTS_FILE).write_bytes((tiny_checkpoint / WEIGHTS_FILE).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(every_role_tiny().to_dict()))
    assert main(["run", "--config", str(tmp_path), "--prompt-len", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megafuse run: error: checkpoint file {str(tmp_path / WEIGHTS_FILE)!r} does not fit "
                          "config 'tiny': ")
    assert "unexpected (layers.10." in err and err.count("\n") == 1


# --- memory: a model or request larger than the device's free memory ------------------------------

def _free(monkeypatch, free: int, where: str = "free on the GPU (of 80.0 GiB, torch.cuda.mem_get_info)"):
    monkeypatch.setattr(common, "free_memory", lambda device: (free, where))


def test_a_model_larger_than_the_gpus_free_memory_is_refused_before_it_is_built(monkeypatch, capsys):
    """`run --config proxy --device cuda` on an 80 GB GPU: the weights alone do not fit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (78 * GiB, 80 * GiB))
    monkeypatch.setattr(common, "build_model", lambda cfg, seed=0, device="cpu": pytest.fail("built")
                        if device != "meta" else build_model(cfg, device="meta"))
    assert main(["run", "--config", "proxy", "--device", "cuda"]) == 2
    proxy = build_model(preset("proxy"), device="meta")
    weights = sum(p.numel() * p.element_size() for p in proxy.parameters())
    assert capsys.readouterr().err == (
        f"megafuse run: error: proxy (bfloat16) has {weights / GiB:,.1f} GiB of weights, more than the 78.0 GiB "
        f"free on the GPU (of 80.0 GiB, torch.cuda.mem_get_info): use a smaller config (presets that fit: tiny)\n")


def _mapped() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return int(status["VmSize"].split()[0]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_the_cpu_free_memory_counts_the_address_space_limit(monkeypatch):
    """Under `ulimit -v` a CPU allocation fails past the limit, whatever the machine has free."""
    limit = _mapped() + GiB
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, resource.RLIM_INFINITY))
    bound = common._cpu_memory()["the address-space limit (ulimit -v) less what this process maps"]
    assert abs(bound - GiB) < 64 * 2**20  # what the process maps moves a little between reads
    free, _ = common.free_memory("cpu")
    assert 0 <= free <= bound


def test_an_out_of_memory_build_is_a_usage_error_with_the_sizes(monkeypatch, capsys):
    def build(cfg, seed=0, device="cpu"):
        if device == "meta":
            return build_model(cfg, device="meta")
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 79.10 GiB of which 1.25 GiB is free.")

    monkeypatch.setattr(common, "build_model", build)
    _free(monkeypatch, 64 * GiB, "available on the CPU (MemAvailable)")
    assert main(["ablate", "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megafuse ablate: error: out of memory on cpu: an allocation of 2.00 GiB failed; "
                          "--batch 1 x --prompt-len 8 needs at least 52.")
    assert err.endswith("and 64.0 GiB was available on the CPU (MemAvailable) when it began: use a smaller --batch "
                        "or --prompt-len\n") and err.count("\n") == 1


def test_a_step_that_fails_to_allocate_is_a_usage_error_and_any_other_failure_a_bug(monkeypatch, capsys):
    cpu_allocator = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                     "you tried to allocate 1228931072 bytes. Error code 12 (Cannot allocate memory)")
    argv = ["generate", "--config", "tiny", "--prompt", "1,2,3", "--max-new-tokens", "2", "--eager"]
    for error, status in ((RuntimeError(cpu_allocator), 2), (RuntimeError("boom"), 3)):
        def fail(self, error=error):
            raise error

        monkeypatch.setattr(Engine, "step", fail)
        assert main(argv) == status
        err = capsys.readouterr().err.split("\n", 1)[1]  # after the progress line
        if status == 2:
            assert err.startswith("megafuse generate: error: out of memory on cpu: an allocation of 1228931072 bytes "
                                  "failed; 1 request of up to 64 positions") and err.count("\n") == 1
        else:
            assert err.startswith("megafuse generate: internal error: RuntimeError: boom")


def test_a_long_prompt_is_refused_with_what_its_step_holds(monkeypatch, capsys):
    """generate --prompt-len 300000 under a 3 GiB cap: a step of 256 rows each scoring 300,032
    entries (the cache's pages of 64 for 300,002 positions) holds far more than the cap."""
    ulimit = "available on the CPU (the address-space limit (ulimit -v) less what this process maps)"
    _free(monkeypatch, 3 * GiB, ulimit)
    assert main(["generate", "--config", "tiny", "--prompt-len", "300000", "--max-new-tokens", "2", "--eager"]) == 2
    err = capsys.readouterr().err
    cfg = preset("tiny")
    # eager, quant="ref": per (row, entry) the 17 gathered bytes and 32 values x (uint8 code + 5 fp32
    # temporaries) while decoding; 256 rows x 300,032 entries of ratio-1 layers
    indexer = 256 * 300_032 * (17 + 32 * 21)
    streams, logits = 256 * 4 * cfg.hc_mult * cfg.dim * 4, cfg.vocab_size * 4
    activations = indexer + streams + logits
    weights, cache = common.model_bytes(cfg), CacheLayout.private(1, 300_002, 64).nbytes(cfg)
    total = (weights + cache + activations) / GiB
    assert err == ("megafuse generate: error: 1 request of up to 300032 positions (prompt + --max-new-tokens 2, "
                   f"pages of 64) in 1 slot, --token-budget 256 needs at least {total:,.1f} GiB (weights "
                   f"{weights / 2**20:,.1f} MiB, cache {cache / 2**20:,.1f} MiB, activations {activations / GiB:,.1f} "
                   f"GiB), more than the 3.0 GiB {ulimit}: use shorter prompts, fewer --slots or a smaller "
                   "--token-budget\n")


def test_the_sizes_a_request_counts_are_what_building_allocates():
    cfg = preset("tiny")
    model = build_model(cfg)
    assert common.model_bytes(cfg) == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    layout = CacheLayout.private(3, 200, 64)
    assert layout.nbytes(cfg) == sum(KVCache.allocate(cfg, layout).nbytes().values())
