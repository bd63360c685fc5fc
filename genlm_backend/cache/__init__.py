"""Caches that never call a model: the output cache and the KV prefix tree."""

from genlm_backend.cache.output import OutputCache, OutputCacheStats

__all__ = ["OutputCache", "OutputCacheStats"]
