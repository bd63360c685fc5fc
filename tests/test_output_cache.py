"""OutputCache: a step's rows put at once agree with rows put one by one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.cache.output import OutputCache

WIDTH = 4


def state(cache: OutputCache) -> tuple:
    """What a cache holds, in its order: keys with their rows' values, bytes, blocks."""
    return (
        [(key, cache._entries[key][1]) for key in cache._entries],
        cache._bytes_held,
        sorted(held[0] for held in cache._blocks.values()),
        cache._num_evictions,
    )


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5), min_size=1, max_size=8),
    budget_rows=st.integers(1, 16),
    maxsize=st.one_of(st.none(), st.integers(1, 8)),
)
def test_a_steps_rows_put_at_once_match_rows_put_one_by_one(steps, budget_rows, maxsize):
    bulk = OutputCache(budget_rows * WIDTH * 4, maxsize=maxsize, keep_views=True)
    one_by_one = OutputCache(budget_rows * WIDTH * 4, maxsize=maxsize, keep_views=True)
    one_by_one._put_new_block = lambda *args: False  # every row through _store
    blocks = []  # alive: each step's block has its own address
    for keys in steps:
        keys = list(dict.fromkeys(keys))  # a step's requests are distinct
        block = torch.arange(len(keys) * WIDTH, dtype=torch.float32).reshape(len(keys), WIDTH)
        blocks.append(block)
        for cache in (bulk, one_by_one):
            cache.put_rows(keys, block.unbind(0), block)
        assert state(bulk) == state(one_by_one)
        for key in keys:
            found = bulk.get(key)
            assert found is None or torch.equal(found, block[keys.index(key)])


def test_a_fresh_steps_rows_enter_at_once():
    cache = OutputCache(1 << 20, keep_views=True)
    taken = []
    put_new_block = cache._put_new_block
    cache._put_new_block = lambda *args: taken.append(put_new_block(*args)) or taken[-1]
    block = torch.zeros(3, WIDTH)
    cache.put_rows(["a", "b", "c"], block.unbind(0), block)
    again = torch.ones(2, WIDTH)
    cache.put_rows(["c", "d"], again.unbind(0), again)  # "c" held: row by row
    assert taken == [True, False]
    assert torch.equal(cache.get("c"), again[0]) and torch.equal(cache.get("a"), block[0])


def test_making_room_for_bytes_takes_the_oldest_rows_block_whole():
    """A block's bytes go only with its last row: the least recently used row goes with the
    rest of its block, and no row of another block is dropped for nothing."""
    rows = 2
    cache = OutputCache(2 * rows * WIDTH * 4, keep_views=True)  # two blocks
    first, second, third = (torch.full((rows, WIDTH), float(i)) for i in range(3))
    cache.put_rows(["a1", "a2"], first.unbind(0), first)
    cache.put_rows(["b1", "b2"], second.unbind(0), second)
    assert torch.equal(cache.get("a1"), first[0])  # a1 used last; a2 is the oldest row
    cache.put_rows(["c1", "c2"], third.unbind(0), third)
    assert list(cache._entries) == ["b1", "b2", "c1", "c2"]
    assert cache.stats.num_evictions == 2 and cache.stats.bytes_held == cache.budget_bytes
    assert torch.equal(cache.get("b2"), second[1]) and torch.equal(cache.get("c1"), third[0])
