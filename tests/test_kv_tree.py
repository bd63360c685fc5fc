"""KVPrefixTree without a model: blocks whose 'keys' record the token at each slot."""

from __future__ import annotations

import gc
import random
import sys
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.cache.kv_tree import (
    INDEX_STRIDE,
    NUM_RECENT_CONTEXTS,
    KVBlock,
    KVEntry,
    KVPrefixTree,
    Placement,
)
from genlm_backend.cache.plan import extendable_block

NUM_LAYERS = 2


def make_block(contexts: list[list[int]], starts: list[int], num_slots: int) -> KVBlock:
    """A block whose keys[row, 0, slot, 0] is the token at that slot (-1 where unused)."""
    stacked = torch.full((NUM_LAYERS, 2, len(contexts), 1, num_slots, 1), -1.0)
    for row, (context, start) in enumerate(zip(contexts, starts)):
        stacked[..., row, 0, start : start + len(context), 0] = torch.tensor(
            context, dtype=torch.float
        )
    return KVBlock(stacked)


def cache_contexts(tree: KVPrefixTree, contexts: list, namespace=None) -> KVBlock:
    num_slots = max(len(c) for c in contexts) + 2
    starts = [1] * len(contexts)
    block = make_block(contexts, starts, num_slots)
    assert tree.reserve(block.nbytes)
    for row, context in enumerate(contexts):
        tree.insert(context, KVEntry(block, row, 1, len(context)), namespace)
    return block


def slots(block: KVBlock, layer: int, row: int, start: int, length: int):
    """Keys and values ``[H, length, D]`` of ``row``'s slots ``[start, start + length)`` in ``layer``."""
    keys, values = block.layers[layer]
    return keys[row, :, start : start + length], values[row, :, start : start + length]


def reused_tokens(tree: KVPrefixTree, context: list[int], namespace=None) -> list[int]:
    """The tokens whose keys the tree would hand out for ``context``."""
    entry, shared = tree.longest_prefix(context, namespace)
    if entry is None:
        return []
    keys, values = slots(entry.block, NUM_LAYERS - 1, entry.row, entry.start, shared)
    assert torch.equal(keys, values)
    return [int(t) for t in keys[0, :, 0]]


def test_extension_reuses_the_whole_cached_context():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[1, 2, 3]])
    assert reused_tokens(tree, [1, 2, 3, 4, 5]) == [1, 2, 3]


def test_a_parent_given_by_identity_finds_what_the_walk_finds():
    tree = KVPrefixTree(1 << 20)
    cached = tuple(range(1, 40))
    cache_contexts(tree, [cached], namespace="ns")  # remembered as this very tuple
    context = (*cached, 7)
    assert tree.cached_length(context, "ns", parent=cached) == tree.cached_length(context, "ns")
    assert tree.cached_length(context, "ns", parent=cached) == len(cached)
    assert tree.cached_length(context, "other", parent=cached) == 0  # another namespace
    assert tree.cached_length(context, "ns", parent=cached[:-1]) == len(cached)  # not its parent


def test_sibling_branch_reuses_the_shared_part():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[1, 2, 3, 9]])
    assert reused_tokens(tree, [1, 2, 3, 7]) == [1, 2, 3]


def test_shallow_after_deep_reuses_a_prefix_of_the_deep_entry():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[5, 6, 7, 8, 9]])
    assert reused_tokens(tree, [5, 6]) == [5, 6]


def test_unrelated_context_shares_nothing():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[1, 2, 3]])
    assert tree.longest_prefix([4, 2, 3]) == (None, 0)


def test_namespaces_are_isolated():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[1, 2, 3]], namespace="adapter-a")
    assert tree.longest_prefix([1, 2, 3, 4], namespace=None) == (None, 0)
    assert tree.longest_prefix([1, 2, 3, 4], namespace="adapter-b") == (None, 0)
    assert reused_tokens(tree, [1, 2, 3, 4], namespace="adapter-a") == [1, 2, 3]


def test_inserting_an_extension_retires_the_prefix_entry_and_frees_its_block():
    tree = KVPrefixTree(1 << 20)
    first = cache_contexts(tree, [[1, 2]])
    assert tree.stats.num_blocks == 1
    cache_contexts(tree, [[1, 2, 3]])
    assert first.num_live_entries == 0
    assert tree.stats.num_blocks == 1 and tree.stats.num_entries == 1
    assert tree.bytes_held == tree._blocks[next(iter(tree._blocks))].nbytes
    assert reused_tokens(tree, [1, 2, 3, 4]) == [1, 2, 3]


def test_a_block_stays_alive_while_any_of_its_rows_is_cached():
    tree = KVPrefixTree(1 << 20)
    block = cache_contexts(tree, [[1, 2], [3, 4]])
    cache_contexts(tree, [[1, 2, 5]])  # retires row 0 only
    assert block.num_live_entries == 1
    assert tree.stats.num_blocks == 2
    assert reused_tokens(tree, [3, 4, 6]) == [3, 4]


def test_lru_eviction_keeps_bytes_within_budget():
    one_block = make_block([[1, 2, 3]], [1], 5).nbytes
    tree = KVPrefixTree(2 * one_block)
    cache_contexts(tree, [[1, 2, 3]])
    cache_contexts(tree, [[4, 5, 6]])
    tree.longest_prefix([1, 2, 3, 0])  # touch: [4, 5, 6] is now least recently used
    cache_contexts(tree, [[7, 8, 9]])
    assert tree.bytes_held <= tree.budget_bytes
    assert tree.longest_prefix([4, 5, 6, 0]) == (None, 0)
    assert reused_tokens(tree, [1, 2, 3, 0]) == [1, 2, 3]
    assert reused_tokens(tree, [7, 8, 9, 0]) == [7, 8, 9]
    assert tree.stats.num_evictions >= 1


def test_reserve_keeps_pinned_entries_and_reports_when_it_cannot_fit():
    one_block = make_block([[1, 2, 3]], [1], 5).nbytes
    tree = KVPrefixTree(one_block)
    cache_contexts(tree, [[1, 2, 3]])
    pinned, _ = tree.longest_prefix([1, 2, 3])
    assert tree.reserve(one_block, pinned=[pinned]) is False
    assert len(tree) == 1
    assert tree.reserve(one_block) is True
    assert len(tree) == 0 and tree.bytes_held == 0


def test_insert_rejects_an_entry_of_the_wrong_length():
    tree = KVPrefixTree(1 << 20)
    block = make_block([[1, 2]], [0], 2)
    with pytest.raises(ValueError, match="holds 2 tokens for a context of 3"):
        tree.insert([1, 2, 3], KVEntry(block, 0, 0, 2))


def test_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="budget_bytes"):
        KVPrefixTree(-1)


def test_clear_drops_everything():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[1, 2, 3], [1, 4]])
    tree.clear()
    assert tree.stats.num_entries == 0 and tree.bytes_held == 0
    assert tree.longest_prefix([1, 2, 3]) == (None, 0)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_random_workloads_match_a_brute_force_model(seed, budget_blocks):
    """Lookups hand out exactly the longest prefix shared with a live entry, within budget."""
    rng = random.Random(seed)
    one_block = make_block([[0] * 6] * 3, [1] * 3, 8).nbytes
    tree = KVPrefixTree(budget_blocks * one_block)
    # Tuples, some looked up again as the same object (the trie keeps what it found
    # for a tuple by its identity), some extending an earlier one by a token.
    seen: list[tuple[int, ...]] = []

    def draw(length: int) -> tuple[int, ...]:
        if seen and rng.random() < 0.4:
            earlier = rng.choice(seen)
            return earlier if rng.random() < 0.5 or len(earlier) >= 6 else earlier + (0,)
        drawn = tuple(rng.randrange(3) for _ in range(length))
        seen.append(drawn)
        return drawn

    for _ in range(25):
        contexts = [draw(rng.randint(1, 6)) for _ in range(3)]
        query = draw(rng.randint(1, 7))
        live = [entry_context(entry) for entry in tree._lru.values()]
        expected = max((common_prefix(c, query) for c in live), default=0)
        _, shared = tree.longest_prefix(query)
        assert shared == expected
        if shared:
            assert reused_tokens(tree, query) == list(query[:shared])
        block = make_block(contexts, [1] * 3, 8)
        if tree.reserve(block.nbytes):
            for row, context in enumerate(contexts):
                tree.insert(context, KVEntry(block, row, 1, len(context)))
        assert tree.bytes_held <= tree.budget_bytes
        assert tree.bytes_held == sum(b.nbytes for b in tree._blocks.values())


def entry_context(entry: KVEntry) -> list[int]:
    keys, _ = slots(entry.block, 0, entry.row, entry.start, entry.length)
    return [int(t) for t in keys[0, :, 0]]


def test_drop_namespace_evicts_exactly_that_namespace():
    tree = KVPrefixTree(1 << 20)
    kept = cache_contexts(tree, [[1, 2, 3], [1, 4]], namespace="a")
    cache_contexts(tree, [[1, 2, 3], [7]], namespace="b")
    bytes_before = tree.bytes_held
    assert tree.drop_namespace("b") == 2
    assert tree.bytes_held == bytes_before - kept.nbytes  # b's block was freed, a's kept
    assert reused_tokens(tree, [1, 2, 3, 9], namespace="b") == []
    assert reused_tokens(tree, [1, 2, 3, 9], namespace="a") == [1, 2, 3]
    assert tree.drop_namespace("missing") == 0


def test_commit_places_rows_and_extendable_block_accepts_only_the_next_step_of_every_row():
    tree = KVPrefixTree(1 << 20)
    contexts = [[1, 2, 3], [4, 5, 6]]
    block = make_block(contexts, [0, 0], num_slots=5)
    assert tree.commit(block, [Placement(c, row, 0) for row, c in enumerate(contexts)])
    assert block.row_ends == [3, 3]
    steps = [tree.longest_prefix(c + [9]) for c in contexts]
    assert extendable_block(steps) is block
    assert extendable_block(steps[::-1]) is block  # in another order: each row's next slot
    assert extendable_block([steps[0], steps[0]]) is None  # one row twice, the other never
    assert extendable_block([steps[0]]) is None  # not every row of the block steps
    short = [tree.longest_prefix(c[:2] + [9]) for c in contexts]  # branches off inside: slots taken
    assert extendable_block([(e, min(n, 2)) for e, n in short]) is None
    assert not KVPrefixTree(0).commit(
        make_block(contexts, [0, 0], 5), [Placement(contexts[0], 0, 0)]
    )


def test_a_prompt_others_continue_stays_a_walk_shortcut_past_many_newer_contexts():
    # A new particle's first step behind a shared prompt starts at the prompt's
    # node, however many contexts were inserted since; others are forgotten.
    tree = KVPrefixTree(1 << 30)
    prompt = list(range(100, 140))
    cache_contexts(tree, [prompt])
    prompt_entry, _ = tree.longest_prefix(prompt)
    assert prompt_entry is not None
    particles = [prompt + [i, i + 1] for i in range(NUM_RECENT_CONTEXTS + 10)]
    for particle in particles:
        block = make_block([particle[len(prompt) :]], [0], 2)
        assert tree.reserve(block.nbytes)
        tree.insert(particle, KVEntry(block, 0, 0, 2, len(prompt), prompt_entry))
    trie = tree._trie
    assert trie.insertion_start(tuple(prompt + [7]), None) == (prompt_entry.node, len(prompt))
    oldest = particles[0]
    assert trie.insertion_start(tuple(oldest + [7]), None)[1] == 0  # forgotten: walks from the root
    assert trie.insertion_start(tuple(particles[-1] + [7]), None)[1] == len(oldest)
    # Either way the walk finds the same node.
    assert tree.cached_length(oldest + [7]) == len(oldest)


def test_a_context_looked_up_by_identity_is_not_kept_alive_past_its_insertion():
    tree = KVPrefixTree(1 << 20)
    cache_contexts(tree, [[1, 2, 3]])
    context = (1, 2, 3, 4)
    assert tree.cached_length(context) == 3
    assert tree.longest_prefix(context)[1] == 3  # the same tuple: the node found is reused
    assert len(tree._trie._hints) == 1
    cache_contexts(tree, [context])
    assert len(tree._trie._hints) == 0


def held_tokens(entry: KVEntry, num_tokens: int) -> list[int]:
    """The tokens whose keys ``entry`` hands out for its first ``num_tokens``, piece by piece."""
    return [
        int(t)
        for piece, n in entry.pieces(num_tokens)
        for t in slots(piece.block, 0, piece.row, piece.start, n)[0][0, :, 0]
    ]


def grow_one_step(tree: KVPrefixTree, block: KVBlock, contexts: list) -> list:
    """Each context one token longer, written in place after its row's entry and committed."""
    grown, placements = [], []
    for row, context in enumerate(contexts):
        longer = (*context, 50 + len(context) % 40)
        entry, reused = tree.longest_prefix(longer, None, context)
        assert entry is not None and reused == len(context)
        block.stacked[..., row, 0, entry.start + entry.length, 0] = float(longer[-1])
        placements.append(
            Placement(longer, row, entry.start, entry.offset, entry.parent, entry, reused)
        )
        grown.append(longer)
    assert tree.commit(block, placements)
    return grown


def three_particles_behind_a_prompt() -> tuple[KVPrefixTree, tuple, list, KVBlock]:
    """A tree holding a 20-token prompt and three one-token particles behind it, in a block
    with room to grow in place: ``(tree, prompt, contexts, block)``."""
    tree = KVPrefixTree(1 << 30)
    prompt = tuple(range(100, 120))
    cache_contexts(tree, [list(prompt)])
    prompt_entry, _ = tree.longest_prefix(prompt)
    contexts = [(*prompt, i) for i in range(3)]
    block = make_block([[i] for i in range(3)], [0] * 3, num_slots=3 * INDEX_STRIDE)
    placements = [Placement(c, row, 0, len(prompt), prompt_entry) for row, c in enumerate(contexts)]
    assert tree.commit(block, placements)
    return tree, prompt, contexts, block


def test_an_entry_grown_in_place_holds_its_context_and_the_trie_learns_it_each_stride():
    tree, prompt, contexts, block = three_particles_behind_a_prompt()
    first_entries = [tree.longest_prefix((*c, 1), None, c)[0] for c in contexts]
    num_entries = len(tree)
    for step in range(2 * INDEX_STRIDE):
        contexts = grow_one_step(tree, block, contexts)
        assert len(tree) == num_entries  # grown, not added
        for context in contexts:
            entry, reused = tree.longest_prefix((*context, 9), None, context)
            assert entry is not None and reused == len(context)
            assert held_tokens(entry, reused) == list(context)
            # The walk (no parent): all but the tokens grown since the last stride.
            walked = tree.cached_length((*context, 9))
            assert len(context) - INDEX_STRIDE < walked <= len(context)
            found, _ = tree.longest_prefix((*context, 9))
            assert found is not None and held_tokens(found, walked) == list(context[:walked])
        if step < INDEX_STRIDE - 2:  # the same entries until the first stride
            assert [tree.longest_prefix((*c, 1), None, c)[0] for c in contexts] == first_entries
    assert block.row_ends == [len(contexts[0]) - len(prompt)] * 3


def test_the_latest_committed_entries_do_not_keep_an_evicted_block_alive():
    contexts = [(1, 2, 3), (4, 5, 6)]
    block = make_block([list(c) for c in contexts], [0, 0], num_slots=5)
    tree = KVPrefixTree(block.nbytes)
    assert tree.commit(block, [Placement(c, row, 0) for row, c in enumerate(contexts)])
    assert tree.cached_length((1, 2, 3, 4), None, contexts[0]) == 3  # found by identity
    stacked = weakref.ref(block.stacked)
    other = make_block([[7, 8]], [0], num_slots=5 * len(contexts))  # the whole budget
    del block
    assert tree.reserve(other.nbytes)  # evicts the first block's entries
    gc.collect()
    assert stacked() is None
    assert tree.cached_length((1, 2, 3, 4), None, contexts[0]) == 0


def test_a_parent_found_by_identity_is_found_only_under_its_own_namespace():
    tree = KVPrefixTree(1 << 20)
    context = (1, 2, 3)
    block = make_block([list(context)], [0], num_slots=5)
    assert tree.commit(block, [Placement(context, 0, 0)], namespace="a")
    assert tree.cached_length((*context, 4), "a", context) == 3
    assert tree.longest_prefix((*context, 4), "b", context) == (None, 0)
    tree.drop_namespace("a")
    assert tree.cached_length((*context, 4), "a", context) == 0


def test_entries_just_committed_extend_in_place_until_the_tree_changes_under_them():
    """``extend_in_place`` accepts the entries a step committed, each still over its row and
    ending at the row's last slot with a slot left; it refuses once one is grown by another
    commit, evicted, under another namespace, or the block is full. Accepting marks each
    entry used, then its ancestors once (a parent after its dependents)."""
    tree = KVPrefixTree(1 << 30)
    prompt = tuple(range(100, 110))
    cache_contexts(tree, [list(prompt)])
    prompt_entry, _ = tree.longest_prefix(prompt)
    contexts = [(*prompt, i) for i in range(3)]
    block = make_block([[i] for i in range(3)], [0] * 3, num_slots=4)
    placements = [Placement(c, row, 0, len(prompt), prompt_entry) for row, c in enumerate(contexts)]
    kept: list = []
    assert tree.commit(block, placements, kept=kept)
    assert [e.row for e in kept] == [0, 1, 2] and all(e.block is block for e in kept)
    other = make_block([[7]], [0], num_slots=2)  # an unrelated entry, used last
    assert tree.commit(other, [Placement((7,), 0, 0)])
    assert tree.extend_in_place(kept, block, 1, None)
    order = list(tree._lru.values())
    assert order[-1] is prompt_entry and set(order[-4:-1]) == set(kept)
    assert not tree.extend_in_place(kept, block, 1, "another namespace")
    assert not tree.extend_in_place(kept[::-1], block, 1, None)  # rows swapped
    assert not tree.extend_in_place(kept[:2], block, 1, None)  # not every row of the block
    assert not tree.extend_in_place(kept, block, 4, None)  # no slot left

    # One row grown by another commit (a sibling's step): its span ends a slot later.
    sibling = (*contexts[1], 9)
    block.stacked[..., 1, 0, 1, 0] = 9.0
    grown = kept[1]
    assert tree.commit(
        block, [Placement(sibling, 1, 0, len(prompt), prompt_entry, grown, len(contexts[1]))]
    )
    assert not tree.extend_in_place(kept, block, 1, None)

    # The next step's entries: row 1 ends a slot past the others; evicted, none extends.
    kept = []
    steps = [(*c, 5) for c in (contexts[0], sibling, contexts[2])]
    assert tree.commit(
        block,
        [
            Placement(c, row, 0, len(prompt), prompt_entry, tree.longest_prefix(c)[0], len(c) - 1)
            for row, c in enumerate(steps)
        ],
        kept=kept,
    )
    assert None not in kept and [e.start + e.length for e in kept] == [2, 3, 2]
    assert not tree.extend_in_place(kept, block, 2, None)
    tree.clear()
    assert not tree.extend_in_place(kept, block, 2, None)


def test_the_tree_keeps_no_context_its_entries_have_moved_past():
    """Contexts are found by identity through the entry each was last committed for, which
    holds that one context: a particle's older contexts are freed once their owner drops
    them (only the trie's remembered ones, each INDEX_STRIDE tokens, stay longer)."""
    tree, _, contexts, block = three_particles_behind_a_prompt()
    history = []
    for _ in range(INDEX_STRIDE - 2):  # short of a stride: no context remembered by the trie
        contexts = grow_one_step(tree, block, contexts)
        history.append(contexts)
        assert tree.cached_length((*contexts[0], 1), None, contexts[0]) == len(contexts[0])
    gc.collect()
    # References beyond history's, the loop variable's and getrefcount's argument: the tree's.
    held = [[sys.getrefcount(c) - 3 for c in step] for step in history]
    assert held[-1] == [1, 1, 1]  # the last step's: its entries' contexts
    assert all(counts == [0, 0, 0] for counts in held[:-1]), held
