"""The tokenization tests' reference: GPT-2's published byte table."""

from __future__ import annotations


def published_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> unicode table as published with the GPT-2 encoder (encoder.py):
    printable latin-1 bytes stand for themselves, the other 68 bytes are shifted
    to code points 256, 257, ... in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    shifted = [byte for byte in range(256) if byte not in table]
    table.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    return table
