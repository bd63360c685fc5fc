"""Caches that never call a model: the output cache, and the KV prefix tree the transformers and MLX backends share."""

from genlm_backend.cache.output import OutputCache, OutputCacheStats

__all__ = ["OutputCache", "OutputCacheStats"]
