"""The client's side of shared-memory rows: its slab, and the open session that keeps it mapped.

A :class:`ClientSlab` is offered to the server once (``POST /v1/session``);
if the server maps it, the session's answer stays open on a connection of
its own, and the slab's name is unlinked at once (from then on nothing can
be left behind in ``/dev/shm``, whichever process dies). Closing the session
(closing that connection, or dying) tells the server to unmap it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import cast

import torch
import urllib3

from genlm_backend.errors import ServerUnavailableError
from genlm_backend.serve import http, protocol
from genlm_backend.serve.slab import Slab, SlabRefused


class ClientSlab:
    """A slab this client created, mapped by its server for as long as the session is open.

    Not thread-safe: its ``RemoteRunner`` uses it under the ``AsyncLM``'s compute lock.
    """

    def __init__(
        self,
        slab: Slab,
        session: str,
        pool: urllib3.HTTPConnectionPool,
        answer: urllib3.BaseHTTPResponse,
        chunks: Generator[bytes, None, None],
    ):
        self.slab = slab
        self.session = session
        self._pool = pool
        self._answer = answer
        self._chunks = chunks  # the open answer's reader: dropping it would close the connection

    @property
    def capacity_rows(self) -> int:
        return self.slab.capacity_rows

    @classmethod
    def offer(
        cls,
        url: str,
        pool: urllib3.HTTPConnectionPool,
        client: str,
        capacity_rows: int,
        vocab_size: int,
    ) -> ClientSlab:
        """Create a slab of ``capacity_rows`` rows and have the server at ``url`` map it.

        ``pool`` is a connection pool of its own (the session holds its one connection).

        Raises:
            SlabRefused: no shared memory here, or the server cannot map it (the
                message says why); rows then travel in answer bodies.
            ServerUnavailableError, ServerRejectedError: as for any request.
        """
        try:
            slab = Slab.create(capacity_rows, vocab_size)
        except OSError as exc:
            raise SlabRefused(f"no shared memory for {capacity_rows} rows here ({exc})") from None
        try:
            body = protocol.encode_slab_offer(client, slab.name, slab.nonce, capacity_rows)
            answer = http.send(pool, url, "POST", "/v1/session", body, preload_content=False)
            session, chunks = _accepted_session(answer, url)
        except BaseException:
            slab.close()
            slab.unlink()
            pool.close()
            raise
        slab.unlink()  # the server holds its mapping: the memory lives as long as one of ours
        return cls(slab, session, pool, answer, chunks)

    def read(self, num_rows: int) -> torch.Tensor:
        """The first ``num_rows`` rows the server wrote, as a fresh CPU tensor (one copy)."""
        return self.slab.read(num_rows)

    def close(self) -> None:
        """End the session (the server unmaps the slab) and unmap ours. Idempotent."""
        self._chunks.close()  # closes the session's connection: the server sees it go
        self._answer.close()
        self._pool.close()
        self.slab.close()


def _accepted_session(
    answer: urllib3.BaseHTTPResponse, url: str
) -> tuple[str, Generator[bytes, None, None]]:
    """The session id of an accepted offer, and the open answer's reader.

    Raises:
        SlabRefused: the server refused the slab, or does not offer sessions.
        ServerUnavailableError, ServerRejectedError: another failure of the request.
    """
    if answer.status == 404:
        raise SlabRefused(f"the server at {url} does not offer shared memory (an older version)")
    if answer.status != 200:
        raise http.error_of(answer, url)
    if not answer.chunked:  # a refusal: one complete answer
        fields = protocol.unpack(answer.data)
        raise SlabRefused(f"the server at {url} cannot map this client's slab: {fields['reason']}")
    chunks = cast(Generator[bytes, None, None], answer.read_chunked())  # a generator
    try:
        fields = protocol.unpack(next(chunks, b""))
    except urllib3.exceptions.HTTPError as exc:
        raise ServerUnavailableError(
            f"the server at {url} closed the connection during the request "
            f"({type(exc).__name__}): it stopped or crashed. The next call reconnects"
        ) from None
    except ValueError as exc:
        raise SlabRefused(f"the server at {url} answered the offer with {exc}") from None
    if not fields.get("accepted"):
        raise SlabRefused(f"the server at {url} cannot map this client's slab: {fields['reason']}")
    return str(fields["session"]), chunks
