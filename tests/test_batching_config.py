"""BatchingConfig: validation naming the field, immutability, and how a batch is cut."""

from __future__ import annotations

import dataclasses

import pytest

from genlm_backend.batching import BatchingConfig


@pytest.mark.parametrize(
    ("options", "field", "error_type"),
    [
        ({"max_batch_size": 0}, "max_batch_size", ValueError),
        ({"max_batch_size": -3}, "max_batch_size", ValueError),
        ({"max_batch_size": 2.0}, "max_batch_size", TypeError),
        ({"max_batch_size": True}, "max_batch_size", TypeError),
        ({"max_batch_tokens": 0}, "max_batch_tokens", ValueError),
        ({"max_batch_tokens": "64"}, "max_batch_tokens", TypeError),
        ({"timeout_s": -0.1}, "timeout_s", ValueError),
        ({"timeout_s": float("nan")}, "timeout_s", ValueError),
        ({"timeout_s": float("inf")}, "timeout_s", ValueError),
        ({"timeout_s": "0.1"}, "timeout_s", TypeError),
        ({"timeout_s": None}, "timeout_s", TypeError),
        ({"flush_on_idle": 1}, "flush_on_idle", TypeError),
    ],
)
def test_rejects_a_bad_field_naming_it(options, field, error_type):
    with pytest.raises(error_type, match=rf"^{field} must be") as error:
        BatchingConfig(**options)
    assert repr(next(iter(options.values()))) in str(error.value)


def test_defaults_have_no_count_and_no_budget():
    config = BatchingConfig()
    assert (
        config.max_batch_size,
        config.max_batch_tokens,
        config.timeout_s,
        config.flush_on_idle,
    ) == (
        None,
        None,
        0.02,
        True,
    )


def test_is_frozen_and_normalizes_timeout_to_float():
    config = BatchingConfig(timeout_s=1)
    assert isinstance(config.timeout_s, float) and config.timeout_s == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_size = 3


def test_without_limits_one_batch_takes_everything():
    assert BatchingConfig().next_batch_length([5] * 1000) == 1000
    assert BatchingConfig().split(list(range(7))) == [list(range(7))]


def test_token_budget_cuts_in_arrival_order():
    config = BatchingConfig(max_batch_tokens=10)
    # 4 + 4 fit, + 4 would be 12 > 10
    assert config.next_batch_length([4, 4, 4, 1]) == 2
    # arrival order is kept: the 1 behind the third 4 waits for the next batch
    assert config.split(["a", "b", "c", "d"], {"a": 4, "b": 4, "c": 4, "d": 1}.get) == [
        ["a", "b"],
        ["c", "d"],
    ]


def test_a_request_over_the_budget_goes_alone():
    config = BatchingConfig(max_batch_tokens=10)
    assert config.split(["small", "huge", "tiny"], {"small": 3, "huge": 50, "tiny": 1}.get) == [
        ["small"],
        ["huge"],
        ["tiny"],
    ]


def test_count_and_budget_both_bound_a_batch():
    config = BatchingConfig(max_batch_size=3, max_batch_tokens=100)
    assert config.next_batch_length([1] * 10) == 3  # count binds
    assert config.next_batch_length([60, 60, 1]) == 1  # budget binds
    assert config.split(list(range(7))) == [[0, 1, 2], [3, 4, 5], [6]]


def test_is_full_by_count_or_by_tokens():
    assert not BatchingConfig().is_full(10_000, 10**9)
    assert BatchingConfig(max_batch_size=4).is_full(4, 0)
    assert not BatchingConfig(max_batch_size=4).is_full(3, 10**9)
    assert BatchingConfig(max_batch_tokens=16).is_full(1, 16)
    assert not BatchingConfig(max_batch_tokens=16).is_full(100, 15)
