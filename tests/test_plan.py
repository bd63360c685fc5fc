"""The batch plan against brute force: prefixes computed first, nested contexts read from longer rows, positions."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from genlm_backend.cache import plan as layout
from genlm_backend.cache.plan import Lookup, nest, shared_uncached_prefixes

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
    assert layout.positions(first, count, max_positions) == expected


@given(CONTEXTS, st.data())
def test_every_context_is_read_once_from_a_row_that_computes_the_position_after_it(contexts, data):
    """Each context's row comes from its own computation or from a longer context of the batch
    that it prefixes, at the new-token position after it; hosts are computed contexts."""
    lookups = [
        Lookup(i, context, None, data.draw(st.integers(0, len(context) - 1)))
        for i, context in enumerate(contexts)
    ]
    hosts = nest(lookups)
    read = [index for _, reads in hosts for index, _ in reads]
    assert sorted(read) == list(range(len(lookups)))
    for host, reads in hosts:
        for index, at in reads:
            context = lookups[index].context
            assert host.context[: len(context)] == context
            assert host.reused + at == len(context) - 1  # the position after the context
            assert 0 <= at < host.num_new
    if all(lookup.num_new == 1 for lookup in lookups):
        assert [host for host, _ in hosts] == lookups


def test_the_prefixes_of_one_continuation_are_read_from_its_one_row():
    prompt = (7, 7, 7)
    continuation = (1, 2, 3, 4)
    lookups = [Lookup(i, prompt + continuation[:n], None, 2) for i, n in enumerate(range(5))]
    ((host, reads),) = nest(lookups)
    assert host.context == prompt + continuation
    assert sorted(reads) == [(i, i) for i in range(5)]
