"""What a server tells a client once, at connection: the model's identity, vocabulary, tokenizer and limits.

The tokenizer travels as the files ``save_pretrained`` writes (a few MB at
most), not as a path: the client may run on another machine, and a file
path would tie it to the server's filesystem. The vocabulary travels as the
server decoded it, so client and server agree on every token's bytes.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.remote.protocol import PROTOCOL_VERSION, ServeLimits


def model_info(lm: AsyncLM, limits: ServeLimits, model_name: str, backend: str) -> dict:
    """The ``/v1/info`` map of a server holding ``lm`` under ``limits``."""
    max_context_length = _tighter(lm.max_context_length, limits.max_context_length)
    return {
        "protocol": PROTOCOL_VERSION,
        "model_id": model_id(lm, model_name, backend),
        "model_name": model_name,
        "backend": backend,
        "byte_vocab": [bytes(token) for token in lm.byte_vocab],
        "token_ids": _token_ids(lm.byte_vocab),
        "str_vocab": list(lm.str_vocab),
        "tokenizer_files": tokenizer_files(lm.tokenizer),
        "tokenizer_name_or_path": getattr(lm.tokenizer, "name_or_path", None),
        "max_context_length": max_context_length,
        "max_rows": limits.max_rows,
        "max_body_bytes": limits.max_body_bytes,
        "adapters": {name: adapter.path for name, adapter in lm.adapters.registered().items()},
    }


def _token_ids(byte_vocab) -> list[int] | None:
    """Each entry's ``token_id`` when every entry is a ``Token`` (as ``decode_vocab`` makes them)."""
    from genlm_backend.tokenization import Token

    if not all(isinstance(token, Token) for token in byte_vocab):
        return None
    return [token.token_id for token in byte_vocab]


def model_id(lm: AsyncLM, model_name: str, backend: str) -> str:
    """A digest of the model's name, backend and vocabulary: a restarted server with the same
    model has the same id, another model a different one."""
    digest = hashlib.sha256(f"{model_name}\0{backend}\0{type(lm).__name__}\0".encode())
    for token in lm.byte_vocab:
        digest.update(len(token).to_bytes(4, "little") + token)
    return digest.hexdigest()[:32]


def tokenizer_files(tokenizer) -> dict[str, bytes] | None:
    """The files ``tokenizer.save_pretrained`` writes, by name (``None`` without a tokenizer)."""
    if tokenizer is None:
        return None
    with tempfile.TemporaryDirectory(prefix="genlm-serve-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in Path(folder).iterdir() if path.is_file()}


def _tighter(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
