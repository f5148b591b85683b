"""safetensors save / load of a model's state dict, with its config beside it (config.json).

A checkpoint that cannot be this config's model (a truncated or corrupt file, tensors missing or
extra, a shape or dtype the config does not give) raises `CheckpointError`, a `ConfigError`: the
caller's mistake, named with the file and what is wrong, never a bare library exception. Names
and shapes are checked from the file's header before any tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ConfigError, ModelConfig, load_config
from .rope import rope_frequencies
from .transformer import Transformer, build_model

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SHOWN = 5  # names listed per kind of problem; the count says how many there are


class CheckpointError(ConfigError):
    """A checkpoint that does not hold this config's model; the message names the file and the problem."""


def save_checkpoint(model: Transformer, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    return directory


def _tensors(n: int) -> str:
    return f"{n} tensor{'s' * (n != 1)}"


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > SHOWN else "")


def _check_names_and_shapes(weights: Path, handle, expected: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Every tensor of the model present, nothing else, each of the shape the config gives it."""
    found = set(handle.keys())
    missing, unexpected = set(expected) - found, found - set(expected)
    problems = ([f"{_tensors(len(missing))} missing ({_listed(missing)})"] if missing else []) + \
               ([f"{len(unexpected)} unexpected ({_listed(unexpected)})"] if unexpected else [])
    shapes = {k: list(handle.get_slice(k).get_shape()) for k in found & set(expected)}
    wrong = {k: s for k, s in shapes.items() if s != list(expected[k].shape)}
    problems += [f"{k} has shape {s}, the config gives {list(expected[k].shape)}"
                 for k, s in sorted(wrong.items())[:SHOWN]]
    if len(wrong) > SHOWN:
        problems.append(f"... ({_tensors(len(wrong))} of another shape in all)")
    if problems:
        raise CheckpointError(f"checkpoint file {str(weights)!r} does not fit config {cfg.name!r}: "
                              + "; ".join(problems))


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu",
                    cfg: ModelConfig | None = None) -> Transformer:
    """The model saved in `directory`, on `device`. `cfg`: the config to build (default: the saved
    config.json); a cfg whose dtype overrides the saved one casts the floating-point tensors to
    the dtypes it gives, any other dtype difference is a `CheckpointError`."""
    directory = Path(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in checkpoint directory {str(directory)!r}")
    saved = load_config(directory / CONFIG_FILE) if cfg is None or (directory / CONFIG_FILE).exists() else cfg
    cfg = cfg or saved
    cast = cfg.dtype != saved.dtype  # --dtype over a checkpoint: the caller asked for the conversion
    model = build_model(cfg, device="meta")
    expected = model.state_dict()
    try:
        with safe_open(str(weights), framework="pt", device=str(device)) as handle:
            _check_names_and_shapes(weights, handle, expected, cfg)
            state = {k: handle.get_tensor(k) for k in expected}
    except (SafetensorError, OSError) as e:  # truncated, corrupt or not a safetensors file: found at open
        raise CheckpointError(f"checkpoint file {str(weights)!r} cannot be read ({e}): truncated or corrupt; "
                              f"write it again with save_checkpoint") from None
    wrong = {k: v.dtype for k, v in state.items() if v.dtype != expected[k].dtype}
    if cast:
        floating = {k for k in wrong if wrong[k].is_floating_point and expected[k].dtype.is_floating_point}
        state.update({k: state[k].to(expected[k].dtype) for k in floating})
        wrong = {k: d for k, d in wrong.items() if k not in floating}
    if wrong:
        shown = "; ".join(f"{k} is {str(d).removeprefix('torch.')}, the config gives "
                          f"{str(expected[k].dtype).removeprefix('torch.')}" for k, d in sorted(wrong.items())[:SHOWN])
        raise CheckpointError(f"checkpoint file {str(weights)!r} does not fit config {cfg.name!r} "
                              f"(dtype {cfg.dtype}): {_tensors(len(wrong))} of another dtype: {shown}")
    model.load_state_dict(state, assign=True)
    # Non-persistent buffers (RoPE frequencies) were built on meta: rebuild them on the device.
    for block in model.layers:
        block.attn.rope_freqs = rope_frequencies(cfg, block.layer).to(device)
    return model.eval()
