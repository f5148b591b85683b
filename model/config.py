"""Model configuration: one frozen dataclass, three presets, and the rules that make a config valid.

The presets (see `docs/model.md` section 1):

    tiny   every layer kind and rule of the full model at a few million parameters (CPU tests)
    proxy  the full per-layer widths of V4.1-Flash with the fewest layers that keep one layer of
           each role and fit one H200 in bf16 (GPU benchmarks: kernel shapes match the real model)
    flash  the released configuration; build it on the meta device (552B parameters)

Layer roles follow from three lists (`compress_ratios`, `kv_source_layers`, `index_source_layers`):

    swa      ratio 0: sliding-window attention only
    full     a kv source: own compressor, own indexer; publishes global KV, index keys and top-k
    reindex  an index source that is not a kv source: own indexer over its kv source's keys,
             restricted to the candidate blocks when it lies in the decoder; publishes top-k
    reuse    every other ratio > 0 layer: the latest published top-k and its kv source's KV

Every rule is checked in `validate()`, and an error names the field and the rule it broke.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
QUANT_MODES = ("ref", "none")
# float64 is the reference precision: under quant="ref" a fp32 summation-order difference of ~1e-7
# can move a value across a FP4/FP8 rounding boundary or a top-k tie, which float64 makes negligible.
DTYPES = ("bfloat16", "float32", "float64")
ROLES = ("swa", "full", "reindex", "reuse")

# Block sizes of the quantisation formats (docs/model.md section 6); the dims they cut must divide.
FP8_BLOCK = 32
FP4_BLOCK = 16
MXFP4_BLOCK = 32


class ConfigError(ValueError):
    """A configuration that breaks one of the model's rules; the message names field and rule."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    # widths
    dim: int = 256
    n_layers: int = 12
    vocab_size: int = 1024
    n_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora_rank: int = 96
    o_groups: int = 2
    o_lora_rank: int = 64
    window: int = 8
    # RoPE: ratio-0 layers use rope_theta; ratio > 0 layers use compress_rope_theta with YaRN
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_pos: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_norm_eps: float = 1e-20
    # MoE
    n_experts: int = 8
    n_active_experts: int = 2
    n_shared_experts: int = 1
    expert_dim: int = 128
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    route_norm: bool = True
    swiglu_limit: float = 10.0
    # CSA2 attention
    compress_ratios: tuple[int, ...] = (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1)
    kv_source_layers: tuple[int, ...] = (2, 4, 6)
    index_source_layers: tuple[int, ...] = (2, 4, 6, 9)
    candidate_blocks: int = 4
    candidate_block_size: int = 2
    # Decoder trim (docs/model.md Decision 2): False trims from layer L/2 + 1; True also runs layer L/2's
    # query, attention and FFN on the decoder rows only (its compressor and index keys on every row)
    trim_kv_layer: bool = False
    index_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 6
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hc_delayed: bool = True  # V4.1: a site collapses with the previous sublayer's pre; V4: its own
    # Engram
    engram_layers: tuple[int, ...] = (1, 4)
    engram_max_ngram: int = 3
    engram_heads: int = 2
    engram_head_dim: int = 32
    engram_vocab: int = 512
    engram_head_rows: int = 211
    engram_seed: int = 1234
    # numerics
    quant: str = "ref"
    dtype: str = "float32"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        _check_types(self)  # before anything reads a value: "256" or 4.5 is named, not coerced
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        validate(self)

    # ---- derived structure -------------------------------------------------------------------

    @property
    def decoder_kv_layer(self) -> int:
        """CED: layer L/2 is the only decoder KV source and the candidate source (Decision 1)."""
        return self.n_layers // 2

    @property
    def candidate_source_layer(self) -> int:
        return self.decoder_kv_layer

    def role(self, layer: int) -> str:
        if self.compress_ratios[layer] == 0:
            return "swa"
        if layer in self.kv_source_layers:
            return "full"
        if layer in self.index_source_layers:
            return "reindex"
        return "reuse"

    def kv_source(self, layer: int) -> int | None:
        """The largest kv source <= layer (its global KV), or None for SWA-only layers."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layers if s <= layer)

    def topk_source(self, layer: int) -> int | None:
        """The largest index source <= layer (its published top-k), or None for SWA-only layers."""
        if self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layers if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        """Reindex layers in the decoder score only inside the candidate source's blocks."""
        return self.role(layer) == "reindex" and layer > self.candidate_source_layer

    def is_rope_yarn(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0

    def role_table(self) -> list[dict]:
        return [
            {
                "layer": i,
                "role": self.role(i),
                "ratio": self.compress_ratios[i],
                "kv_source": self.kv_source(i),
                "topk_source": self.topk_source(i),
                "candidates": self.uses_candidates(i),
                "engram": i in self.engram_layers,
                "part": "encoder" if i < self.decoder_kv_layer else "decoder",
            }
            for i in range(self.n_layers)
        ]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields in our names without `extra` (what a checkpoint's config.json holds);
        `config_from_dict` / `load_config` read it back to an equal config."""
        d = dataclasses.asdict(self)
        d.pop("extra")
        return d


def _fail(cfg: ModelConfig, field_name: str, rule: str) -> None:
    raise ConfigError(f"config {cfg.name!r}: {field_name}: {rule}")


def _check_layer_list(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    layers = getattr(cfg, name)
    if list(layers) != sorted(set(layers)):
        _fail(cfg, name, f"must be strictly increasing without repeats, got {list(layers)}")
    bad = [i for i in layers if not 0 <= i < cfg.n_layers]
    if bad:
        _fail(cfg, name, f"layers {bad} lie outside 0..{cfg.n_layers - 1}")
    return layers


# the JSON types each field takes (a float field takes an integer too; bool is not an int here)
_FIELD_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "tuple[int, ...]": (tuple, list)}


def _check_types(cfg: ModelConfig) -> None:
    for f in dataclasses.fields(ModelConfig):
        kinds = _FIELD_TYPES.get(str(f.type))
        if kinds is None:
            continue
        value = getattr(cfg, f.name)
        wrong = not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))
        if not wrong and f.type == "tuple[int, ...]":
            wrong = not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if wrong:
            want = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
                    "tuple[int, ...]": "a list of integers"}[str(f.type)]
            _fail(cfg, f.name, f"must be {want}, got {value!r} ({type(value).__name__})")


def validate(cfg: ModelConfig) -> None:
    """Check every structural rule; raise ConfigError naming the field and the rule."""
    positive = ("dim", "n_layers", "vocab_size", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                "o_lora_rank", "window", "n_experts", "n_active_experts", "expert_dim", "index_heads",
                "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "candidate_blocks",
                "candidate_block_size")
    for name in positive:
        if getattr(cfg, name) <= 0:
            _fail(cfg, name, f"must be positive, got {getattr(cfg, name)}")
    if cfg.score_func not in SCORE_FUNCS:
        _fail(cfg, "score_func", f"{cfg.score_func!r} is not one of {SCORE_FUNCS}")
    if cfg.quant not in QUANT_MODES:
        _fail(cfg, "quant", f"{cfg.quant!r} is not one of {QUANT_MODES}")
    if cfg.dtype not in DTYPES:
        _fail(cfg, "dtype", f"{cfg.dtype!r} is not one of {DTYPES}")
    if cfg.dtype == "float64" and cfg.quant != "ref":
        _fail(cfg, "dtype", f"float64 is the reference precision of quant='ref' only (quant={cfg.quant!r} has no "
              "roundings to flip and agrees in float32); use bfloat16 or float32")
    if cfg.n_active_experts > cfg.n_experts:
        _fail(cfg, "n_active_experts", f"top-{cfg.n_active_experts} exceeds n_experts={cfg.n_experts}")
    if cfg.n_shared_experts not in (0, 1):
        _fail(cfg, "n_shared_experts", f"must be 0 or 1, got {cfg.n_shared_experts}")

    # RoPE rotates interleaved pairs of the last rope_dim dims of every rotated vector.
    if cfg.rope_dim <= 0 or cfg.rope_dim % 2:
        _fail(cfg, "rope_dim", f"must be a positive even number, got {cfg.rope_dim}")
    for name in ("head_dim", "index_head_dim"):
        if cfg.rope_dim > getattr(cfg, name):
            _fail(cfg, "rope_dim", f"{cfg.rope_dim} exceeds {name}={getattr(cfg, name)}")

    # Quantisation block sizes must divide the dims they cut (docs/model.md section 6).
    # (MXFP8 quantises the input of every FP8 GEMM along its K: dim, q_lora_rank, head_dim, expert_dim, o_lora_rank.)
    for name, block, fmt in (("dim", FP8_BLOCK, "MXFP8 activation"),
                             ("q_lora_rank", FP8_BLOCK, "MXFP8 activation"),
                             ("expert_dim", FP8_BLOCK, "MXFP8 activation"),
                             ("o_lora_rank", FP8_BLOCK, "MXFP8 activation"),
                             ("head_dim", FP8_BLOCK, "SWA FP8 / MXFP8"),
                             ("head_dim", FP4_BLOCK, "global-KV FP4"),
                             ("index_head_dim", MXFP4_BLOCK, "indexer MXFP4")):
        if getattr(cfg, name) % block:
            _fail(cfg, name, f"{getattr(cfg, name)} is not a multiple of the {fmt} block size {block}")
    if cfg.n_heads % cfg.o_groups:
        _fail(cfg, "o_groups", f"must divide n_heads={cfg.n_heads}, got {cfg.o_groups}")
    if (cfg.n_heads // cfg.o_groups * cfg.head_dim) % FP8_BLOCK:
        _fail(cfg, "o_groups", f"the WO-A group width must be a multiple of the MXFP8 block {FP8_BLOCK}")

    # Layer structure.
    if len(cfg.compress_ratios) != cfg.n_layers:
        _fail(cfg, "compress_ratios", f"has {len(cfg.compress_ratios)} entries for n_layers={cfg.n_layers}")
    bad = sorted({r for r in cfg.compress_ratios if r not in (0, 1, 2)})
    if bad:
        _fail(cfg, "compress_ratios", f"ratios {bad} are not supported; valid ratios are 0 (SWA only), 1, 2")
    kv = _check_layer_list(cfg, "kv_source_layers")
    idx = _check_layer_list(cfg, "index_source_layers")
    engram = _check_layer_list(cfg, "engram_layers")
    for layer in kv + idx:
        if cfg.compress_ratios[layer] == 0:
            _fail(cfg, "kv_source_layers" if layer in kv else "index_source_layers",
                  f"layer {layer} has compress ratio 0 and cannot own or score global KV")
    missing = [s for s in kv if s not in idx]
    if missing:
        _fail(cfg, "index_source_layers", f"must contain every kv source (a Full layer runs its own indexer); missing {missing}")
    for layer, ratio in enumerate(cfg.compress_ratios):
        if ratio == 0:
            continue
        sources = [s for s in kv if s <= layer]
        if not sources:
            _fail(cfg, "kv_source_layers", f"layer {layer} (ratio {ratio}) has no kv source at or before it; kv sources precede their users")
        if cfg.compress_ratios[sources[-1]] != ratio:
            _fail(cfg, "compress_ratios", f"layer {layer} has ratio {ratio} but its kv source {sources[-1]} has ratio {cfg.compress_ratios[sources[-1]]}")
    middle = cfg.n_layers // 2
    if middle not in kv or cfg.compress_ratios[middle] != 1:
        _fail(cfg, "kv_source_layers", f"CED: layer L/2={middle} must be a kv source with ratio 1 (the decoder's only KV source)")
    if any(s > middle for s in kv):
        _fail(cfg, "kv_source_layers", f"CED: decoder layers (> {middle}) reuse layer {middle}'s KV and cannot be kv sources")
    if cfg.candidate_blocks * cfg.candidate_block_size - (cfg.candidate_block_size - 1) < cfg.index_topk:
        _fail(cfg, "candidate_blocks",
              f"candidate_blocks x candidate_block_size - (candidate_block_size - 1) = "
              f"{cfg.candidate_blocks * cfg.candidate_block_size - (cfg.candidate_block_size - 1)} must be >= index_topk={cfg.index_topk}")
    if any(e >= middle for e in engram):
        _fail(cfg, "engram_layers", f"Engram layers must lie in the encoder (< {middle}), got {list(engram)}")
    if engram:
        if cfg.engram_max_ngram < 2:
            _fail(cfg, "engram_max_ngram", f"must be >= 2 (bigrams and up), got {cfg.engram_max_ngram}")
        for name in ("engram_heads", "engram_head_dim", "engram_vocab", "engram_head_rows"):
            if getattr(cfg, name) <= 0:
                _fail(cfg, name, f"must be positive, got {getattr(cfg, name)}")
        if cfg.engram_vocab > cfg.vocab_size:
            _fail(cfg, "engram_vocab", f"{cfg.engram_vocab} exceeds vocab_size={cfg.vocab_size}")


# ---- presets --------------------------------------------------------------------------------

TINY = ModelConfig(name="tiny")

FLASH = ModelConfig(
    name="flash",
    dim=5120, n_layers=40, vocab_size=129280, n_heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window=128,
    n_experts=384, n_active_experts=6, expert_dim=2304,
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
    kv_source_layers=(2, 8, 14, 20),
    index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_blocks=2048, candidate_block_size=8,
    index_heads=32, index_head_dim=128, index_topk=512,
    engram_layers=(1, 14), engram_max_ngram=4, engram_heads=8, engram_head_dim=256,
    engram_vocab=99092, engram_head_rows=16_000_000,
    dtype="bfloat16",
)

# Full per-layer widths, 5 layers, one of each role: SWA-only (+ Engram), Full ratio 2, Full ratio 1
# (= L/2: decoder KV and candidate source), Reuse, Reindex with candidates. 384 experts x 3 x 5120 x
# 2304 in bf16 are 27.2 GB per layer: five layers are 136 GB of experts, about 131 GiB in all, which
# leaves ~8 GiB of a 139 GiB H200 for activations. A sixth layer would not fit.
PROXY = FLASH.replace(
    name="proxy",
    n_layers=5,
    compress_ratios=(0, 2, 1, 1, 1),
    kv_source_layers=(1, 2),
    index_source_layers=(1, 2, 4),
    engram_layers=(0,),
    engram_head_rows=20_000,
)

# The released 40-layer structure (roles, CED at L/2, Engram layers 1 and 14) at full per-layer widths,
# with 24 routed experts a layer (top-6 of 24) and small Engram tables: 78.7 GiB of weights on the GPU
# in bf16, which leaves ~60 GiB of a 139 GiB H200 for caches and activations (`megafuse info`).
FLASH_LITE = FLASH.replace(name="flash-lite", n_experts=24, engram_head_rows=20_000)

PRESETS = {c.name: c for c in (TINY, PROXY, FLASH, FLASH_LITE)}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown config preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]


# ---- JSON loading -----------------------------------------------------------------------------

# HF-style field names (DeepseekV4Config and the released config.json) -> ours.
HF_FIELD_NAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_dim",
    "sliding_window": "window",
    "n_routed_experts": "n_experts",
    "num_experts_per_tok": "n_active_experts",
    "moe_intermediate_size": "expert_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "norm_topk_prob": "route_norm",
    "index_n_heads": "index_heads",
    "num_local_experts": "n_experts",
    # DeepSeek-V4.1's config.json
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_topk_blocks": "candidate_blocks",
    "engram_layer_ids": "engram_layers",
    "engram_max_ngram_size": "engram_max_ngram",
    "engram_n_heads": "engram_heads",
    "engram_compressed_vocab_size": "engram_vocab",
    "engram_vocab_size": "engram_head_rows",  # rows of each n-gram head's table (a prime at least this)
}
# HF keys whose value the model fixes: (what the value must be, given the config read so far; why).
_HF_CHECKED = {
    "num_key_value_heads": (lambda cfg: 1, "attention is MQA: one KV head"),
    "tie_word_embeddings": (lambda cfg: False, "the head has weights of its own"),
    "max_position_embeddings": (lambda cfg: int(cfg.yarn_factor * cfg.yarn_original_max_pos),
                                "positions are YaRN's factor x original_max_position_embeddings"),
    "topk_method": (lambda cfg: "noaux_tc", "experts are chosen by the bias-corrected scores (no aux loss)"),
    "candidate_source_layer_id": (lambda cfg: cfg.n_layers // 2, "candidates come from layer L/2 (CED)"),
    "rope_scaling.type": (lambda cfg: "yarn", "ratio > 0 layers use YaRN"),
}
# HF keys the model reads nothing from, and why: named as ignored (ModelConfig.extra), never an error.
# (every key of the DSpark draft head starts with `dspark_`)
_HF_IGNORED_PREFIXES = {"dspark_": "the DSpark draft head is not modelled"}
_HF_IGNORED = {
    "num_nextn_predict_layers": "the MTP draft layers are not modelled",
    "quantization_config": "the weights' storage format; the model's numerics are `quant`",
    "engram_num_embeddings": "each Engram layer's table rows follow from the primes >= engram_vocab_size",
    "engram_pad_token_id": "the Engram hash pads with its own id, one past the compressed vocabulary (docs/model.md section 7)",
}
# HF's bookkeeping: no effect on the maths.
_HF_BOOKKEEPING = frozenset({
    "_name_or_path", "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states", "output_router_logits", "id2label", "label2id",
    "is_encoder_decoder", "problem_type", "chunk_size_feed_forward", "attention_dropout",
    "router_aux_loss_coef", "router_jitter_noise",
})
_ROPE_SCALING_NAMES = {
    "factor": "yarn_factor",
    "original_max_position_embeddings": "yarn_original_max_pos",
    "beta_fast": "yarn_beta_fast",
    "beta_slow": "yarn_beta_slow",
}


def config_from_dict(data: dict, base: ModelConfig | None = None, name: str | None = None) -> ModelConfig:
    """Build a config from our field names or HF-style names; fields not given come from `base`
    (default: `tiny` widths with the flash structure rules).

    A config in our field names (one without HF's `hidden_size`) must use only them. An HF
    config.json (V4.1's published one loads whole) may also hold keys whose value the model fixes
    (checked: another value is an error), keys the model reads nothing from (the MTP and DSpark
    draft heads, the quantisation metadata, HF's bookkeeping) and, in `compress_ratios`, the MTP
    layers' entries after the model's own; those are named in `extra` {key: why ignored}. Any other
    key is a ConfigError naming the closest valid names: never a silent fallback.

    Both saved forms load back to an equal config: `cfg.to_dict()` (what checkpoints write) and
    `dataclasses.asdict(cfg)`, whose `extra` (the keys an HF config.json had ignored) is kept."""
    base = base or TINY
    label = name or data.get("name", "custom")
    hf = "hidden_size" in data
    ours = {f.name for f in dataclasses.fields(ModelConfig)} - {"extra"}
    changes, ignored, checked, unknown = {}, {}, {}, []
    for key, value in data.items():
        if key in ours:
            changes[key] = value
        elif key == "extra":  # a saved config's own `extra` (dataclasses.asdict keeps it): carried over
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise ConfigError(f"config {label!r}: extra: must be an object {{key: why it was ignored}} of "
                                  f"strings, got {value!r}")
            ignored.update(value)
        elif not hf:
            unknown.append(key)
        elif key in HF_FIELD_NAMES:
            changes[HF_FIELD_NAMES[key]] = value
        elif key == "rope_scaling" and isinstance(value, dict):
            for k, v in value.items():
                if k in _ROPE_SCALING_NAMES:
                    changes[_ROPE_SCALING_NAMES[k]] = v
                elif f"rope_scaling.{k}" in _HF_CHECKED:
                    checked[f"rope_scaling.{k}"] = v
                else:
                    unknown.append(f"rope_scaling.{k}")
        elif key in _HF_CHECKED:
            checked[key] = value
        elif key in _HF_BOOKKEEPING:
            ignored[key] = "HF's bookkeeping"
        elif key in _HF_IGNORED:
            ignored[key] = _HF_IGNORED[key]
        elif reason := next((why for prefix, why in _HF_IGNORED_PREFIXES.items() if key.startswith(prefix)), None):
            ignored[key] = reason
        else:
            unknown.append(key)
    if unknown:
        key = sorted(unknown)[0]
        valid = sorted(ours | (set(HF_FIELD_NAMES) | set(_HF_CHECKED) | _HF_BOOKKEEPING | set(_HF_IGNORED) if hf else set()))
        close = difflib.get_close_matches(key, valid, n=3)
        raise ConfigError(f"config {label!r}: unknown field {key!r}"
                          + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
                          + (" (an HF config.json: the model's fields, HF names the model maps, and the fields it "
                             "checks or ignores by name)" if hf else
                             f" (fields: {', '.join(sorted(ours))}; an HF config.json uses HF's names)"))
    if name is not None:
        changes["name"] = name
    n_layers = changes.get("n_layers", base.n_layers)
    mtp = data.get("num_nextn_predict_layers", 0) if hf else 0
    ratios = changes.get("compress_ratios")
    if ratios is not None and isinstance(mtp, int) and mtp > 0 and len(ratios) == n_layers + mtp:
        changes["compress_ratios"] = ratios[:n_layers]
        ignored["compress_ratios"] = f"its last {mtp} entries (the MTP draft layers) are not modelled"
    for key in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layers"):
        if key in changes:
            changes[key] = tuple(changes[key])
    cfg = dataclasses.replace(base, **changes)
    for key, value in checked.items():
        expected, why = _HF_CHECKED[key]
        if value != expected(cfg):
            raise ConfigError(f"config {label!r}: {key} = {value!r}, but the model has {expected(cfg)!r}: {why}")
    object.__setattr__(cfg, "extra", ignored)
    return cfg


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object")
    return config_from_dict(data, name=data.get("name", path.stem))


def resolve_config(spec: str) -> ModelConfig:
    """A preset name, a JSON file, or a checkpoint directory holding config.json."""
    if spec in PRESETS:
        return PRESETS[spec]
    if Path(spec).exists():
        return load_config(spec)
    raise ConfigError(f"{spec!r} is neither a config preset ({', '.join(PRESETS)}) nor an existing JSON file or checkpoint directory")
