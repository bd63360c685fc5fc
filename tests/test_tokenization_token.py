"""Token: a bytes that carries its id; equality, hashing, immutability, pickling."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest

from genlm_backend.tokenization import Token
from genlm_backend.tokenization.token import make_tokens


def test_is_bytes_with_an_id():
    token = Token(b"hello", 42)
    assert isinstance(token, bytes) and token.token_id == 42
    assert token.byte_string == b"hello" and type(token.byte_string) is bytes
    assert b" ".join([token, b"world"]) == b"hello world"
    assert token.decode() == "hello" and token.startswith(b"he")
    assert type(token[1:]) is bytes and token[1:] == b"ello"
    assert repr(token) == "Token(b'hello', token_id=42)"


def test_equality_with_plain_bytes_compares_bytes():
    token = Token(b"a", 7)
    assert token == b"a" and b"a" == token
    assert not token != b"a"
    assert token != b"b" and b"b" != token
    assert hash(token) == hash(b"a")
    assert token == bytearray(b"a")


def test_equality_between_tokens_needs_same_bytes_and_id():
    assert Token(b"a", 1) == Token(b"a", 1)
    assert Token(b"a", 1) != Token(b"a", 2)
    assert Token(b"a", 1) != Token(b"b", 1)
    assert not Token(b"a", 1) == Token(b"a", 2)


def test_same_bytes_different_ids_are_distinct_set_members_and_keys():
    first, second = Token(b"\n", 107), Token(b"\n", 248)
    assert len({first, second}) == 2
    index = {first: "added", second: "byte piece"}
    assert index[Token(b"\n", 107)] == "added" and index[Token(b"\n", 248)] == "byte piece"
    assert len({first, Token(b"\n", 107)}) == 1


def test_plain_bytes_key_finds_a_token_with_those_bytes():
    """Documented consequence of bytes compatibility: mixing plain bytes and tokens
    in one container keys them by content."""
    assert Token(b"a", 3) in {b"a"}
    assert {b"a": 1}[Token(b"a", 3)] == 1


def test_immutable():
    token = Token(b"a", 1)
    with pytest.raises(AttributeError, match="immutable"):
        token.token_id = 2
    with pytest.raises(AttributeError, match="immutable"):
        del token.token_id
    assert token.token_id == 1


@pytest.mark.parametrize("token_id", [-1, 1.0, "1", None, True])
def test_bad_token_id_is_rejected(token_id):
    with pytest.raises(ValueError, match="token_id"):
        Token(b"a", token_id)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_keeps_the_id(protocol):
    token = Token(b"\xff\x00", 5)
    restored = pickle.loads(pickle.dumps(token, protocol=protocol))
    assert type(restored) is Token and restored.token_id == 5 and restored == token


def test_copies_are_the_token():
    token = Token(b"x", 9)
    assert copy.copy(token) is token and copy.deepcopy([token])[0] is token


def test_make_tokens_numbers_by_position_and_restores_gc():
    assert gc.isenabled()
    tokens = make_tokens([b"a", b"a", b""])
    assert [t.token_id for t in tokens] == [0, 1, 2] and tokens == [b"a", b"a", b""]
    assert all(type(t) is Token for t in tokens) and tokens[0] != tokens[1]
    assert gc.isenabled()
    gc.disable()
    try:
        make_tokens([b"a"])
        assert not gc.isenabled()
    finally:
        gc.enable()
