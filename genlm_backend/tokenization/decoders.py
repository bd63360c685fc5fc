"""Per-token bytes from a ``tokenizers`` decoder description.

A Hugging Face ``tokenizers`` decoder turns a whole token sequence into text.
Most of its steps act on each token alone; those steps are replayed here on
every vocabulary entry, with the outcome kept as bytes instead of the lossy
string ``decode`` returns:

* ``ByteLevel``: each character of the token is looked up in GPT-2's
  byte-to-unicode table; a token with any character outside the table is
  taken as its own UTF-8 bytes (this is what ``tokenizers`` does, and how
  added tokens such as ``<|endoftext|>`` or ``"\\n"`` decode).
* ``Replace`` with a plain-string pattern (SentencePiece's ``▁`` -> ``" "``).
* ``Metaspace``: its replacement character -> ``" "``.
* ``ByteFallback``: a token spelled ``<0xNN>`` is the single byte ``0xNN``.
* ``Fuse`` (joins tokens) and ``Strip`` (trims the *start or end of the decoded
  text*) act on the sequence, not on a token, and are skipped: a token keeps
  its leading ``▁`` space even where ``decode`` would trim it at the start.

Any other step (``WordPiece``, ``BPEDecoder``, ``CTC``, a regex ``Replace``) or
no decoder at all makes a token's bytes depend on its neighbours and raises
:class:`UnsupportedDecoderError`.
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Stands for a character outside the byte-level table in ``_byte_level_table``;
# any code point above 255 would do, since it makes the latin-1 encode fail.
_NOT_A_BYTE = "\uffff"

Piece = str | bytes  # str until a step fixes the token's bytes, bytes after


class UnsupportedDecoderError(Exception):
    """A decoder step whose output for a token depends on the other tokens."""


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's unicode character -> byte table (the inverse of ``bytes_to_unicode``)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, str]:
    """``str.translate`` table: table character -> ``chr(byte)``, and every other
    character below 256 -> a marker that makes the latin-1 encode fail."""
    table = {code: _NOT_A_BYTE for code in range(256)}
    table.update({ord(char): chr(byte) for char, byte in byte_level_decoder().items()})
    return table


def byte_level_bytes(token: str) -> bytes:
    """The bytes a ``ByteLevel`` decoder gives one token (see module docstring)."""
    try:
        return token.translate(_byte_level_table()).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


def byte_fallback_byte(token: str) -> bytes | None:
    """``bytes([0xNN])`` for a token spelled ``<0xNN>``, else ``None``."""
    match = _BYTE_PIECE.fullmatch(token) if token.startswith("<0x") else None
    return bytes([int(match.group(1), 16)]) if match else None


def _apply_step(step: dict, pieces: list[Piece]) -> list[Piece]:
    kind = step.get("type")
    if kind == "Sequence":
        for inner in step["decoders"]:
            pieces = _apply_step(inner, pieces)
        return pieces
    if kind == "ByteLevel":
        return [byte_level_bytes(p) if isinstance(p, str) else p for p in pieces]
    if kind == "Replace" and "String" in step.get("pattern", {}):
        old, new = step["pattern"]["String"], step["content"]
        return [p.replace(old, new) if isinstance(p, str) else p for p in pieces]
    if kind == "Metaspace":
        old = step.get("replacement", "\u2581")
        return [p.replace(old, " ") if isinstance(p, str) else p for p in pieces]
    if kind == "ByteFallback":
        return [(byte_fallback_byte(p) or p) if isinstance(p, str) else p for p in pieces]
    if kind in ("Fuse", "Strip"):
        return pieces
    raise UnsupportedDecoderError(f"decoder step {step!r} has no per-token meaning")


def decode_with_decoder(decoder: dict | None, tokens: list[str]) -> list[bytes]:
    """The bytes of each token string under a ``tokenizers`` decoder description.

    Args:
        decoder: The decoder's JSON object (``json.loads(tokenizer.decoder.__getstate__())``),
            or ``None`` when the tokenizer has none.
        tokens: Token strings as the model's vocabulary spells them.

    Returns:
        One ``bytes`` per token, in order.

    Raises:
        UnsupportedDecoderError: no decoder, or a step that is not per-token.
    """
    if decoder is None:
        raise UnsupportedDecoderError(
            "the tokenizer has no decoder (decode joins tokens with spaces)"
        )
    if decoder.get("type") == "ByteLevel":  # the common case, without the generic loop
        return list(map(byte_level_bytes, tokens))
    pieces = _apply_step(decoder, list(tokens))
    return [p.encode("utf-8") if isinstance(p, str) else p for p in pieces]
