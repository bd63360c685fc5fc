"""One model, many processes: ``genlm-backend serve`` and :class:`RemoteLM`.

A server process holds one :class:`~genlm_backend.llm.base.AsyncLM` (its
batcher, KV prefix tree and output cache); every client's requests go into it,
so requests of different processes share forward passes. A client is a
``RemoteLM``, an ``AsyncLM`` like any other: ``load_model_by_name("genlm://127.0.0.1:8765")``.

* :mod:`~genlm_backend.serve.protocol`: what travels (HTTP, msgpack, raw float32 rows) and the limits;
* :mod:`~genlm_backend.serve.app`: the ASGI application (batching across clients, disconnects, shutdown);
* :mod:`~genlm_backend.serve.asgi`: request bodies in, answers out (in slices);
* :mod:`~genlm_backend.serve.server`: uvicorn, binding rules, signals;
* :mod:`~genlm_backend.serve.client`: ``RemoteRunner`` and ``RemoteLM``;
* :mod:`~genlm_backend.serve.cli`: the ``serve`` subcommand.
"""

from genlm_backend.serve.app import ServeApp, ServeStats
from genlm_backend.serve.client import REMOTE_SCHEME, RemoteLM, RemoteRunner
from genlm_backend.serve.protocol import ServeLimits
from genlm_backend.serve.server import serve

__all__ = [
    "REMOTE_SCHEME",
    "RemoteLM",
    "RemoteRunner",
    "ServeApp",
    "ServeLimits",
    "ServeStats",
    "serve",
]
