"""One model, many processes: ``genlm-backend serve`` and :class:`RemoteLM`.

A server process holds one :class:`~genlm_backend.llm.base.AsyncLM` (its
batcher, KV prefix tree and output cache); every client's requests go into it,
so requests of different processes share forward passes. A client is a
``RemoteLM``, an ``AsyncLM`` like any other: ``load_model_by_name("genlm://127.0.0.1:8765")``.

* :mod:`~genlm_backend.serve.protocol`: what travels (HTTP, msgpack, rows) and the limits;
* :mod:`~genlm_backend.serve.app`: the ASGI application (batching across clients, disconnects, shutdown);
* :mod:`~genlm_backend.serve.gather`: batches that gather every client's step;
* :mod:`~genlm_backend.serve.slab`, :mod:`~genlm_backend.serve.sessions`,
  :mod:`~genlm_backend.serve.client_slab`: rows through shared memory on one machine;
* :mod:`~genlm_backend.serve.asgi`, :mod:`~genlm_backend.serve.endpoints`: bodies in, answers out;
  the small endpoints (info, stats, adapters, clearing);
* :mod:`~genlm_backend.serve.server`: uvicorn, binding rules, signals;
* :mod:`~genlm_backend.serve.client`, :mod:`~genlm_backend.serve.remote_runner`,
  :mod:`~genlm_backend.serve.http`: ``RemoteLM`` and its runner, one request's failures;
* :mod:`~genlm_backend.serve.stats`: ``ServeStats``;
* :mod:`~genlm_backend.serve.cli`: the ``serve`` subcommand.
"""

from genlm_backend.serve.app import ServeApp
from genlm_backend.serve.client import REMOTE_SCHEME, RemoteLM, RemoteRunner
from genlm_backend.serve.protocol import ServeLimits
from genlm_backend.serve.server import serve
from genlm_backend.serve.stats import ServeStats

__all__ = [
    "REMOTE_SCHEME",
    "RemoteLM",
    "RemoteRunner",
    "ServeApp",
    "ServeLimits",
    "ServeStats",
    "serve",
]
