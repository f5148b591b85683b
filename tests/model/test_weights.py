"""Seeded init keeps activations finite and non-degenerate; checkpoints round-trip exactly, and a
checkpoint that is not the config's model is a CheckpointError naming the file and the problem."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megafuse.model import build_model, preset
from megafuse.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_checkpoint, save_checkpoint
from megafuse.model.config import ConfigError


def test_same_seed_same_weights_other_seed_other_weights():
    cfg = preset("tiny")
    a, b, c = build_model(cfg, seed=0), build_model(cfg, seed=0), build_model(cfg, seed=1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.head.weight, c.head.weight)


def test_activations_stay_finite_and_non_degenerate_in_bf16_through_every_layer():
    cfg = preset("tiny").replace(dtype="bfloat16", quant="ref")
    model = build_model(cfg, seed=0)
    stats = []

    def record(module, args, output):
        streams = output[0].float()
        stats.append((module.layer, streams.std().item(), bool(torch.isfinite(streams).all())))

    hooks = [block.register_forward_hook(record) for block in model.layers]
    logits = model(torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)))
    for h in hooks:
        h.remove()
    assert len(stats) == cfg.n_layers
    for layer, std, finite in stats:
        assert finite and 0.05 < std < 50, (layer, std)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    # distinct tokens give distinct outputs (no collapse to a constant)
    assert logits[0].std(dim=0).mean() > 0.05


def test_flash_builds_on_meta_device():
    model = build_model(preset("flash"), device="meta")
    assert model.head.weight.is_meta and model.layers[39].moe.experts.w13.shape == (384, 2 * 2304, 5120)


def test_safetensors_round_trip(tmp_path):
    cfg = preset("tiny").replace(quant="none")
    model = build_model(cfg, seed=3)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.cfg == cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    assert torch.equal(model(ids), loaded(ids))


# --- a checkpoint that is not this config's model: CheckpointError, naming the file and the problem

@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    """tiny (quant none) saved once: (its model, its state dict, the directory)."""
    model = build_model(preset("tiny").replace(quant="none"), seed=3)
    directory = save_checkpoint(model, tmp_path_factory.mktemp("checkpoint"))
    return model, load_file(str(directory / WEIGHTS_FILE)), directory


def _copy(saved_tiny, tmp_path, state=None) -> Path:
    """The saved checkpoint's config.json in tmp_path, with `state` (default: the saved weights)."""
    _, saved_state, directory = saved_tiny
    shutil.copy(directory / CONFIG_FILE, tmp_path / CONFIG_FILE)
    save_file(saved_state if state is None else state, str(tmp_path / WEIGHTS_FILE))
    return tmp_path


@pytest.mark.parametrize("keep", [0, 8, 1000, -1])  # empty, inside the header, inside the data, one byte short
def test_a_truncated_checkpoint_is_a_checkpoint_error_naming_the_file(saved_tiny, tmp_path, keep):
    directory = _copy(saved_tiny, tmp_path)
    weights = directory / WEIGHTS_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(directory)
    message = str(e.value)
    assert isinstance(e.value, ConfigError)  # what the command line reports as a usage error
    assert f"checkpoint file {str(weights)!r} cannot be read" in message and "truncated or corrupt" in message
    assert "\n" not in message


def test_a_checkpoint_missing_tensors_or_holding_others_names_them(saved_tiny, tmp_path):
    state = dict(saved_tiny[1])
    del state["head.weight"], state["embed.weight"]
    state["stray.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_copy(saved_tiny, tmp_path, state))
    assert str(e.value) == (f"checkpoint file {str(tmp_path / WEIGHTS_FILE)!r} does not fit config 'tiny': "
                            "2 tensors missing (embed.weight, head.weight); 1 unexpected (stray.weight)")


def test_a_checkpoint_tensor_of_another_shape_is_named_with_both_shapes(saved_tiny, tmp_path):
    state = dict(saved_tiny[1])
    state["head.weight"] = state["head.weight"][:10]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_copy(saved_tiny, tmp_path, state))
    vocab, dim = saved_tiny[1]["head.weight"].shape
    assert str(e.value).endswith(f"head.weight has shape [10, {dim}], the config gives [{vocab}, {dim}]")


def test_a_checkpoint_tensor_of_another_dtype_is_named_with_both_dtypes(saved_tiny, tmp_path):
    state = dict(saved_tiny[1])
    state["head.weight"] = state["head.weight"].half()
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_copy(saved_tiny, tmp_path, state))
    assert str(e.value) == (f"checkpoint file {str(tmp_path / WEIGHTS_FILE)!r} does not fit config 'tiny' "
                            "(dtype float32): 1 tensor of another dtype: head.weight is float16, the config "
                            "gives float32")


def test_a_dtype_override_casts_the_checkpoints_floating_tensors(saved_tiny):
    model, _, directory = saved_tiny
    loaded = load_checkpoint(directory, cfg=model.cfg.replace(dtype="bfloat16"))
    expected = build_model(model.cfg.replace(dtype="bfloat16"), device="meta").state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, model.state_dict()[name].to(tensor.dtype)), name
