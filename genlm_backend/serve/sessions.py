"""The server's side of shared-memory slabs: the slabs it holds open, one per open session.

A client on the server's machine offers a slab (``POST /v1/session``); the
server opens it if it may (:meth:`SlabWriter.attach`: the client's own,
private, of the offered size) and keeps the session's answer open. The
session lasts exactly as long as that answer: when the client closes it,
dies, or the server shuts down, the slab is closed.
While it lasts, ``/v1/logprobs`` answers of that client carry their rows in
the slab (:meth:`SlabSessions.write`) instead of the body.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from genlm_backend.llm.remote.protocol import SlabOffer
from genlm_backend.llm.remote.slab import SlabRefused, SlabWriter


class SlabSessions:
    """Open sessions: session id -> the client's slab. Used on the server's event loop.

    Args:
        vocab_size: Floats per row.
        max_sessions: Most sessions open at once; an offer beyond is refused (its
            client gets its rows in answer bodies).
    """

    def __init__(self, vocab_size: int, max_sessions: int = 256):
        self.vocab_size = vocab_size
        self.max_sessions = max_sessions
        self._slabs: dict[str, SlabWriter] = {}
        self._clients: dict[str, str] = {}
        self.num_rows_written = 0

    @property
    def num_open(self) -> int:
        return len(self._slabs)

    def open(self, offer: SlabOffer) -> str:
        """Open the offered slab; the new session's id (unguessable: it lets a request write there).

        Raises:
            SlabRefused: the slab cannot be used from here (the message says why).
        """
        if len(self._slabs) >= self.max_sessions:
            raise SlabRefused(f"the server holds {self.max_sessions} slab sessions at most")
        slab = SlabWriter.attach(offer.name, offer.nonce, offer.capacity_rows, self.vocab_size)
        session = secrets.token_hex(16)
        self._slabs[session] = slab
        self._clients[session] = offer.client
        return session

    def close(self, session: str) -> str | None:
        """Close the session's slab; the client it belonged to (``None``: no such session)."""
        slab = self._slabs.pop(session, None)
        if slab is not None:
            slab.close()
        return self._clients.pop(session, None)

    def client_of(self, session: str) -> str | None:
        """The client an open session belongs to (``None``: no such session open)."""
        return self._clients.get(session)

    def has_client(self, client: str) -> bool:
        """Whether ``client`` has a session open (it opens its next before closing its last)."""
        return client in self._clients.values()

    def write(self, session: str | None, rows: Sequence[torch.Tensor], first_row: int = 0) -> bool:
        """Put ``rows`` (float32 ``[V]`` each) into ``session``'s slab, from row ``first_row`` on.

        Returns:
            ``False`` (nothing written) when there is no such session (it closed,
            or the server restarted), the rows do not fit, or the slab cannot be
            written any more (the session is then closed): they go in the body then.
        """
        slab = None if session is None else self._slabs.get(session)
        if slab is None or first_row < 0 or first_row + len(rows) > slab.capacity_rows:
            return False
        try:
            slab.write(rows, first_row)
        except SlabRefused:
            self.close(session)  # type: ignore[arg-type]  # slab is not None: session is a str
            return False
        self.num_rows_written += len(rows)
        return True

    def close_all(self) -> None:
        for session in list(self._slabs):
            self.close(session)
