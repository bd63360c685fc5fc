"""Token: a bytes that carries its id; identity by id, ordering, helpers, immutability, pickling."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest

from genlm_backend.tokenization import Token
from genlm_backend.tokenization.token import make_tokens


def test_is_bytes_with_an_id_positional_or_keyword():
    token = Token(42, b"hello")
    assert Token(token_id=42, byte_string=b"hello") == token
    assert isinstance(token, bytes) and token.token_id == 42
    assert token.byte_string == b"hello" and type(token.byte_string) is bytes
    assert b" ".join([token, b"world"]) == b"hello world"
    assert token.decode() == "hello" and token.startswith(b"he") and next(iter(token)) == 104
    assert type(token[1:]) is bytes and token[1:] == b"ello"
    assert repr(token) == "Token(token_id=42, byte_string=b'hello')"


def test_tokens_are_equal_and_hash_alike_iff_their_ids_are():
    assert Token(1, b"a") == Token(1, b"a") and hash(Token(1, b"a")) == hash(Token(1, b"b"))
    assert Token(1, b"a") == Token(1, b"b")  # the id is the identity, across vocabularies too
    # ``not x == y`` and ``not x != y`` exercise __eq__ and __ne__ separately
    assert Token(1, b"a") != Token(2, b"a") and not Token(1, b"a") == Token(2, b"a")  # noqa: SIM201
    assert not Token(1, b"a") != Token(1, b"b")  # noqa: SIM202
    assert hash(Token(5, b"x")) == hash(5)


def test_same_bytes_different_ids_are_distinct_set_members_and_keys():
    """Gemma-3 has byte-identical pairs such as ids 107 and 248 (both b"\\n")."""
    first, second = Token(107, b"\n"), Token(248, b"\n")
    assert len({first, second}) == 2
    index = {first: "added", second: "byte piece"}
    assert index[Token(107, b"\n")] == "added" and index[Token(248, b"\n")] == "byte piece"
    assert len({first, Token(107, b"\n")}) == 1


def test_against_plain_bytes_the_bytes_comparisons_apply():
    token = Token(7, b"hello")
    assert token == b"hello" and token == b"hello" and not token != b"hello"  # noqa: SIM202
    assert token != b"other" and token != b"other"
    assert token <= b"hello" and token >= b"hello" and not token < b"hello"
    assert token < b"world" and token < b"world"
    assert token != "hello" and token != 7


def test_plain_bytes_keys_do_not_find_tokens():
    """The hash is the id's, so hashed containers keep tokens and plain bytes apart
    (clients rely on this to detect, and warn about, plain-bytes lookups)."""
    assert b"a" not in {Token(3, b"a"): 0}
    assert Token(3, b"a") not in {b"a"}


def test_tokens_order_by_id_not_bytes():
    z, a = Token(1, b"z"), Token(2, b"a")
    same_id = Token(1, b"q")
    assert z < a and a > z and z <= a and a >= z and z <= same_id and z >= same_id
    assert not a < z and not z > a
    assert sorted([a, z]) == [z, a]
    assert max([a, z]) is a


def test_as_bytes_and_is_plain_bytes():
    token = Token(0, b"hi")
    assert Token.as_bytes(token) == b"hi" and type(Token.as_bytes(token)) is bytes
    assert Token.as_bytes(b"x") == b"x"
    sentinel = object()
    assert Token.as_bytes(sentinel) is sentinel
    assert token.as_bytes(token) == b"hi"
    assert Token.is_plain_bytes(b"x") and not Token.is_plain_bytes(token)
    assert not Token.is_plain_bytes("x") and not Token.is_plain_bytes(bytearray(b"x"))
    assert not Token.is_plain_bytes(3)


def test_immutable():
    token = Token(1, b"a")
    with pytest.raises(AttributeError, match="immutable"):
        token.token_id = 2
    with pytest.raises(AttributeError, match="immutable"):
        del token.token_id
    assert token.token_id == 1


@pytest.mark.parametrize("token_id", [1.0, "1", None, True])
def test_bad_token_id_is_a_type_error(token_id):
    with pytest.raises(TypeError, match="token_id must be an int"):
        Token(token_id, b"a")


@pytest.mark.parametrize("byte_string", ["a", bytearray(b"a"), None, [97]])
def test_bad_byte_string_is_a_type_error(byte_string):
    with pytest.raises(TypeError, match="byte_string must be bytes"):
        Token(0, byte_string)


def test_a_token_is_accepted_as_byte_string():
    assert Token(3, Token(9, b"ab")).byte_string == b"ab"


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_keeps_the_id_and_bytes(protocol):
    token = Token(5, b"\xff\x00")
    restored = pickle.loads(pickle.dumps(token, protocol=protocol))
    assert type(restored) is Token and restored.token_id == 5
    assert restored.byte_string == b"\xff\x00"


def test_copies_keep_id_and_bytes():
    token = Token(9, b"x")
    for duplicate in (copy.copy(token), copy.deepcopy(token), copy.deepcopy([token])[0]):
        assert type(duplicate) is Token and duplicate.token_id == 9
        assert duplicate.byte_string == b"x"


def test_make_tokens_equals_the_constructor_and_restores_gc():
    assert gc.isenabled()
    byte_strings = [b"a", b"a", b""]
    tokens = make_tokens(byte_strings)
    expected = [Token(i, b) for i, b in enumerate(byte_strings)]
    assert [(t.token_id, t.byte_string, type(t)) for t in tokens] == [
        (t.token_id, t.byte_string, type(t)) for t in expected
    ]
    assert tokens[0] != tokens[1]
    assert gc.isenabled()
    gc.disable()
    try:
        make_tokens([b"a"])
        assert not gc.isenabled()
    finally:
        gc.enable()
