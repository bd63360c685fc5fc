"""Errors of batch calls name the index of the bad context; single calls name ``token_ids``."""

from __future__ import annotations

import enum
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from genlm_backend.llm import MockAsyncLM
from genlm_backend.llm.validation import _general_ids, _plain_ids_in_range, validate_contexts

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
