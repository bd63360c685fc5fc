"""decode_vocab on real tokenizers: GPT-2's published byte table, round trips, decode agreement."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_backend import assets
from genlm_backend.tokenization import Token, decode_vocab
from tests.tokenization_reference import published_bytes_to_unicode

REAL_TOKENIZERS = ("gpt2", "qwen3", "llama3", "gemma3", "deepseek_v3", "smollm2")


@pytest.fixture(scope="session")
def deepseek_v3_tokenizer():
    """DeepSeek-V3 built from its tokenizer.json alone, whatever tokenizer class
    its config names (some transformers releases rebuild that class with
    SentencePiece decoding)."""
    from transformers import PreTrainedTokenizerFast

    path = assets.tokenizer_dir("deepseek_v3") / "tokenizer.json"
    return PreTrainedTokenizerFast(
        tokenizer_file=str(path),
        bos_token="<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        eos_token="<\uff5cend\u2581of\u2581sentence\uff5c>",
    )


@pytest.fixture(scope="session")
def real_tokenizer(request, load_test_tokenizer):
    """``real_tokenizer(name)``: a real tokenizer of :data:`REAL_TOKENIZERS`."""

    def get(name):
        if name == "smollm2":
            return request.getfixturevalue("smollm2_tokenizer")
        if name == "deepseek_v3":
            return request.getfixturevalue("deepseek_v3_tokenizer")
        return load_test_tokenizer(name)

    return get


@pytest.fixture(scope="session")
def vocab_of(real_tokenizer):
    """``vocab_of(name)``: ``(tokenizer, byte_vocab, str_vocab)``, decoded once."""
    cache = {}

    def get(name):
        if name not in cache:
            tokenizer = real_tokenizer(name)
            cache[name] = (tokenizer, *decode_vocab(tokenizer))
        return cache[name]

    return get


@pytest.mark.parametrize("name", REAL_TOKENIZERS)
def test_one_token_per_id_with_its_id(vocab_of, name):
    tokenizer, byte_vocab, str_vocab = vocab_of(name)
    assert len(byte_vocab) == len(str_vocab) == len(tokenizer)
    assert all(type(token) is Token for token in byte_vocab)
    assert [token.token_id for token in byte_vocab] == list(range(len(tokenizer)))
    assert all(token for token in byte_vocab), "no token decodes to empty bytes"


def test_gpt2_matches_published_byte_table(vocab_of):
    """Every entry of GPT-2's encoder.json, mapped through the published table."""
    _, byte_vocab, _ = vocab_of("gpt2")
    char_to_byte = {char: byte for byte, char in published_bytes_to_unicode().items()}
    encoder = json.loads((assets.tokenizer_dir("gpt2") / "encoder.json").read_text("utf-8"))
    assert len(encoder) == len(byte_vocab) == 50257
    for spelled, token_id in encoder.items():
        if spelled == "<|endoftext|>":
            expected = b"<|endoftext|>"
        else:
            expected = bytes(char_to_byte[char] for char in spelled)
        assert byte_vocab[token_id] == expected, (token_id, spelled)
    assert byte_vocab[220] == b" " and byte_vocab[198] == b"\n"


@pytest.mark.parametrize("name", REAL_TOKENIZERS)
def test_special_and_added_tokens_are_their_text(vocab_of, name):
    tokenizer, byte_vocab, str_vocab = vocab_of(name)
    added = tokenizer.added_tokens_decoder
    assert added, f"{name} has added tokens"
    for token_id, added_token in added.items():
        if name == "deepseek_v3" or "\u2581" not in added_token.content:
            assert byte_vocab[token_id] == added_token.content.encode("utf-8")
            assert str_vocab[token_id] == added_token.content
    if tokenizer.eos_token_id is not None:
        assert byte_vocab[tokenizer.eos_token_id] == tokenizer.eos_token.encode("utf-8")


@pytest.mark.parametrize("name", REAL_TOKENIZERS)
def test_agrees_with_single_token_decode(vocab_of, name):
    """On a sample of ids, the tokenizer's own one-token decode equals our bytes
    read as UTF-8 (U+FFFD for invalid bytes, as ``decode`` does)."""
    tokenizer, byte_vocab, _ = vocab_of(name)
    ids = random.Random(0).sample(range(len(tokenizer)), 3000)
    decoded = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    for token_id, text in zip(ids, decoded):
        assert byte_vocab[token_id].decode("utf-8", "replace") == text, token_id


def expected_text(name: str, text: str) -> str:
    """What the tokenizer's encode -> decode gives back for ``text`` (in its lossless domain).

    Qwen3 NFC-normalizes; Gemma-3 encodes spaces as ``▁`` and so decodes a literal
    ``▁`` as a space. The byte-level tokenizers without a normalizer round-trip.
    """
    if name == "qwen3":
        return unicodedata.normalize("NFC", text)
    if name == "gemma3":
        return text.replace("\u2581", " ")
    return text


def bytes_without_token(tokenizer) -> set[int]:
    """Bytes a byte-level BPE cannot encode: their character is not in the vocabulary.

    SmolLM2 lacks 21 (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1-0xFF),
    and its BPE has no unknown token, so encode silently drops them: text with a
    code point of U+40000 or above, or one of those control characters, does not
    round-trip through SmolLM2's own tokenizer.
    """
    vocab = tokenizer.get_vocab()
    return {byte for byte, char in published_bytes_to_unicode().items() if char not in vocab}


_MISSING_BYTES: dict[int, set[int]] = {}


def smollm2_missing_bytes(tokenizer) -> set[int]:
    if id(tokenizer) not in _MISSING_BYTES:
        _MISSING_BYTES[id(tokenizer)] = bytes_without_token(tokenizer)
    return _MISSING_BYTES[id(tokenizer)]


@pytest.mark.parametrize("name", REAL_TOKENIZERS)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=40))
def test_token_bytes_join_to_the_text(vocab_of, name, text):
    tokenizer, byte_vocab, _ = vocab_of(name)
    ids = tokenizer.encode(text, add_special_tokens=False)
    joined = b"".join(byte_vocab[i] for i in ids)
    decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert joined.decode("utf-8", "replace") == decoded
    if name == "smollm2" and set(text.encode("utf-8")) & smollm2_missing_bytes(tokenizer):
        return  # outside the tokenizer's lossless domain, checked by the line above
    expected = expected_text(name, text)
    assert decoded == expected
    assert joined == expected.encode("utf-8")


def test_smollm2_drops_bytes_missing_from_its_vocabulary(vocab_of):
    tokenizer, byte_vocab, _ = vocab_of("smollm2")
    missing = bytes_without_token(tokenizer)
    assert len(missing) == 21 and {0x04, 0xC0, 0xF1, 0xFF} <= missing
    ids = tokenizer.encode("a\x04b\U00040000", add_special_tokens=False)
    assert b"".join(byte_vocab[i] for i in ids) == b"ab\x80\x80\x80"


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "llama3", "smollm2", "deepseek_v3"])
def test_special_token_inside_text(vocab_of, name):
    tokenizer, byte_vocab, _ = vocab_of(name)
    special = tokenizer.eos_token
    text = f"one {special} two\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.eos_token_id in ids
    assert b"".join(byte_vocab[i] for i in ids) == text.encode("utf-8")


def test_gemma3_byte_fallback_pieces(vocab_of):
    tokenizer, byte_vocab, str_vocab = vocab_of("gemma3")
    for byte in (0x00, 0x0A, 0x80, 0xFF):
        token_id = tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>")
        assert byte_vocab[token_id] == bytes([byte])
    lone = tokenizer.convert_tokens_to_ids("<0x80>")
    assert str_vocab[lone] == "<0x80>"  # default byte2str_fallback="tokenizer": its own spelling
    space_piece = tokenizer.convert_tokens_to_ids("\u2581the")
    assert byte_vocab[space_piece] == b" the"
    two_spaces = tokenizer.convert_tokens_to_ids("\u2581\u2581")
    assert two_spaces in tokenizer.added_tokens_decoder and byte_vocab[two_spaces] == b"  "
    assert tokenizer.encode("x  y", add_special_tokens=False)[1] == two_spaces


def test_gemma3_same_bytes_different_ids_stay_distinct(vocab_of):
    _, byte_vocab, _ = vocab_of("gemma3")
    by_bytes: dict[bytes, list[int]] = {}
    for token in byte_vocab:
        by_bytes.setdefault(bytes(token), []).append(token.token_id)
    shared = {b: ids for b, ids in by_bytes.items() if len(ids) > 1}
    assert shared, "Gemma-3 has tokens with identical bytes"
    assert len(set(byte_vocab)) == len(byte_vocab)
    index = {token: token.token_id for token in byte_vocab}
    assert len(index) == len(byte_vocab)
    for ids in shared.values():
        assert [index[byte_vocab[i]] for i in ids] == ids


def test_deepseek_v3_bytes_are_byte_level(vocab_of, load_test_tokenizer):
    """DeepSeek-V3 is byte-level BPE: ``\u0120the`` is ``b" the"``, and the tokenizer
    ``assets.load_tokenizer`` builds (whatever class transformers picks) has the
    same exact bytes for every token and round-trips spaces."""
    tokenizer, byte_vocab, _ = vocab_of("deepseek_v3")
    the = tokenizer.convert_tokens_to_ids("\u0120the")
    assert byte_vocab[the] == b" the"
    assert byte_vocab[tokenizer.convert_tokens_to_ids("\u010a")] == b"\n"
    loaded = load_test_tokenizer("deepseek_v3")
    assert decode_vocab(loaded)[0] == byte_vocab
    assert loaded.decode(loaded.encode("a b\n c", add_special_tokens=False)) == "a b\n c"
