"""safetensors save / load of a model's state dict, with its config beside it (config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig, load_config
from .rope import rope_frequencies
from .transformer import Transformer, build_model

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def save_checkpoint(model: Transformer, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    return directory


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu",
                    cfg: ModelConfig | None = None) -> Transformer:
    directory = Path(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.exists():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in checkpoint directory {str(directory)!r}")
    cfg = cfg or load_config(directory / CONFIG_FILE)
    model = build_model(cfg, device="meta")
    state = load_file(str(weights), device=str(device))
    missing, unexpected = set(model.state_dict()) - set(state), set(state) - set(model.state_dict())
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(directory)!r} does not fit config {cfg.name!r}: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, assign=True)
    # Non-persistent buffers (RoPE frequencies) were built on meta: rebuild them on the device.
    for block in model.layers:
        block.attn.rope_freqs = rope_frequencies(cfg, block.layer).to(device)
    return model.eval()
