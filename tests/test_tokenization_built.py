"""decode_vocab on tokenizers built here: SentencePiece-style with byte fallback,
slow (Python) tokenizers with and without a byte_decoder, unsupported decoders, fallbacks."""

from __future__ import annotations

import io
import itertools
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from genlm_backend import assets
from genlm_backend.errors import VocabularyDecodeError
from genlm_backend.tokenization import BYTE2STR_FALLBACKS, STR_FALLBACKS, decode_vocab
from tests.tokenization_reference import published_bytes_to_unicode

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "Numbers such as 123 and 4567 appear here, with some punctuation!",
] * 20
BYTE_PIECES = [f"<0x{byte:02X}>" for byte in range(256)]
SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def build_sentencepiece_style_tokenizer():
    """A Llama-2-style fast tokenizer: BPE with ``<0xNN>`` byte fallback, ``▁`` for
    spaces (prepended to the text), decoder Replace + ByteFallback + Fuse + Strip."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    metaspace = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = metaspace
    learner.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=200, limit_alphabet=60, show_progress=False)
    )
    learned = json.loads(learner.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {piece: i for i, piece in enumerate(specials + BYTE_PIECES)}
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    backend = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    backend.pre_tokenizer = metaspace
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module")
def sentencepiece_style():
    tokenizer = build_sentencepiece_style_tokenizer()
    return (tokenizer, *decode_vocab(tokenizer))


@pytest.fixture(scope="module")
def slow_byte_level(load_test_tokenizer):
    """transformers 5's one remaining slow byte-level BPE class (CLVP), over GPT-2's files."""
    from transformers import ClvpTokenizer

    folder = assets.tokenizer_dir("gpt2")
    tokenizer = ClvpTokenizer(
        vocab_file=str(folder / "encoder.json"), merges_file=str(folder / "vocab.bpe")
    )
    return (tokenizer, *decode_vocab(tokenizer))


@pytest.fixture(scope="module")
def slow_sentencepiece(tmp_path_factory):
    """A slow SentencePiece tokenizer (``SentencePieceBackend``) over a model trained
    here with byte fallback, identity normalization and no dummy prefix."""
    spm = pytest.importorskip("sentencepiece", reason="slow SentencePiece tokenizers need it")
    from transformers import BertGenerationTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "sp.model"
    path.write_bytes(model.getvalue())
    tokenizer = BertGenerationTokenizer(vocab_file=str(path))
    return (tokenizer, *decode_vocab(tokenizer))


# ---------------------------------------------------------------- SentencePiece style (fast)


def test_sentencepiece_style_pieces(sentencepiece_style):
    tokenizer, byte_vocab, _ = sentencepiece_style
    assert len(byte_vocab) == len(tokenizer)
    for byte, piece in enumerate(BYTE_PIECES):
        assert byte_vocab[tokenizer.convert_tokens_to_ids(piece)] == bytes([byte])
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))):
        if piece not in BYTE_PIECES:
            assert byte_vocab[token_id] == piece.replace("\u2581", " ").encode("utf-8")


@SETTINGS
@given(text=st.text(max_size=40))
@example(text="\u2581a b")  # the space marker itself
@example(text="<s> x</s>")  # starts with a special token
def test_sentencepiece_style_round_trip(sentencepiece_style, text):
    """The join holds the space Metaspace prepends to the text's first piece (none
    when the text starts with a special token, whose text is its own); the decoder's
    Strip removes one leading space from the whole text; a literal ``▁`` in the
    text comes back as a space."""
    tokenizer, byte_vocab, _ = sentencepiece_style
    ids = tokenizer.encode(text, add_special_tokens=False)
    spaced = text.replace("\u2581", " ")
    starts_special = text.startswith(tuple(tokenizer.all_special_tokens))
    prepended = bool(spaced) and not spaced.startswith(" ") and not starts_special
    expected = " " + spaced if prepended else spaced
    assert b"".join(byte_vocab[i] for i in ids) == expected.encode("utf-8")
    assert tokenizer.decode(ids) == expected.removeprefix(" ")


def test_metaspace_decoder_step():
    """Metaspace's decoder drops every ``▁`` of the *first* token of a sequence; per
    token (any position but the first) it is a space."""
    from tokenizers import decoders

    from genlm_backend.tokenization.decoders import decode_with_decoder

    step = decoders.Metaspace(prepend_scheme="first")
    assert step.decode(["x", "\u2581a", "b\u2581"]) == "x ab "
    description = json.loads(step.__getstate__())
    assert decode_with_decoder(description, ["\u2581a", "b\u2581"]) == [b" a", b"b "]


# ---------------------------------------------------------------- slow, with a byte_decoder


def test_slow_byte_level_matches_published_table(slow_byte_level):
    tokenizer, byte_vocab, _ = slow_byte_level
    assert not hasattr(tokenizer, "backend_tokenizer") and isinstance(tokenizer.byte_decoder, dict)
    char_to_byte = {char: byte for byte, char in published_bytes_to_unicode().items()}
    added = tokenizer.added_tokens_decoder
    assert len(byte_vocab) == len(tokenizer) == 50259
    for token_id, spelled in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))):
        if token_id in added:
            assert byte_vocab[token_id] == added[token_id].content.encode("utf-8")
        else:
            assert byte_vocab[token_id] == bytes(char_to_byte[c] for c in spelled), token_id


@SETTINGS
@given(text=st.text(max_size=40))
def test_slow_byte_level_joins_to_its_decode(slow_byte_level, text):
    """CLVP lower-cases and transliterates before encoding, so the text itself does
    not come back; the joined bytes equal what the tokenizer decodes."""
    tokenizer, byte_vocab, _ = slow_byte_level
    ids = tokenizer.encode(text, add_special_tokens=False)
    joined = b"".join(byte_vocab[i] for i in ids)
    assert joined.decode("utf-8", "replace") == tokenizer.decode(
        ids, clean_up_tokenization_spaces=False
    )


# ---------------------------------------------------------------- slow SentencePiece


@SETTINGS
@given(text=st.text(max_size=40))
@example(text="a\u2581b\u2581")  # SentencePiece's own space marker
@example(text="x</s>y<s><unk><pad>")  # special tokens' text
def test_slow_sentencepiece_round_trip(slow_sentencepiece, text):
    """SentencePiece escapes every space as ``▁`` before encoding, so a literal ``▁``
    in the text is read as a space: the byte vocabulary gives ``b" "`` for it, as
    SentencePiece's own decode does. A special token's text in the text is that
    token, its own text in the byte vocabulary; SentencePiece's decode drops control
    symbols (``</s>``), spells ``<unk>`` as ``⁇`` and knows no added token (``<pad>``),
    so it is the reference on the runs between special tokens. (transformers' slow
    ``decode`` is no reference: it spells byte pieces as ``<0xC3>``.)"""
    tokenizer, byte_vocab, _ = slow_sentencepiece
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(byte_vocab[i] for i in ids) == text.replace("\u2581", " ").encode("utf-8")
    special = set(tokenizer.all_special_ids)
    for is_special, run in itertools.groupby(ids, key=special.__contains__):
        if not is_special:
            run_ids = list(run)
            joined = b"".join(byte_vocab[i] for i in run_ids)
            assert joined == tokenizer.sp_model.decode(run_ids).encode("utf-8")


def test_slow_sentencepiece_specials(slow_sentencepiece):
    tokenizer, byte_vocab, _ = slow_sentencepiece
    assert byte_vocab[tokenizer.eos_token_id] == b"</s>"
    assert byte_vocab[tokenizer.convert_tokens_to_ids("<0xE6>")] == b"\xe6"


# ---------------------------------------------------------------- fallbacks and errors


def reference_strings(tokenizer, byte_vocab, fallback: str) -> list[str]:
    """Each token's UTF-8 string, or the fallback spelled out per token (brute force)."""
    strings = []
    for token_id, token in enumerate(byte_vocab):
        if _is_utf8(token):
            strings.append(bytes(token).decode("utf-8"))
        elif fallback == "tokenizer":
            strings.append(tokenizer.convert_ids_to_tokens(token_id))
        elif fallback == "latin1":
            strings.append("".join(map(chr, token)))
        else:
            strings.append(bytes(token).decode("utf-8", fallback))
    return strings


def test_str_fallbacks(sentencepiece_style):
    tokenizer, byte_vocab, default_strings = sentencepiece_style
    lone = tokenizer.convert_tokens_to_ids("<0x80>")
    expected = {
        "tokenizer": "<0x80>",
        "latin1": "\x80",
        "replace": "\ufffd",
        "surrogateescape": "\udc80",
        "backslashreplace": "\\x80",
    }
    assert default_strings == reference_strings(tokenizer, byte_vocab, "tokenizer")
    for fallback, spelled in expected.items():
        _, str_vocab = decode_vocab(tokenizer, fallback)
        _, by_old_name = decode_vocab(tokenizer, str_fallback=fallback)
        assert str_vocab[lone] == spelled
        assert str_vocab == by_old_name == reference_strings(tokenizer, byte_vocab, fallback)
    _, lossless = decode_vocab(tokenizer, byte2str_fallback="surrogateescape")
    assert [s.encode("utf-8", "surrogateescape") for s in lossless] == byte_vocab
    assert set(STR_FALLBACKS) == set(BYTE2STR_FALLBACKS) == {*expected, "strict"}


def test_strict_fallback_names_the_first_invalid_token(sentencepiece_style):
    tokenizer, byte_vocab, _ = sentencepiece_style
    first = next(t for t in byte_vocab if not _is_utf8(t))
    with pytest.raises(
        VocabularyDecodeError, match=r"PreTrainedTokenizerFast|TokenizersBackend"
    ) as info:
        decode_vocab(tokenizer, str_fallback="strict")
    assert f"token id {first.token_id} " in str(info.value)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_unknown_str_fallback_is_rejected(sentencepiece_style):
    tokenizer = sentencepiece_style[0]
    with pytest.raises(ValueError, match="Unknown byte2str_fallback strategy: 'latin-1'"):
        decode_vocab(tokenizer, str_fallback="latin-1")
    with pytest.raises(ValueError, match="Unknown byte2str_fallback strategy: 'invalid'"):
        decode_vocab(tokenizer, byte2str_fallback="invalid")
    with pytest.raises(ValueError, match="not both"):
        decode_vocab(tokenizer, "latin1", str_fallback="replace")


def test_wordpiece_decoder_is_refused():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "play": 1, "##ing": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    with pytest.raises(
        VocabularyDecodeError, match=r"TokenizersBackend.*token id 0 \('\[UNK\]'\).*WordPiece"
    ):
        decode_vocab(PreTrainedTokenizerFast(tokenizer_object=backend))
    backend.decoder = None
    with pytest.raises(VocabularyDecodeError, match=r"Tokenizer: .*token id 0 .*no decoder"):
        decode_vocab(backend)


class _SlowByteLevel:
    """A minimal slow tokenizer: a byte_decoder and a vocabulary, nothing else."""

    def __init__(self, tokens: list[str | None]):
        self.tokens = tokens
        self.byte_decoder = {c: b for b, c in published_bytes_to_unicode().items()}
        self.added_tokens_decoder = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]


def test_slow_token_outside_the_byte_table_is_refused():
    assert decode_vocab(_SlowByteLevel(["a", "\u0120b"]))[0] == [b"a", b" b"]
    with pytest.raises(
        VocabularyDecodeError, match=r"_SlowByteLevel.*token id 1 \('\u20ac'\).*byte_decoder"
    ):
        decode_vocab(_SlowByteLevel(["a", "\u20ac", "c"]))


def test_hole_in_the_id_range_is_refused():
    with pytest.raises(
        VocabularyDecodeError, match=r"_SlowByteLevel.*token id 1 \(None\).*no token string"
    ):
        decode_vocab(_SlowByteLevel(["a", None]))


def test_tokenizer_without_known_structure_is_refused():
    class CharTokenizer:
        def __len__(self):
            return 2

        def convert_ids_to_tokens(self, ids):
            return ["x", "y"][: len(ids)]

    with pytest.raises(VocabularyDecodeError, match=r"CharTokenizer.*token id 0 \('x'\)"):
        decode_vocab(CharTokenizer())
