"""Token-character tries: per-byte-prefix sums, maxima and logsumexps of token weights.

* :class:`TokenCharacterTrie`: float64 numpy reference implementation (CPU).
* :class:`ParallelTokenCharacterTrie`: the same reductions in float32 torch, on any device.
* :class:`AsyncTokenCharacterTrie`: concurrent ``await`` requests batched by the
  :class:`~genlm_backend.batching.WaitingCalls` queue.
"""

from genlm_backend.trie.async_impl import AsyncTokenCharacterTrie
from genlm_backend.trie.base import TokenCharacterTrie
from genlm_backend.trie.parallel import ParallelTokenCharacterTrie

__all__ = ["AsyncTokenCharacterTrie", "ParallelTokenCharacterTrie", "TokenCharacterTrie"]
