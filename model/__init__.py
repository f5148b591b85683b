"""megafuse.model: the plain eager DeepSeek-V4.1-Flash model the passes must recognise.

No fusion and no custom ops live here: only torch, so `torch.compile` sees the model's own math.
"""

from .config import PRESETS, ConfigError, ModelConfig, load_config, preset, resolve_config
from .transformer import DecodeCache, Transformer, build_model

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "load_config", "preset", "resolve_config",
           "DecodeCache", "Transformer", "build_model"]
