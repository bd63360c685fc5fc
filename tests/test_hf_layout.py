"""The plan of prefixes a batch computes first (``hf_layout.shared_uncached_prefixes``), against brute force."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from genlm_backend.llm.hf import plan as layout
from genlm_backend.llm.hf.plan import shared_uncached_prefixes

# Few token values and short contexts: branches, exact prefixes and duplicates of prefixes are common.
CONTEXTS = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple), max_size=8, unique=True
)


def common_prefix_length(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@given(CONTEXTS, st.integers(1, 3), st.integers(0, 3))
def test_every_pair_of_contexts_gets_its_shared_prefix_computed_first(contexts, min_tokens, cached):
    """Every prefix two contexts share (short of each one's last token) with ``min_tokens`` or
    more uncached, each once, and a prefix in a round after every prefix of it."""

    def cached_length(prefix):
        return min(cached, len(prefix))

    expected = set()
    for a, b in itertools.combinations(contexts, 2):
        n = min(common_prefix_length(a, b), len(a) - 1, len(b) - 1)
        if n - cached_length(a[:n]) >= min_tokens:
            expected.add(a[:n])
    rounds = shared_uncached_prefixes(contexts, cached_length, min_tokens)
    planned = [prefix for prefixes in rounds for prefix in prefixes]
    assert sorted(planned) == sorted(expected)
    round_of = {prefix: i for i, prefixes in enumerate(rounds) for prefix in prefixes}
    for p, q in itertools.permutations(planned, 2):
        if len(q) < len(p) and p[: len(q)] == q:
            assert round_of[q] < round_of[p]
    assert all(rounds)  # no empty round


@given(st.integers(0, 50), st.integers(0, 20), st.integers(1, 60))
def test_positions_continue_each_row_and_stay_in_the_model_range(first, count, max_positions):
    expected = torch.arange(first, first + count).clamp(max=max_positions - 1).tolist()
    assert layout._positions(first, count, max_positions) == expected
