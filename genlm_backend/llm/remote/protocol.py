"""What travels between a ``genlm-backend serve`` server and a :class:`RemoteLM`, and its limits.

HTTP/1.1, one POST per batch (or, for a client on the server's machine, a frame
on its slab session's local channel: :mod:`~genlm_backend.llm.remote.channel`). Request bodies and small answers are msgpack
maps; token ids travel as ``int32`` little-endian bytes and log-probability
rows as raw ``float32`` little-endian bytes, ``[rows, vocab]`` in C order
(never as text). Every answer that is not rows is a msgpack map; a failure is
``{"kind": ..., "message": ...}`` with an HTTP status (see :data:`ERROR_STATUS`).

Endpoints (all under ``/v1``):

* ``GET /v1/info``: the model's identity, vocabulary, tokenizer files, limits, adapters.
* ``POST /v1/logprobs``: ``{"lengths": [int], "shared": [int], "ids": bytes,
  "lora_names": [str | None], "uncached": bool, "client": str, "session": str,
  "slab_row": int}`` -> rows
  ``[len(lengths), vocab]``: in the answer's body, or (content type
  :data:`SLAB_CONTENT_TYPE`, body ``{"num_rows": int}``) in the client's shared-memory
  slab of ``session``, from its row ``slab_row`` on (default 0). ``client`` (optional)
  identifies the client process across its requests (see :mod:`~genlm_backend.serve.gather`);
  ``session`` (optional) names the client's open slab session. Context ``i`` is its
  first ``shared[i]`` tokens in common with context ``i - 1`` (``shared[0] == 0``),
  then its other ``lengths[i] - shared[i]`` tokens, which are all ``ids`` holds: a
  batch of particles behind one prompt carries the prompt once.
* ``POST /v1/session``: ``{"client": str, "name": str, "nonce": bytes, "capacity_rows": int}``,
  a client's offer of a shared-memory slab of at most :data:`SLAB_BATCHES` times
  ``max_rows`` rows, ``name`` a named segment's or ``memfd:PID:FD`` for a sealed one
  (see :mod:`~genlm_backend.llm.remote.slab`) ->
  ``{"accepted": bool, "session": str, "reason": str, "channel": str}``. An accepted
  session's answer stays open (chunked, nothing more is sent): the server keeps the slab
  mapped until the client closes it (or dies), or the server shuts down. ``channel``
  (``""``: none) is the address of the server's local socket, over which the session's
  ``/v1/logprobs`` requests go in frames instead (:mod:`~genlm_backend.llm.remote.channel`).
* ``POST /v1/lora``: ``{"op": "add" | "remove", "name": str, "path": str}``.
* ``POST /v1/clear``: ``{"what": "all" | "kv"}``.
* ``GET /v1/stats``: ``{"lm": LMStats fields, "server": ServeStats fields}``.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

PROTOCOL_VERSION = 3
TOKEN_HEADER = "authorization"
MODEL_ID_HEADER = "x-genlm-model-id"
ROWS_CONTENT_TYPE = "application/x-float32-le"
SLAB_CONTENT_TYPE = "application/x-genlm-slab"
SLAB_BATCHES = 3
"""A slab holds at most this many batches of ``max_rows`` rows: one the client copies out of,
two it lends to the tensors it returns (see :mod:`~genlm_backend.llm.remote.client_slab`)."""
MSGPACK_CONTENT_TYPE = "application/msgpack"
DEFAULT_PORT = 8765
TOKEN_ENV = "GENLM_SERVE_TOKEN"
"""Where a server and its clients read the shared token when none is given."""

ERROR_STATUS = {
    "TypeError": 400,  # a context of the wrong type
    "ValueError": 400,  # a bad token id, unknown adapter, malformed body
    "Unauthorized": 401,  # missing or wrong token
    "Forbidden": 403,  # not allowed by the server's settings (e.g. loading adapters)
    "NotFound": 404,
    "RequestTooLarge": 413,  # over a ServeLimits limit
    "ModelError": 500,  # the model failed the batch
    "ShuttingDown": 503,  # the server is stopping; the request was not computed
    "Busy": 503,  # over a cap of the server's (local connections); nothing was computed
}
"""HTTP status of each error kind."""


@dataclass(frozen=True)
class ServeLimits:
    """What one request to the server may ask for; anything more fails that request alone.

    Attributes:
        max_rows: Most contexts in one request (a client's batch never holds more).
        max_context_length: Most tokens in one context; ``None``: the model's own limit.
        max_body_bytes: Most bytes of one request body (4 bytes a token plus a small header).

    Raises:
        ValueError: a limit < 1.
    """

    max_rows: int = 256
    max_context_length: int | None = None
    max_body_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_context_length", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def max_batch_tokens(self) -> int:
        """Most context tokens a client may put in one body (ids plus a generous header)."""
        return max(1, (self.max_body_bytes - 64 * self.max_rows - 1024) // 4)


@dataclass(frozen=True)
class LogprobsRequest:
    """A decoded ``/v1/logprobs`` body: contexts with their adapter names, who asks, where rows go."""

    contexts: list[tuple[int, ...]]
    lora_names: list[str | None]
    uncached: bool
    client: str | None = None
    session: str | None = None
    slab_row: int = 0
    lora_versions: list[int | None] | None = None
    """The server's registration of each named adapter that the client knows (``None``:
    the client sent none, an older client): a request is answered under that one only."""


@dataclass(frozen=True)
class SlabOffer:
    """A decoded ``/v1/session`` body: a client's shared-memory slab."""

    client: str
    name: str
    nonce: bytes
    capacity_rows: int


# ---------------------------------------------------------------- msgpack maps


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(body: bytes | memoryview) -> dict:
    """A msgpack map from ``body``.

    Raises:
        ValueError: not a msgpack map.
    """
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed request body: not msgpack ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"malformed request body: expected a map, got {type(obj).__name__}")
    return obj


def error_body(kind: str, message: str) -> bytes:
    return pack({"kind": kind, "message": message})


# ---------------------------------------------------------------- logprobs requests


def encode_logprobs_request(
    contexts: Sequence[Sequence[int]],
    lora_names: Sequence[str | None],
    uncached: bool = False,
    *,
    client: str | None = None,
    session: str | None = None,
    slab_row: int = 0,
    lora_versions: Sequence[int | None] | None = None,
) -> bytes:
    """The body of a ``/v1/logprobs`` request: each context's tokens past those it shares
    with the context before it, as ``int32`` little-endian bytes; ``lora_versions``: the
    server's registration of each context's adapter, as the client learned it.

    Raises:
        ValueError: a token id that is not an int of 32 bits.
    """
    lengths, shared, pieces = [], [], []
    previous = b""
    for context in contexts:
        ids = _int32_bytes(context)
        common = _shared_length(previous, ids)
        lengths.append(len(context))
        shared.append(common)
        pieces.append(ids[4 * common :])
        previous = ids
    fields = {
        "lengths": lengths,
        "shared": shared,
        "ids": b"".join(pieces),
        "lora_names": list(lora_names),
        "uncached": uncached,
    }
    if client is not None:
        fields["client"] = client
    if session is not None:
        fields["session"] = session
    if slab_row:
        fields["slab_row"] = slab_row
    if lora_versions is not None:
        fields["lora_versions"] = list(lora_versions)
    return pack(fields)


def _int32_bytes(context: Sequence[int]) -> bytes:
    """``context`` as little-endian ``int32`` bytes (``struct``: no numpy array made on the way)."""
    try:
        return struct.pack(f"<{len(context)}i", *context)
    except struct.error as exc:
        raise ValueError(f"token ids must be ints of 32 bits ({exc})") from None


def _shared_length(a: bytes, b: bytes) -> int:
    """How many first ids the ``int32`` bytes ``a`` and ``b`` have in common.

    Short ones at C speed without numpy's call overhead: equal prefixes by one
    comparison, else the lowest set bit of the two read as little-endian
    integers and XORed. Long ones with numpy.
    """
    n = min(len(a), len(b))
    if n > _SHORT_BYTES:
        differ = np.flatnonzero(np.frombuffer(a, "<i4", n >> 2) != np.frombuffer(b, "<i4", n >> 2))
        return int(differ[0]) if differ.size else n >> 2
    if a[:n] == b[:n]:
        return n >> 2
    x = int.from_bytes(a[:n], "little") ^ int.from_bytes(b[:n], "little")
    return ((x & -x).bit_length() - 1) >> 5  # the lowest set bit's id


_SHORT_BYTES = 1024
"""Up to this many bytes (256 ids), :func:`_shared_length` XORs integers; past it, numpy compares."""


def decode_logprobs_request(body: bytes, limits: ServeLimits) -> LogprobsRequest:
    """Check a ``/v1/logprobs`` body against its schema and ``limits``; its contexts as tuples.

    Token ids are not checked against the vocabulary here: the server's
    ``AsyncLM`` validates them as it would in-process. A context's tokens
    in common with the one before it are that tuple's own (a slice, no new
    ints), so decoding costs the new tokens, not every context's length.

    Raises:
        RequestTooLargeError: more rows or a longer context than ``limits`` allow.
        ValueError: a malformed body (the message says what is wrong).
    """
    from genlm_backend.errors import RequestTooLargeError

    fields = unpack(body)
    lengths, ids, lora_names = fields.get("lengths"), fields.get("ids"), fields.get("lora_names")
    shared = fields.get("shared")
    uncached = fields.get("uncached", False)
    if not (isinstance(lengths, list) and all(is_int(n) and n >= 0 for n in lengths)):
        raise ValueError("malformed request body: 'lengths' must be a list of ints >= 0")
    if not (isinstance(shared, list) and len(shared) == len(lengths)):
        raise ValueError("malformed request body: 'shared' must have one entry per context")
    limit = 0  # context 0 shares nothing; context i at most min(lengths[i - 1], lengths[i])
    for length, common in zip(lengths, shared):
        if not (is_int(common) and 0 <= common <= min(limit, length)):
            raise ValueError(
                "malformed request body: each 'shared' entry is an int from 0 to the length "
                "of its context and of the one before it (0 for the first)"
            )
        limit = length
    if not isinstance(ids, bytes) or len(ids) % 4:
        raise ValueError("malformed request body: 'ids' must be int32 bytes")
    if not isinstance(lora_names, list) or len(lora_names) != len(lengths):
        raise ValueError("malformed request body: 'lora_names' must have one entry per context")
    if not all(name is None or isinstance(name, str) for name in lora_names):
        raise ValueError("malformed request body: each lora name must be a str or nil")
    lora_versions = fields.get("lora_versions")
    if lora_versions is not None and not (
        isinstance(lora_versions, list)
        and len(lora_versions) == len(lengths)
        and all(v is None or (is_int(v) and v >= 0) for v in lora_versions)
    ):
        raise ValueError(
            "malformed request body: 'lora_versions' must hold an int >= 0 or nil per context"
        )
    if not isinstance(uncached, bool) or (uncached and len(lengths) != 1):
        raise ValueError("malformed request body: 'uncached' is a bool, for one context")
    client, session = fields.get("client"), fields.get("session")
    if not all(value is None or _is_short_str(value) for value in (client, session)):
        raise ValueError("malformed request body: 'client' and 'session' are short strings")
    slab_row = fields.get("slab_row", 0)
    if not (is_int(slab_row) and 0 <= slab_row < SLAB_BATCHES * limits.max_rows):
        raise ValueError(
            f"malformed request body: 'slab_row' must be an int in [0, {SLAB_BATCHES * limits.max_rows})"
        )
    num_new = sum(lengths) - sum(shared)
    if num_new * 4 != len(ids):
        raise ValueError(
            f"malformed request body: lengths and shared leave {num_new} new tokens, "
            f"ids hold {len(ids) // 4}"
        )
    if len(lengths) > limits.max_rows:
        raise RequestTooLargeError(
            f"{len(lengths)} contexts in one request; this server takes at most {limits.max_rows}"
        )
    longest = max(lengths, default=0)
    if limits.max_context_length is not None and longest > limits.max_context_length:
        raise RequestTooLargeError(
            f"a context of {longest} tokens; this server takes at most {limits.max_context_length}"
        )
    if sum(lengths) > limits.max_batch_tokens:  # shared tokens cost no bytes, but memory here
        raise RequestTooLargeError(
            f"{sum(lengths)} context tokens in one request; this server takes at most "
            f"{limits.max_batch_tokens}"
        )
    new_ids = np.frombuffer(ids, dtype="<i4").tolist()
    contexts: list[tuple[int, ...]] = []
    previous: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()  # a prefix of ``previous``: particles share one, sliced once
    start = 0
    for length, common in zip(lengths, shared):
        if common != len(prefix):
            prefix = prefix[:common] if common < len(prefix) else previous[:common]
        end = start + length - common
        previous = prefix + tuple(new_ids[start:end])
        contexts.append(previous)
        start = end
    return LogprobsRequest(contexts, lora_names, uncached, client, session, slab_row, lora_versions)


def encode_slab_offer(client: str, name: str, nonce: bytes, capacity_rows: int) -> bytes:
    """The body of a ``/v1/session`` request."""
    return pack({"client": client, "name": name, "nonce": nonce, "capacity_rows": capacity_rows})


def decode_slab_offer(body: bytes, limits: ServeLimits) -> SlabOffer:
    """Check a ``/v1/session`` body.

    Raises:
        RequestTooLargeError: a slab of more rows than ``limits.max_rows``.
        ValueError: a malformed body.
    """
    from genlm_backend.errors import RequestTooLargeError

    fields = unpack(body)
    client, name, nonce = fields.get("client"), fields.get("name"), fields.get("nonce")
    capacity_rows = fields.get("capacity_rows")
    if not (isinstance(client, str) and isinstance(name, str) and isinstance(nonce, bytes)):
        raise ValueError("malformed request body: 'client', 'name' (str) and 'nonce' (bytes)")
    if not (_is_short_str(client) and _is_short_str(name)):
        raise ValueError("malformed request body: 'client' and 'name' are short strings")
    if not (isinstance(capacity_rows, int) and is_int(capacity_rows) and capacity_rows >= 1):
        raise ValueError("malformed request body: 'capacity_rows' must be an int >= 1")
    if capacity_rows > SLAB_BATCHES * limits.max_rows:
        raise RequestTooLargeError(
            f"a slab of {capacity_rows} rows; this server takes at most {SLAB_BATCHES} x "
            f"{limits.max_rows} (its max_rows)"
        )
    return SlabOffer(client, name, nonce, capacity_rows)


# ---------------------------------------------------------------- rows


def encode_rows(rows: Sequence[torch.Tensor]) -> bytes:
    """``float32`` rows of ``V`` each (any device; a ``[B, V]`` tensor too) -> their
    little-endian bytes, C order."""
    arrays = [row.detach().to("cpu", torch.float32).numpy() for row in rows]
    return np.stack(arrays).astype("<f4", copy=False).tobytes()


def decode_rows(content: bytes | memoryview, num_rows: int, vocab_size: int) -> torch.Tensor:
    """Bytes from :func:`encode_rows` -> a fresh ``float32`` ``[num_rows, vocab_size]`` CPU tensor.

    Raises:
        ValueError: ``content`` is not ``num_rows * vocab_size`` floats.
    """
    expected = 4 * num_rows * vocab_size
    if len(content) != expected:
        raise ValueError(f"expected {expected} bytes of rows, got {len(content)}")
    array = np.frombuffer(content, dtype="<f4").reshape(num_rows, vocab_size)
    if sys.byteorder != "little":
        array = array.astype(np.float32)
    return torch.from_numpy(array.copy())


def _is_short_str(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
