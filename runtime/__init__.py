"""Serving: continuous batching over the model's batched step, a paged byte cache with a prefix
cache of global KV, bounded replay and the trimmed decoder (docs/serving.md)."""

from .engine import Engine, EngineStats, RequestError, SamplingParams
from .kv_cache import PagePool, PrefixCache

__all__ = ["Engine", "EngineStats", "PagePool", "PrefixCache", "RequestError", "SamplingParams"]
