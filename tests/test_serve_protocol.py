"""The ``/v1/logprobs`` body: contexts sent as the tokens each adds to the one before it.

Reference: the contexts themselves; decoding what was encoded gives them
back exactly, and the body carries only the tokens not shared with the
context before.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genlm_backend.errors import RequestTooLargeError
from genlm_backend.llm.remote import protocol

LIMITS = protocol.ServeLimits(max_rows=16, max_context_length=64, max_body_bytes=1 << 16)

_IDS = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@st.composite
def batches(draw, first_size=(0, 40)):
    """Contexts that share prefixes with the one before them, as particles behind a prompt do."""
    contexts = [draw(st.lists(_IDS, min_size=first_size[0], max_size=first_size[1]))]
    for _ in range(draw(st.integers(0, 15))):
        keep = draw(st.integers(0, len(contexts[-1])))
        contexts.append(contexts[-1][:keep] + draw(st.lists(_IDS, max_size=24)))
    return contexts


@given(batches(), st.booleans())
def test_decoding_an_encoded_batch_gives_its_contexts_back(contexts, as_tuples):
    _check_round_trip(contexts, as_tuples, LIMITS)


@given(batches(first_size=(250, 400)), st.booleans())
def test_long_contexts_round_trip_and_share_all_they_can(contexts, as_tuples):
    # Past 256 ids the shared part is found another way (numpy, not integers).
    _check_round_trip(contexts, as_tuples, LONG_LIMITS)


LONG_LIMITS = protocol.ServeLimits(max_rows=16, max_context_length=800, max_body_bytes=1 << 20)


def _check_round_trip(contexts, as_tuples, limits):
    sent = [tuple(c) for c in contexts] if as_tuples else contexts
    body = protocol.encode_logprobs_request(sent, [None] * len(sent), client="c", slab_row=2)
    request = protocol.decode_logprobs_request(body, limits)
    assert request.contexts == [tuple(c) for c in contexts]
    assert all(type(c) is tuple for c in request.contexts)
    assert (request.client, request.slab_row) == ("c", 2)
    fields = protocol.unpack(body)
    for i, (context, common) in enumerate(zip(contexts, fields["shared"])):
        before = contexts[i - 1] if i else []
        assert context[:common] == before[:common]  # shared with the one before
        assert (
            common == len(context)
            or i == 0
            or common == len(before)
            or (context[common] != before[common])
        )  # and as much as it shares
    assert len(fields["ids"]) == 4 * (sum(map(len, contexts)) - sum(fields["shared"]))


def test_particles_behind_a_prompt_carry_the_prompt_once():
    prompt = list(range(1000, 1050))
    contexts = [prompt + [t, t + 1] for t in range(8)]
    body = protocol.encode_logprobs_request(contexts, [None] * 8)
    assert protocol.unpack(body)["shared"] == [0] + [50] * 7
    assert len(protocol.unpack(body)["ids"]) == 4 * (52 + 7 * 2)


def test_ids_beyond_32_bits_are_refused_when_encoding():
    with pytest.raises(ValueError, match="ints of 32 bits"):
        protocol.encode_logprobs_request([[2**31]], [None])


@pytest.mark.parametrize(
    ("lengths", "shared", "num_ids", "message"),
    [
        ([3, 3], [1, 0], 5, "0 for the first"),
        ([3, 2], [0, 3], 2, "the length of its context and of the one before"),
        ([2, 5], [0, 3], 4, "the length of its context and of the one before"),
        ([3, 3], [0, -1], 7, "an int from 0"),
        ([3, 3], [0, 2], 5, "leave 4 new tokens, ids hold 5"),
        ([3], [0, 0], 3, "one entry per context"),
    ],
)
def test_malformed_sharing_is_refused(lengths, shared, num_ids, message):
    body = protocol.pack(
        {
            "lengths": lengths,
            "shared": shared,
            "ids": b"\0" * 4 * num_ids,
            "lora_names": [None] * len(lengths),
        }
    )
    with pytest.raises(ValueError, match=message):
        protocol.decode_logprobs_request(body, LIMITS)


def test_shared_tokens_count_against_the_request_s_token_budget():
    contexts = [list(range(64))] * 16  # 1,024 tokens, 64 of them in the body
    budget = protocol.ServeLimits(max_rows=16, max_context_length=64, max_body_bytes=6000)
    assert budget.max_batch_tokens < 1024
    body = protocol.encode_logprobs_request(contexts, [None] * 16)
    assert len(body) < 1024
    with pytest.raises(RequestTooLargeError, match="1024 context tokens in one request"):
        protocol.decode_logprobs_request(body, budget)


def test_adapter_versions_travel_with_their_contexts_and_are_checked():
    body = protocol.encode_logprobs_request([[1], [2]], ["a", None], lora_versions=[7, None])
    assert protocol.decode_logprobs_request(body, LIMITS).lora_versions == [7, None]
    assert (
        protocol.decode_logprobs_request(
            protocol.encode_logprobs_request([[1]], ["a"]), LIMITS
        ).lora_versions
        is None
    )  # a client that sends none (an older one)
    for versions in ([7], [7, -1], [7, "7"], "7"):
        fields = protocol.unpack(body)
        fields["lora_versions"] = versions
        with pytest.raises(ValueError, match="'lora_versions' must hold an int >= 0 or nil"):
            protocol.decode_logprobs_request(protocol.pack(fields), LIMITS)
