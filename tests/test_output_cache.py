"""OutputCache: a step's rows put at once agree with rows put one by one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.cache import output
from genlm_backend.cache.output import OutputCache

WIDTH = 4


def state(cache: OutputCache) -> tuple:
    """What a cache holds, in its order: keys with their rows' values, bytes, blocks."""
    return (
        [(key, cache._entries[hash(key)][1]) for key in cache],
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
    assert cache.keys() == ["b1", "b2", "c1", "c2"]
    assert cache.stats.num_evictions == 2 and cache.stats.bytes_held == cache.budget_bytes
    assert torch.equal(cache.get("b2"), second[1]) and torch.equal(cache.get("c1"), third[0])


def _steps(cache: OutputCache, names: list[str], rows: int = 2) -> list[torch.Tensor]:
    """Put one block of ``rows`` new keys per name (``name0``, ``name1``...); the blocks, alive."""
    blocks = []
    for i, name in enumerate(names):
        block = torch.full((rows, WIDTH), float(i))
        cache.put_rows([f"{name}{r}" for r in range(rows)], block.unbind(0), block)
        blocks.append(block)
    return blocks


BLOCK_BYTES = 2 * WIDTH * 4  # a block of two rows


def test_a_cache_whose_rows_are_never_asked_again_stays_at_its_initial_limit():
    """Particles that each extend their own context: every step's keys are new, so no
    evicted key is asked again and the cache holds no more than it started with."""
    cache = OutputCache(64 * BLOCK_BYTES, keep_views=True, initial_bytes=3 * BLOCK_BYTES)
    blocks = []
    for step in range(40):
        names = [f"s{step}"]
        assert cache.get_many([f"s{step}0", f"s{step}1"]) == [None, None]  # new contexts
        blocks += _steps(cache, names)
        assert cache.stats.bytes_held <= 3 * BLOCK_BYTES
    assert cache.stats.limit_bytes == 3 * BLOCK_BYTES and len(cache) == 6
    assert torch.equal(cache.get("s390"), blocks[-1][0])


def test_a_miss_of_an_evicted_row_doubles_the_limit_up_to_the_budget():
    cache = OutputCache(8 * BLOCK_BYTES, keep_views=True, initial_bytes=2 * BLOCK_BYTES)
    blocks = _steps(cache, ["a", "b", "c"])  # a evicted
    assert cache.get("a0") is None  # a miss of an evicted row
    assert cache.stats.limit_bytes == 4 * BLOCK_BYTES
    blocks += _steps(cache, ["d", "e"])
    assert cache.stats.bytes_held == 4 * BLOCK_BYTES and "b0" in cache  # b c d e: nothing evicted
    assert torch.equal(cache.get("c0"), blocks[2][0])
    for name in "fghijklmn":  # each step re-asks the first evicted row: up to the budget
        blocks += _steps(cache, [name])
        evicted = [key for key in ("a0", "b0", "c1", "d1", "e1") if key not in cache]
        cache.get_many(evicted)
    assert cache.stats.limit_bytes == cache.budget_bytes == 8 * BLOCK_BYTES
    assert cache.stats.bytes_held <= cache.budget_bytes
    assert not cache._ghosts  # at the budget, nothing evicted is remembered


def test_only_rows_the_whole_budget_would_still_hold_count_as_evicted_and_asked_again():
    """A key evicted longer ago than the budget reaches is a plain miss: no growth."""
    cache = OutputCache(4 * BLOCK_BYTES, keep_views=True, initial_bytes=2 * BLOCK_BYTES)
    blocks = _steps(cache, [f"s{i}" for i in range(10)])
    assert cache._ghost_bytes <= cache.budget_bytes - cache.stats.limit_bytes
    assert cache.get("s00") is None and cache.stats.limit_bytes == 2 * BLOCK_BYTES  # too old
    assert cache.get("s70") is None and cache.stats.limit_bytes == 4 * BLOCK_BYTES  # recent
    assert len(blocks) == 10


def test_the_limit_always_holds_two_of_the_largest_outputs():
    cache = OutputCache(64 * BLOCK_BYTES, keep_views=True, initial_bytes=BLOCK_BYTES // 2)
    blocks = _steps(cache, ["a", "b", "c"])
    assert cache.stats.limit_bytes == 2 * BLOCK_BYTES
    assert cache.keys() == ["b0", "b1", "c0", "c1"]  # a step and the last one
    assert torch.equal(cache.get("b1"), blocks[1][1])
    large = torch.zeros(16, WIDTH)  # larger than the budget's share: stored, limit raised
    cache.put_rows([f"x{i}" for i in range(16)], large.unbind(0), large)
    assert cache.stats.limit_bytes == 2 * large.nbytes and "x15" in cache
    huge = OutputCache(BLOCK_BYTES, keep_views=True, initial_bytes=0)
    _steps(huge, ["a", "b"])
    assert huge.stats.limit_bytes == BLOCK_BYTES and huge.keys() == ["b0", "b1"]


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=4), st.integers(0, 30)),
        min_size=1,
        max_size=12,
    ),
    budget_rows=st.integers(1, 16),
    initial_rows=st.integers(0, 16),
)
def test_a_growing_cache_holds_within_its_limit_and_its_budget_and_returns_what_was_put(
    steps, budget_rows, initial_rows
):
    cache = OutputCache(
        budget_rows * WIDTH * 4, keep_views=True, initial_bytes=initial_rows * WIDTH * 4
    )
    latest = {}  # key -> the value last put
    blocks = []
    for keys, asked in steps:
        keys = list(dict.fromkeys(keys))
        block = torch.randn(len(keys), WIDTH)
        blocks.append(block)
        limit = cache.stats.limit_bytes
        found = cache.get(asked)
        assert found is None or torch.equal(found, latest[asked])
        assert cache.stats.limit_bytes in (limit, min(cache.budget_bytes, 2 * limit))
        cache.put_rows(keys, block.unbind(0), block)
        latest.update(zip(keys, block.unbind(0)))
        stats = cache.stats
        assert stats.bytes_held <= stats.limit_bytes <= stats.budget_bytes
        assert cache._ghost_bytes <= stats.budget_bytes - stats.limit_bytes + 1e-6


def test_evicted_keys_are_remembered_within_a_count_too(monkeypatch):
    """Rows of no bytes never fill the budget: the keys evicted (by count) are remembered
    up to MAX_GHOSTS, not without end."""
    monkeypatch.setattr(output, "MAX_GHOSTS", 8)
    cache = OutputCache(1 << 20, maxsize=2, initial_bytes=1 << 10)
    for i in range(40):
        cache.put(f"k{i}", torch.zeros(0))
    assert len(cache._ghosts) == 8 and len(cache) == 2
    assert cache.get("k37") is None and cache.stats.limit_bytes == 2 << 10  # remembered
    assert cache.get("k0") is None and cache.stats.limit_bytes == 2 << 10  # forgotten


class _Colliding:
    """A key whose hash every other such key shares."""

    def __init__(self, name: str):
        self.name = name

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Colliding) and other.name == self.name


def test_keys_of_one_hash_never_get_each_others_rows():
    """Entries are held by their key's hash: of two keys sharing one, the later put is held,
    and the other misses (as a key never put), put one by one or as a step's rows."""
    for keep_views in (False, True):
        cache = OutputCache(1 << 20, keep_views=keep_views)
        first, second = torch.zeros(WIDTH), torch.ones(WIDTH)
        cache.put(_Colliding("a"), first)
        assert torch.equal(cache.get(_Colliding("a")), first) and _Colliding("a") in cache
        cache.put(_Colliding("b"), second)
        assert cache.get(_Colliding("a")) is None and _Colliding("a") not in cache
        assert torch.equal(cache.get(_Colliding("b")), second) and len(cache) == 1
        block = torch.stack([first, second])
        cache.put_rows([_Colliding("c"), _Colliding("d")], block.unbind(0), block)
        assert len(cache) == 1 and cache.get(_Colliding("c")) is None
        assert torch.equal(cache.get(_Colliding("d")), second)
        assert cache.discard_if(lambda key: key.name == "d") == 1 and len(cache) == 0
