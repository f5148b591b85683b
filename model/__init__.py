"""megafuse.model: the plain eager DeepSeek-V4.1-Flash model the passes must recognise.

No fusion and no custom ops live here: only torch, so `torch.compile` sees the model's own math.
"""

from .config import PRESETS, ConfigError, ModelConfig, load_config, preset, resolve_config
from .batch import Chunk, Rows, Sequence, SequenceGroup, StepBatch, build_step, page_table
from .cache import CacheLayout, KVCache
from .transformer import DecoderRegion, EncoderRegion, Transformer, build_model

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "load_config", "preset", "resolve_config",
           "CacheLayout", "Chunk", "DecoderRegion", "EncoderRegion", "KVCache", "Rows", "Sequence", "SequenceGroup", "StepBatch",
           "Transformer", "build_model", "build_step", "page_table"]
