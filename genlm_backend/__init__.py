"""genlm_backend: next-token log-probabilities for probabilistic programs, batched and cached.

Importing this package imports neither vLLM nor transformers' models and does
not touch ``os.environ``; backends load on first use.
"""

from genlm_backend.llm import AsyncLM, LMStats, MockAsyncLM, load_model_by_name

__version__ = "0.1.0"

__all__ = [
    "AsyncLM",
    "AsyncTokenCharacterTrie",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "LMStats",
    "MockAsyncLM",
    "ParallelTokenCharacterTrie",
    "Token",
    "TokenCharacterTrie",
    "decode_vocab",
    "load_model_by_name",
]

_LAZY = {
    "AsyncTransformer": "genlm_backend.llm",
    "AsyncVirtualLM": "genlm_backend.llm",
    "decode_vocab": "genlm_backend.tokenization",
    "Token": "genlm_backend.tokenization",
    "TokenCharacterTrie": "genlm_backend.trie",
    "ParallelTokenCharacterTrie": "genlm_backend.trie",
    "AsyncTokenCharacterTrie": "genlm_backend.trie",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
