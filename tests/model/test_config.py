"""Config presets, validation rules with named errors, JSON loading, and the published sizes."""

import dataclasses
import json
from pathlib import Path
import re

import pytest

from megafuse.model.config import PRESETS, ConfigError, config_from_dict, load_config, preset, resolve_config
from megafuse.model.stats import (device_parameter_bytes, global_kv_bytes_per_token, parameter_counts,
                                   swa_bytes_per_request)


def test_presets_are_valid_and_keep_every_role():
    for name in ("tiny", "proxy", "flash"):
        roles = {r["role"] for r in preset(name).role_table()}
        assert roles == {"swa", "full", "reindex", "reuse"}, name
    proxy, flash = preset("proxy"), preset("flash")
    for field in ("dim", "n_heads", "head_dim", "n_experts", "n_active_experts", "expert_dim", "window",
                  "index_heads", "index_head_dim", "index_topk"):
        assert getattr(proxy, field) == getattr(flash, field), field


def test_flash_role_table_matches_model_md():
    cfg = preset("flash")
    table = cfg.role_table()
    assert [r["layer"] for r in table if r["role"] == "full"] == [2, 8, 14, 20]
    assert [r["layer"] for r in table if r["role"] == "reindex"] == [24, 28, 32, 36]
    assert [r["layer"] for r in table if r["role"] == "swa"] == [0, 1]
    assert all(r["kv_source"] == 20 for r in table[21:])
    assert table[25]["topk_source"] == 24 and table[23]["topk_source"] == 20 and table[19]["kv_source"] == 14
    assert [r["layer"] for r in table if r["candidates"]] == [24, 28, 32, 36]
    assert [r["layer"] for r in table if r["engram"]] == [1, 14]


def test_flash_sizes():
    cfg = preset("flash")
    counts = parameter_counts(cfg)
    # The published 552B: ours lands within 0.1% (551.9B); the Engram tables are reported apart.
    assert abs(counts["backbone"] / 552e9 - 1) < 1e-3
    # the tables' rows: primes >= engram_vocab_size per n-gram head; the published config's own
    # (engram_num_embeddings, 384,006,168 and 384,016,682 rows of 256) within 0.01%
    assert abs(counts["engram_tables"] / (256 * (384_006_168 + 384_016_682)) - 1) < 1e-4
    assert global_kv_bytes_per_token(cfg) == 890
    assert swa_bytes_per_request(cfg) == 528 * 40 * 128


@pytest.mark.parametrize("changes, field, words", [
    (dict(head_dim=48), "head_dim", "block size 32"),
    (dict(candidate_blocks=2), "candidate_blocks", ">= index_topk"),
    (dict(kv_source_layers=(4, 6), index_source_layers=(4, 6, 9)), "kv_source_layers", "precede"),
    (dict(engram_layers=(1, 7)), "engram_layers", "encoder"),
    (dict(compress_ratios=(0, 0) + (2,) * 10), "kv_source_layers", "L/2=6"),
    (dict(kv_source_layers=(2, 4, 6, 8), index_source_layers=(2, 4, 6, 8, 9)), "kv_source_layers", "CED"),
    (dict(score_func="relu"), "score_func", "sqrtsoftplus"),
    (dict(quant="fp8"), "quant", "'ref', 'none'"),
    (dict(n_active_experts=9), "n_active_experts", "n_experts=8"),
    (dict(compress_ratios=(0,) * 11), "compress_ratios", "12"),
    (dict(rope_dim=15), "rope_dim", "even"),
])
def test_validation_names_the_field_and_rule(changes, field, words):
    with pytest.raises(ConfigError) as err:
        preset("tiny").replace(**changes)
    assert field in str(err.value) and words in str(err.value), str(err.value)


def test_unknown_preset_lists_valid_choices():
    with pytest.raises(ConfigError, match="tiny, proxy, flash"):
        preset("huge")


def test_json_with_hf_field_names(tmp_path):
    data = {"hidden_size": 512, "num_attention_heads": 8, "n_routed_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 64, "scoring_func": "sigmoid", "sliding_window": 16,
            "rope_scaling": {"factor": 8, "original_max_position_embeddings": 4096},
            "torch_dtype": "bfloat16", "bos_token_id": 0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    cfg = load_config(tmp_path)
    assert (cfg.dim, cfg.n_heads, cfg.n_experts, cfg.n_active_experts, cfg.expert_dim) == (512, 8, 16, 4, 64)
    assert (cfg.score_func, cfg.window, cfg.yarn_factor, cfg.yarn_original_max_pos) == ("sigmoid", 16, 8, 4096)
    assert set(cfg.extra) == {"torch_dtype", "bos_token_id"}
    assert config_from_dict(preset("tiny").to_dict()) == preset("tiny")


@pytest.mark.parametrize("name", list(PRESETS))  # tiny, proxy, flash, flash-lite
@pytest.mark.parametrize("form", ["asdict", "to_dict"])
def test_every_preset_saved_as_json_loads_back_equal_field_by_field(tmp_path, name, form):
    cfg = preset(name)
    saved = dataclasses.asdict(cfg) if form == "asdict" else cfg.to_dict()
    assert ("extra" in saved) == (form == "asdict")
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(saved))
    for loaded in (load_config(path), resolve_config(str(path))):
        # every field, extra (compare=False) included, is the preset's
        assert loaded == cfg and dataclasses.asdict(loaded) == dataclasses.asdict(cfg)


def test_an_hf_configs_ignored_keys_survive_a_save_as_asdict_and_a_load(tmp_path):
    cfg = config_from_dict(_published(), name="v41")
    path = tmp_path / "v41.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    loaded = load_config(path)
    assert loaded == cfg and loaded.extra == cfg.extra and set(loaded.extra) == PUBLISHED_IGNORED
    (tmp_path / "bad.json").write_text(json.dumps({**dataclasses.asdict(preset("tiny")), "extra": ["dspark_"]}))
    with pytest.raises(ConfigError, match=re.escape("config 'tiny': extra: must be an object {key: why it was "
                                                    "ignored} of strings, got ['dspark_']")):
        load_config(tmp_path / "bad.json")


def test_bad_json_is_a_config_error(tmp_path):
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "c.json").write_text(json.dumps({"hidden_size": 250}))
    with pytest.raises(ConfigError, match="dim"):
        load_config(tmp_path / "c.json")


@pytest.mark.parametrize("changes, message", [
    ({"dim": "256"}, "dim: must be an integer, got '256' (str)"),
    ({"n_heads": 4.5}, "n_heads: must be an integer, got 4.5 (float)"),
    ({"route_norm": 1}, "route_norm: must be true or false, got 1 (int)"),
    ({"engram_layers": [1, "4"]}, "engram_layers: must be a list of integers, got (1, '4') (tuple)"),
    ({"score_func": 3}, "score_func: must be a string, got 3 (int)"),
])
def test_a_value_of_the_wrong_type_is_named_with_its_field_not_coerced(changes, message):
    with pytest.raises(ConfigError, match=re.escape(f"config 'x': {message}")):
        config_from_dict(changes, name="x")


def test_an_unknown_field_in_our_names_is_an_error_with_the_closest_names():
    with pytest.raises(ConfigError, match=r"config 'x': unknown field 'n_head'; did you mean 'n_heads', 'index_heads', "
                                          r"'engram_heads'\? \(fields: candidate_block_size, "):
        config_from_dict({"dim": 256, "n_head": 4}, name="x")
    with pytest.raises(ConfigError, match=r"unknown field 'zzz' \(fields: "):
        config_from_dict({"zzz": 1}, name="x")
    assert config_from_dict({"yarn_factor": 16}, name="x").yarn_factor == 16  # an integer for a float field


# DeepSeek-V4.1-Flash's published text config (config.json -> text_config)
PUBLISHED = Path(__file__).resolve().parent / "data" / "v41_flash_text_config.json"
# what the published V4.1 text config holds that the model reads nothing from, by name
PUBLISHED_IGNORED = {"num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                     "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok",
                     "quantization_config", "engram_num_embeddings", "engram_pad_token_id", "compress_ratios"}


def _published() -> dict:
    return json.loads(PUBLISHED.read_text())


def test_the_published_v41_config_loads_into_flash_naming_what_it_ignores():
    cfg = config_from_dict(_published(), name="v41")
    # the architecture is flash's; dtype and quant are how it runs (the text config names neither)
    assert cfg.replace(name="flash", dtype="bfloat16") == preset("flash")
    assert len(cfg.compress_ratios) == 40  # the 3 MTP entries dropped, and said so
    assert set(cfg.extra) == PUBLISHED_IGNORED
    assert "3" in cfg.extra["compress_ratios"] and "MTP" in cfg.extra["compress_ratios"]
    assert all(isinstance(why, str) and why for why in cfg.extra.values())


@pytest.mark.parametrize("change, message", [
    ({"num_hiden_layers": 40}, "unknown field 'num_hiden_layers'; did you mean 'num_hidden_layers'"),
    ({"engram_n_head": 8}, "unknown field 'engram_n_head'; did you mean 'engram_n_heads'"),
    ({"num_key_value_heads": 8}, "num_key_value_heads = 8, but the model has 1: attention is MQA"),
    ({"max_position_embeddings": 131072}, "max_position_embeddings = 131072, but the model has 1048576"),
    ({"candidate_source_layer_id": 19}, "candidate_source_layer_id = 19, but the model has 20"),
    ({"rope_scaling": {"type": "linear", "factor": 16}}, "rope_scaling.type = 'linear', but the model has 'yarn'"),
])
def test_a_published_config_with_a_misspelt_or_contradicting_key_is_an_error(change, message):
    data = {**_published(), **change}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, name="v41")
    assert message in str(err.value), str(err.value)


def test_flash_lite_is_flash_with_fewer_experts_and_fits_an_h200_with_room_for_caches():
    lite, flash = preset("flash-lite"), preset("flash")
    assert lite.role_table() == flash.role_table()  # 40 layers: roles, CED at L/2, Engram layers
    assert lite.replace(name="flash", n_experts=flash.n_experts, engram_head_rows=flash.engram_head_rows) == flash
    assert lite.n_active_experts == 6 < lite.n_experts
    # 139 GiB of H200 memory, at least 40 GiB of it left for caches (and activations)
    assert device_parameter_bytes(lite) <= (139 - 40) * 2**30
    assert device_parameter_bytes(lite) == pytest.approx(78.71 * 2**30, rel=1e-3)


def test_float64_is_the_reference_precision_of_quant_ref_only():
    assert preset("tiny").replace(dtype="float64").quant == "ref"
    with pytest.raises(ConfigError, match=re.escape("dtype: float64 is the reference precision of quant='ref' only")):
        preset("tiny").replace(dtype="float64", quant="none")
    with pytest.raises(ConfigError, match=re.escape("'float16' is not one of ('bfloat16', 'float32', 'float64')")):
        preset("tiny").replace(dtype="float16")
