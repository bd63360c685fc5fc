"""The client's side of shared-memory rows: its slab, and the open session that keeps it open.

A :class:`ClientSlab` is offered to the server once (``POST /v1/session``);
if the server accepts it, the session's answer stays open on a connection of
its own, and the slab's name is unlinked at once (from then on nothing can
be left behind in ``/dev/shm``, whichever process dies). Closing the session
(closing that connection, or dying) tells the server to close it.

Rows without a copy: a slab holds ``batch_rows`` rows of *scratch* and twice
as many to *lend*. A batch's rows go into a free region of the lent part
when there is one, and the tensor returned views that region (no copy); the
region is lent until that tensor and every view of it are gone (the
callers' rows: the client's output cache keeps copies of its own), and only
then named in a request again. When no region is free (the caller keeps many results), the
rows go into the scratch part and are copied out, as from a slab without a
lent part (one made where ``/dev/shm`` has no room for three batches). Lent
views hold a second mapping of the slab
(:meth:`~genlm_backend.llm.remote.slab.Slab.lending_map`), so the memory stays
valid after the slab is closed or replaced, until the last view goes.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Generator
from typing import cast

import torch
import urllib3

from genlm_backend.errors import ServerUnavailableError
from genlm_backend.llm.remote import http, protocol
from genlm_backend.llm.remote.channel import HAS_UNIX_SOCKETS, ChannelClient, ChannelRefused
from genlm_backend.llm.remote.slab import HAS_SEALED, Slab, SlabRefused, rows_view


class RowLoans:
    """Which rows of a slab's lent part are lent: first-fit regions, given back from any thread."""

    def __init__(self, first_row: int, num_rows: int):
        self.first_row = first_row
        self._free = bytearray(b"\x01") * num_rows  # 1: free
        # Reentrant: a view collected by the garbage collector while this thread holds
        # the lock gives its region back from within.
        self._lock = threading.RLock()
        self.num_lent = 0
        """Rows lent now."""

    def lend(self, num_rows: int) -> int | None:
        """The first row of a free region of ``num_rows`` rows, now lent; ``None``: none free."""
        free, lent = b"\x01" * num_rows, bytes(num_rows)
        with self._lock:
            at = self._free.find(free)
            if at < 0:
                return None
            self._free[at : at + num_rows] = lent
            self.num_lent += num_rows
            return self.first_row + at

    def give_back(self, first_row: int, num_rows: int) -> None:
        free = b"\x01" * num_rows
        with self._lock:
            at = first_row - self.first_row
            self._free[at : at + num_rows] = free
            self.num_lent -= num_rows


class ClientSlab:
    """A slab this client created, written by its server for as long as the session is open.

    Its first ``batch_rows`` rows are scratch, the rest lent (see the module's docstring).
    Not thread-safe, but for regions given back: its ``RemoteRunner`` uses it
    under the ``AsyncLM``'s compute lock.
    """

    def __init__(
        self,
        slab: Slab,
        session: str,
        pool: urllib3.HTTPConnectionPool,
        answer: urllib3.BaseHTTPResponse,
        chunks: Generator[bytes, None, None],
        batch_rows: int,
        channel: ChannelClient | None = None,
    ):
        self.slab = slab
        self.channel = channel
        """The session's local channel to the server (``None``: requests go over HTTP)."""
        self.session = session
        self.batch_rows = batch_rows
        """Rows of its scratch part: the most one batch may have."""
        self.loans = RowLoans(batch_rows, slab.capacity_rows - batch_rows)
        self._lending_map = slab.lending_map()
        self._pool = pool
        self._answer = answer
        self._chunks = chunks  # the open answer's reader: dropping it would close the connection

    @classmethod
    def offer(
        cls,
        url: str,
        pool: urllib3.HTTPConnectionPool,
        client: str,
        batch_rows: int,
        vocab_size: int,
        read_timeout_s: float,
        check_answer: Callable[[urllib3.BaseHTTPResponse], None] = lambda answer: None,
    ) -> ClientSlab:
        """Create a slab for batches of up to ``batch_rows`` rows and have the server at ``url`` map it.

        ``pool`` is a connection pool of its own (the session holds its one connection).
        When the server offers its local channel (:mod:`~genlm_backend.llm.remote.channel`), the
        session connects to it; if that fails, its requests go over HTTP. ``check_answer``
        raises for an answer from a server this client must not use (another model).

        Raises:
            SlabRefused: no shared memory here, or the server cannot map it (the
                message says why); rows then travel in answer bodies.
            ServerUnavailableError, ServerRejectedError: as for any request.
        """
        try:
            if HAS_SEALED:
                # A sealed slab first; a server that cannot open this process's descriptors
                # (another PID namespace) may still open a named segment.
                with contextlib.suppress(SlabRefused):
                    return cls._offer(
                        url,
                        pool,
                        client,
                        batch_rows,
                        vocab_size,
                        read_timeout_s,
                        check_answer,
                        True,
                    )
            return cls._offer(
                url, pool, client, batch_rows, vocab_size, read_timeout_s, check_answer, False
            )
        except BaseException:
            pool.close()
            raise

    @classmethod
    def _offer(
        cls,
        url: str,
        pool: urllib3.HTTPConnectionPool,
        client: str,
        batch_rows: int,
        vocab_size: int,
        read_timeout_s: float,
        check_answer: Callable[[urllib3.BaseHTTPResponse], None],
        sealed: bool,
    ) -> ClientSlab:
        """:meth:`offer` of a slab of one kind (sealed or named)."""
        try:
            slab = Slab.create(protocol.SLAB_BATCHES * batch_rows, vocab_size, sealed)
        except OSError:
            try:  # a small /dev/shm: scratch rows only, copied out
                slab = Slab.create(batch_rows, vocab_size, sealed)
            except OSError as exc:
                raise SlabRefused(f"no shared memory for {batch_rows} rows here ({exc})") from None
        capacity_rows = slab.capacity_rows
        answer: urllib3.BaseHTTPResponse | None = None
        try:
            body = protocol.encode_slab_offer(client, slab.name, slab.nonce, capacity_rows)
            answer = http.send(pool, url, "POST", "/v1/session", body, preload_content=False)
            check_answer(answer)
            session, chunks, address = _accepted_session(answer, url)
            channel = None
            if address and HAS_UNIX_SOCKETS:
                with contextlib.suppress(ChannelRefused):
                    channel = ChannelClient(address, session, url, read_timeout_s)
            client_slab = cls(slab, session, pool, answer, chunks, batch_rows, channel)
        except BaseException:
            if answer is not None:  # an open answer holds its connection outside the pool
                answer.close()
            slab.close()
            slab.unlink()
            raise
        slab.unlink()  # the server holds its mapping: the memory lives as long as one of ours
        return client_slab

    def is_dropped(self) -> bool:
        """Whether the server closed this session's local channel since the last batch."""
        return self.channel is not None and self.channel.is_dropped()

    def region(self, num_rows: int) -> int:
        """The first row for a batch of ``num_rows``: a region now lent, else 0 (the scratch part)."""
        first_row = self.loans.lend(num_rows)
        return 0 if first_row is None else first_row

    def give_back(self, first_row: int, num_rows: int) -> None:
        """Return a region :meth:`region` lent whose rows will not be read (the round trip failed)."""
        if first_row:
            self.loans.give_back(first_row, num_rows)

    def read(self, first_row: int, num_rows: int) -> torch.Tensor:
        """The ``num_rows`` rows the server wrote from ``first_row`` on, as a CPU tensor.

        A lent region is returned as is (the tensor views the slab, and the
        region comes back when it is gone); scratch rows are copied once.
        """
        if not first_row:
            return self.slab.read(num_rows)
        view = rows_view(self._lending_map, self.slab.vocab_size, num_rows, first_row)
        weakref.finalize(view, self.loans.give_back, first_row, num_rows)
        return torch.from_numpy(view)

    def close(self) -> None:
        """End the session (the server closes the slab) and unmap ours. Idempotent.

        Lent tensors stay valid: their views hold the second mapping until they go.
        """
        if self.channel is not None:
            self.channel.close()
        self._chunks.close()  # closes the session's connection: the server sees it go
        self._answer.close()
        self._pool.close()
        self.slab.close()
        self._lending_map = None  # type: ignore[assignment]  # freed with the last lent view


def _accepted_session(
    answer: urllib3.BaseHTTPResponse, url: str
) -> tuple[str, Generator[bytes, None, None], str]:
    """The session id of an accepted offer, the open answer's reader, and the server's local
    channel (``""``: none).

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
    return str(fields["session"]), chunks, str(fields.get("channel") or "")
