"""The trie tests' reference: the tokens under each byte prefix, and their weights reduced naively."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np


def token_ids_by_prefix(vocab: list[bytes]) -> dict[bytes, np.ndarray]:
    """Every byte prefix of every token -> the ids of the tokens that start with it."""
    members = defaultdict(list)
    for token_id, token in enumerate(vocab):
        for i in range(len(token) + 1):
            members[token[:i]].append(token_id)
    return {prefix: np.array(ids) for prefix, ids in members.items()}


def brute_force(members: dict[bytes, np.ndarray], prefixes: list[bytes], ws: np.ndarray):
    """(sum, max, logsumexp) over the tokens under each prefix, in float64."""
    sums, maxima, logsumexps = [], [], []
    for prefix in prefixes:
        w = ws[members[prefix]]
        sums.append(math.fsum(w))
        top = w.max()
        maxima.append(top)
        shift = top if np.isfinite(top) else 0.0
        total = math.fsum(np.exp(w - shift))
        logsumexps.append(shift + math.log(total) if top > -np.inf else -np.inf)
    return np.array(sums), np.array(maxima), np.array(logsumexps)
