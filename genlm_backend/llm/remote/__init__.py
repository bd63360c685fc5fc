"""``RemoteLM``: an :class:`~genlm_backend.llm.base.AsyncLM` whose runner is a ``genlm-backend serve`` process.

* :mod:`~genlm_backend.llm.remote.model`: ``RemoteLM``, what it learns at connection;
* :mod:`~genlm_backend.llm.remote.runner`: its runner, one round trip per batch;
* :mod:`~genlm_backend.llm.remote.protocol`: what travels (HTTP, msgpack, rows) and the limits;
* :mod:`~genlm_backend.llm.remote.slab`, :mod:`~genlm_backend.llm.remote.client_slab`:
  rows through shared memory on the server's machine;
* :mod:`~genlm_backend.llm.remote.channel`: a session's batches over a local socket;
* :mod:`~genlm_backend.llm.remote.http`: one request's failures, as errors;
* :mod:`~genlm_backend.llm.remote.stats`: ``ServeStats``, a server's counters.

The server's side is :mod:`genlm_backend.serve`.
"""

from genlm_backend.llm.remote.model import REMOTE_SCHEME, RemoteLM, http_url
from genlm_backend.llm.remote.runner import RemoteRunner
from genlm_backend.llm.remote.stats import ServeStats

__all__ = ["REMOTE_SCHEME", "RemoteLM", "RemoteRunner", "ServeStats", "http_url"]
