"""Errors of batch calls name the index of the bad context; single calls name ``token_ids``."""

from __future__ import annotations

import contextlib
import enum
import gc
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from genlm_backend.cache import kv_tree
from genlm_backend.cache.kv_tree import context_hash, tail_hash
from genlm_backend.llm import MockAsyncLM
from genlm_backend.llm.base import (
    RECENT_TAIL,
    RecentContexts,
    _general_ids,
    _plain_ids_in_range,
    validate_contexts,
    validate_token_ids,
)

VOCAB_SIZE = 50


@pytest.fixture
def llm():
    mock = MockAsyncLM(
        byte_vocab=[bytes([65 + i % 26]) * (1 + i // 26) for i in range(VOCAB_SIZE)],
        max_context_length=8,
    )
    yield mock
    mock.close()


GOOD, OUT_OF_RANGE = [1, 2, 3], [4, VOCAB_SIZE]


def test_validate_contexts_prefixes_the_index():
    assert validate_contexts([GOOD, (5,)], VOCAB_SIZE) == [(1, 2, 3), (5,)]
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"token_ids_list[1]: token_ids[1] = {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})"
        ),
    ):
        validate_contexts([GOOD, OUT_OF_RANGE], VOCAB_SIZE)
    with pytest.raises(TypeError, match=re.escape("prompts[2]: token_ids[0] is 1.0 of type float")):
        validate_contexts([GOOD, GOOD, [1.0]], VOCAB_SIZE, argument="prompts")
    with pytest.raises(ValueError, match=r"^token_ids has 9 tokens"):
        validate_contexts([[1] * 9], VOCAB_SIZE, max_context_length=8, argument=None)


async def test_batch_next_token_logprobs_names_the_bad_index(llm):
    with pytest.raises(ValueError, match=re.escape("token_ids_list[3]: token_ids is empty")):
        await llm.batch_next_token_logprobs([GOOD, GOOD, [7], []])
    assert llm.stats.num_requests == 0  # a rejected call counts nothing


def test_batch_next_token_logprobs_sync_names_the_bad_index(llm):
    with pytest.raises(ValueError, match=re.escape("token_ids_list[2]: token_ids has 9 tokens")):
        llm.batch_next_token_logprobs_sync([GOOD, GOOD, [1] * 9])


async def test_single_calls_name_token_ids_without_an_index(llm):
    message = f"^token_ids\\[1\\] = {VOCAB_SIZE} is outside"
    with pytest.raises(ValueError, match=message):
        await llm.next_token_logprobs(OUT_OF_RANGE)
    with pytest.raises(ValueError, match=message):
        llm.next_token_logprobs_sync(OUT_OF_RANGE)


async def test_batch_sample_names_the_bad_prompt(llm):
    with pytest.raises(ValueError, match=re.escape("prompt_token_ids_list[1]: token_ids[1]")):
        await llm.batch_sample([GOOD, OUT_OF_RANGE], max_tokens=2, eos_token_ids=[0])


class _Small(enum.IntEnum):
    ONE = 1


_ELEMENTS = st.one_of(
    st.integers(-3, VOCAB_SIZE + 3),
    st.integers(-(2**40), 2**40),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(0, VOCAB_SIZE - 1).map(np.int64),
    st.just(_Small.ONE),
)


@given(st.lists(_ELEMENTS, max_size=12), st.sampled_from([list, tuple]))
def test_the_one_pass_check_agrees_with_the_element_by_element_one(elements, container):
    token_ids = container(elements)
    try:
        expected = _general_ids(token_ids, VOCAB_SIZE)
    except (TypeError, ValueError):
        expected = None
    fast = _plain_ids_in_range(token_ids, VOCAB_SIZE)
    if fast is not None:  # it accepts only what the general path accepts, as plain ints
        assert fast == expected and all(type(t) is int for t in fast)
    if all(type(t) is int for t in elements) and expected:  # plain ints in range: never missed
        assert fast == expected


def test_plain_ids_of_a_long_context_take_the_one_pass_check():
    context = [i % VOCAB_SIZE for i in range(5000)]
    assert _plain_ids_in_range(context, VOCAB_SIZE) == tuple(context)
    assert _plain_ids_in_range(context + [True], VOCAB_SIZE) is None
    assert _plain_ids_in_range(context + [VOCAB_SIZE], VOCAB_SIZE) is None
    assert _plain_ids_in_range([-1, *context], VOCAB_SIZE) is None


@given(st.lists(_ELEMENTS, min_size=1, max_size=6), _ELEMENTS, st.sampled_from([list, tuple]))
def test_a_context_extending_a_recent_one_is_checked_as_a_new_one(prefix, last, container):
    """Whatever the recent contexts hold, the answer (or error) is the full check's."""
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    with contextlib.suppress(TypeError, ValueError):
        recent.validate(container(prefix))
    token_ids = container([*prefix, last])
    try:
        expected = validate_token_ids(token_ids, VOCAB_SIZE)
    except (TypeError, ValueError) as exc:
        with pytest.raises(type(exc)):
            recent.validate(token_ids)
        return
    context, _, hashed = recent.validate(token_ids)
    assert context == expected and all(type(t) is int for t in context)
    assert hashed == context_hash(context)


def test_a_context_one_token_past_a_recent_one_names_it_as_its_parent():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    first, none, *_ = recent.validate([i % VOCAB_SIZE for i in range(300)])
    assert none is None
    second, parent, *_ = recent.validate([i % VOCAB_SIZE for i in range(300)] + [7])
    assert parent is first and second == (*first, 7)
    _, parent, *_ = recent.validate(list(second) + [8])
    assert parent is second
    _, parent, *_ = recent.validate(list(first) + [9])  # first is still recent: a sibling
    assert parent is first
    _, parent, *_ = recent.validate(
        [5, *first[1:], 7]
    )  # same length and last tokens, another start
    assert parent is None


@pytest.mark.parametrize("length", [100, 300], ids=["compared", "pointers"])
def test_a_shorter_context_under_a_colliding_key_is_never_taken_for_the_parent(length):
    """A recent context found by its tail's hash but of another length (a hash collision,
    made here by holding it under the key the call looks up) is not the call's parent, also
    where its tokens are the call's first objects (compared as pointers past 160 tokens)."""
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    tokens = [i % VOCAB_SIZE for i in range(length)]
    shorter = tuple(tokens[: length - 20])  # the very objects of the call's first tokens
    key = hash((length - 1, tuple(tokens[-RECENT_TAIL - 1 : -1])))
    recent._by_hash[key] = (shorter, kv_tree.blocks_digest(shorter))
    context, parent, hashed = recent.validate(tokens)
    assert context == tuple(tokens) and parent is None
    assert hashed == context_hash(context)


@pytest.mark.parametrize("fresh_lists", [False, True], ids=["lists-extended", "fresh-lists"])
def test_particles_in_one_repetition_loop_each_find_their_own_parent(fresh_lists):
    """Contexts alike in length and last tokens (a repetition loop behind a long prompt) do not
    take each other's place: each particle's next context names its own last one."""
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    prompt = [i % VOCAB_SIZE for i in range(600)]
    lists = [[*prompt, first] for first in range(16)]
    last = [recent.validate(token_ids)[0] for token_ids in lists]
    for _ in range(40):  # past the hashed tail: every particle's tail is the loop's token
        for i, token_ids in enumerate(lists):
            token_ids = [*token_ids, 5] if fresh_lists else token_ids
            if not fresh_lists:
                token_ids.append(5)
            lists[i] = token_ids
            context, parent, _ = recent.validate(token_ids)
            assert parent is last[i], f"particle {i} lost its parent"
            assert context == tuple(token_ids)
            last[i] = context
    assert tail_hash(last[0]) == tail_hash(last[1]) and last[0] != last[1]
    assert recent._num_tokens <= recent.max_tokens


def test_contexts_held_by_their_whole_hash_stay_within_the_token_budget():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None, max_tokens=5000)
    prompt = [i % VOCAB_SIZE for i in range(400)]
    for first in range(40):
        recent.validate([*prompt, first, 5, 5])
        recent.validate([*prompt, first, 5, 5, 5])
        held = recent._by_hash.values()
        assert recent._num_tokens == sum(len(context) for context, _ in held) <= 5000
        assert recent._num_wholes == sum(type(key) is tuple for key in recent._by_hash)


def test_the_token_budget_forgets_the_oldest_and_keeps_the_newest_even_when_over_it():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None, max_tokens=100)
    small = [recent.validate([i, 1, 2])[0] for i in range(20)]  # 60 tokens: all held
    assert recent._num_tokens == 60 and len(recent._by_hash) == 20
    recent.validate([i % VOCAB_SIZE for i in range(50)])  # 110: the oldest go, 10 tokens' worth
    held = [context for context, _ in recent._by_hash.values()]
    assert held[0] == small[4] and recent._num_tokens == sum(map(len, held)) == 98
    long = recent.validate([i % VOCAB_SIZE for i in range(150)])[0]  # over the budget alone
    assert [context for context, _ in recent._by_hash.values()] == [long]
    assert recent._num_tokens == 150


def test_a_recent_parent_never_lets_a_bad_context_through():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=4)
    recent.validate([1, 2, 3])
    for bad, error in (
        ([1, 2, 3, VOCAB_SIZE], ValueError),
        ([1, 2, 3, -1], ValueError),
        ([1, 2, 3, 4.0], TypeError),
        ([1, 2, 3, True], TypeError),
        ([1, 2, 3, 4, 5], ValueError),  # longer than the model's context
    ):
        with pytest.raises(error):
            recent.validate(bad)
    long = list(range(40))
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    recent.validate(long)
    for element in (np.array([0, 1]), [0]):  # compared elementwise; unhashable
        with pytest.raises(TypeError, match=r"token_ids\[0\]"):
            recent.validate([element, *long[1:], 7])
        with pytest.raises(TypeError, match=r"token_ids\[39\]"):
            recent.validate([*long[:39], element, 7])
    with pytest.raises(TypeError, match=r"token_ids\[39\]"):  # a float unequal to the recent token
        recent.validate([*long[:39], 0.0, 7])
    mutated = [1, 2, 3]
    recent.validate(mutated)
    mutated[0] = VOCAB_SIZE  # the caller's list changes after its check: ours did not
    with pytest.raises(ValueError, match="outside the vocabulary"):
        recent.validate([*mutated, 4])


def test_a_prefix_equal_in_value_only_is_taken_as_the_recent_plain_ints():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    recent.validate([1, 2, 3])
    context, parent, *_ = recent.validate([np.int64(1), 2, 3, 4])
    assert context == (1, 2, 3, 4) and all(type(t) is int for t in context)
    assert parent == (1, 2, 3)


def test_recent_contexts_hold_at_most_their_token_budget():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None, max_tokens=100)
    for start in range(40):
        recent.validate([start % VOCAB_SIZE] * 10)
    assert recent._num_tokens <= 100 and len(recent._by_hash) == 10
    _, parent, *_ = recent.validate([39 % VOCAB_SIZE] * 10 + [1])  # the latest are kept
    assert parent is not None
    _, parent, *_ = recent.validate([0] * 10 + [1])  # the oldest were forgotten
    assert parent is None


@pytest.mark.skipif(kv_tree._GC_UNTRACK is None, reason="untracking needs CPython with the GIL")
def test_validated_contexts_are_left_to_reference_counting():
    """A context of plain ints is in no reference cycle: the garbage collector never reads it.

    Tracked, each particle's context (thousands of ints behind a long
    prompt) is read by the collection after its step, every step.
    """
    long = [i % VOCAB_SIZE for i in range(300)]
    given_kinds = (
        long,
        tuple(long),
        np.array(long),
        torch.tensor(long),
        [np.int64(t) for t in long],
    )
    for token_ids in given_kinds:
        context = validate_token_ids(token_ids, VOCAB_SIZE)
        assert context == tuple(long) and not gc.is_tracked(context)
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    recent.validate(long)
    context, parent, *_ = recent.validate([*long, 7])
    assert parent is not None and not gc.is_tracked(context)
    assert gc.is_tracked((object(),))  # the check above can fail: a fresh tuple is tracked
    assert len(long) >= kv_tree.UNTRACKED_LENGTH  # shorter ones are left to the collector


def test_recent_contexts_hold_at_most_their_count():
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None, max_contexts=8)
    for start in range(40):
        recent.validate([start % VOCAB_SIZE, 1, 2])
    assert 8 <= len(recent._by_hash) <= 8 + 8 // 4  # a quarter more before it forgets
    assert recent._num_tokens == 3 * len(recent._by_hash)
    _, parent, *_ = recent.validate([39 % VOCAB_SIZE, 1, 2, 3])  # the latest are kept
    assert parent is not None
    _, parent, *_ = recent.validate([0, 1, 2, 3])  # the oldest were forgotten
    assert parent is None


def test_recent_contexts_forget_down_to_the_limit_once_a_quarter_more_are_held():
    recent = RecentContexts(
        VOCAB_SIZE, max_context_length=None, max_contexts=1024, initial_contexts=16
    )
    contexts = [(i, 1, 2) for i in range(21)]
    for context in contexts[:20]:
        recent.validate(list(context))
    assert len(recent._by_hash) == 20 and not recent._ghosts  # 16 and a quarter: still held
    recent.validate(list(contexts[20]))
    held = {context for context, _ in recent._by_hash.values()}
    assert held == set(contexts[5:])  # the newest 16, the 5 oldest forgotten at once
    assert recent._num_tokens == 16 * 3 and len(recent._ghosts) == 5
    _, parent, _ = recent.validate([*contexts[0], 3])  # one forgotten for the count
    assert parent is None and recent.limit == 32


def _step_particles(recent: RecentContexts, lists: list[list[int]], step: int) -> int:
    """Each particle appends a token and is checked; how many found their last context."""
    found = 0
    for i, token_ids in enumerate(lists):
        token_ids.append((step * 31 + i) % VOCAB_SIZE)
        _, parent, _ = recent.validate(token_ids)
        found += parent is not None
    return found


def test_particles_a_few_steps_of_the_initial_limit_hold_stay_within_it():
    """Contexts of a few steps serve particles: the limit does not grow, and fewer contexts
    outlive a step (the collector's share of a particle's call)."""
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None, initial_contexts=64)
    lists = [[i % VOCAB_SIZE, 7] for i in range(16)]
    for step in range(40):
        assert _step_particles(recent, lists, step) == (16 if step else 0)
    assert recent.limit == 64 and 64 <= len(recent._by_hash) <= 64 + 64 // 4


def test_a_context_whose_recent_one_was_forgotten_doubles_the_limit():
    """More particles than the limit holds: their contexts are forgotten before they are
    extended, until the limit has doubled enough; then each finds its last one again."""
    recent = RecentContexts(
        VOCAB_SIZE, max_context_length=None, max_contexts=512, initial_contexts=32
    )
    lists = [[i % VOCAB_SIZE, 7, i // VOCAB_SIZE] for i in range(100)]
    found = [_step_particles(recent, lists, step) for step in range(8)]
    assert found[1] < 100 and found[-1] == 100  # forgotten at first, then held
    assert recent.limit == 128  # the first limit holding a step's 100 contexts
    assert len(recent._ghosts) <= recent.max_contexts - recent.limit
    lists = [[i % VOCAB_SIZE, 8, i // VOCAB_SIZE] for i in range(300)]
    found = [_step_particles(recent, lists, step) for step in range(6)]
    assert found[-1] == 300 and recent.limit == 512 == recent.max_contexts
    assert not recent._ghosts  # at the cap, nothing forgotten is remembered
    lists = [[i % VOCAB_SIZE, 9, i // VOCAB_SIZE] for i in range(2000)]  # past the cap
    for step in range(3):
        _step_particles(recent, lists, step)
    assert recent.limit == 512 and 512 <= len(recent._by_hash) <= 640 and not recent._ghosts


def test_contexts_forgotten_for_their_tokens_do_not_grow_the_limit():
    """Long contexts past ``max_tokens``: holding more of them is not the limit's to allow."""
    recent = RecentContexts(
        VOCAB_SIZE, max_context_length=None, max_tokens=1000, initial_contexts=64
    )
    lists = [[i % VOCAB_SIZE, *[7] * 100, i // VOCAB_SIZE] for i in range(16)]
    found = [_step_particles(recent, lists, step) for step in range(4)]
    assert found == [0, 0, 0, 0]  # 16 contexts of 100 tokens: 9 fit the tokens
    assert recent.limit == 64 and not recent._ghosts and recent._num_tokens <= 1000


def test_a_thousand_particles_grow_the_default_limit_in_their_first_steps():
    """docs/caching.md's figure: 1,024 at the second step, every context found from the fourth."""
    recent = RecentContexts(VOCAB_SIZE, max_context_length=None)
    lists = [[i % VOCAB_SIZE, 7, i // VOCAB_SIZE] for i in range(1000)]
    found = []
    for step in range(5):
        found.append(_step_particles(recent, lists, step))
        if step == 1:
            assert recent.limit == 1024
    assert found[3:] == [1000, 1000] and recent.limit == 1024


def test_threads_checking_contexts_at_once_get_the_full_checks_answers():
    """Several threads step their own particles through one front whose limit is small (so
    it forgets, remembers and grows while they run), switching as often as the interpreter
    lets them: every answer is the full check's, and what the front counts is what it holds."""
    import sys
    import threading

    recent = RecentContexts(
        VOCAB_SIZE, max_context_length=None, max_contexts=256, initial_contexts=8
    )
    errors: list[BaseException] = []

    def particles(seed: int) -> None:
        lists = [[seed, i % VOCAB_SIZE, 7] for i in range(24)]
        try:
            for step in range(30):
                for i, token_ids in enumerate(lists):
                    token_ids.append((seed * 7 + step * 31 + i) % VOCAB_SIZE)
                    context, parent, hashed = recent.validate(token_ids)
                    assert context == tuple(token_ids) and hashed == context_hash(context)
                    assert parent is None or parent == context[:-1]
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=particles, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    held = recent._by_hash
    assert recent._num_tokens == sum(len(context) for context, _ in held.values())
    assert recent._num_wholes == sum(isinstance(key, tuple) for key in held)
    assert len(held) <= recent.limit + recent.limit // 4 and recent.limit <= recent.max_contexts
    assert len(recent._ghosts) <= recent.max_contexts - recent.limit
    assert recent.limit > 8  # 96 particles a step: it grew


def test_forgotten_contexts_are_remembered_within_what_the_cap_would_hold():
    """A step larger than the cap's room beyond the limit: its first contexts' tails are
    forgotten before they are asked again, so they cannot grow the limit for nothing."""
    recent = RecentContexts(
        VOCAB_SIZE, max_context_length=None, max_contexts=256, initial_contexts=64
    )
    lists = [[i % VOCAB_SIZE, 7, i // VOCAB_SIZE] for i in range(1000)]
    for step in range(3):
        assert _step_particles(recent, lists, step) == 0
        assert len(recent._ghosts) <= 256 - 64
    assert recent.limit == 64


@pytest.mark.skipif(kv_tree._SAME_OBJECTS is None, reason="compares CPython's object layouts")
def test_same_objects_tells_a_recent_contexts_own_tokens_from_equal_ones():
    prefix = tuple(range(1000, 1300))
    assert kv_tree.same_objects((*prefix, 5), prefix)
    assert kv_tree.same_objects(tuple(list(prefix)), prefix)  # copies hold the same objects
    assert kv_tree.same_objects((), ()) and kv_tree.same_objects((1,), ())
    copied = tuple(int(str(t)) for t in prefix)  # equal values, other objects
    assert copied == prefix and not kv_tree.same_objects(copied, prefix)
    changed = [*prefix, 5]
    changed[150] = 7
    assert not kv_tree.same_objects(tuple(changed), prefix)
    assert not kv_tree.same_objects(prefix[:-1], prefix)  # shorter
    assert not kv_tree.same_objects([*prefix, 5], prefix)  # a list: the caller copies it first


def test_a_long_context_of_the_recent_ones_objects_or_of_equal_ones_is_checked_alike():
    """Past ``SAME_OBJECTS_FROM`` tokens, a context whose elements are the recent context's own
    objects is taken without a comparison of its tokens; one equal in value only, or changed
    anywhere, is compared or checked in full: the answer is always the full check's."""
    long = [1000 + i for i in range(kv_tree.SAME_OBJECTS_FROM + 40)]
    vocab_size = 2000
    recent = RecentContexts(vocab_size, max_context_length=None)
    first, _, _ = recent.validate(long)
    own = [*first, 7]
    context, parent, hashed = recent.validate(own)
    assert parent is first and context == tuple(own) and hashed == context_hash(context)
    equal = [int(str(t)) for t in first] + [8]
    context, parent, hashed = recent.validate(equal)
    assert parent is first and context == tuple(equal) and hashed == context_hash(context)
    changed = [*first, 9]
    changed[3] = 4
    context, parent, hashed = recent.validate(changed)
    assert parent is None and context == tuple(changed) and hashed == context_hash(context)
    bad = [*first, 9]
    bad[3] = vocab_size
    with pytest.raises(ValueError, match=r"token_ids\[3\]"):
        recent.validate(bad)
