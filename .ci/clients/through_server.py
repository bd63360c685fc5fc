"""pytest plugin for the client suites: every transformers model comes from a `genlm-backend serve` process.

With ``-p through_server``, ``AsyncTransformer.from_name(name, ...)`` (what
genlm-control's ``PromptedLLM.from_name(name, backend="hf")`` calls) returns a
``RemoteLM`` connected to a server of ``name``: the first call for a name
starts ``python -m genlm_backend serve --backend hf --model NAME --port 0``
and waits for its "listening on" line; later calls connect to the same
server. The model's options (``hf_opts`` and the like) are not forwarded: the
server loads the model with the defaults (float32). Servers stop with the
session. Models built with ``AsyncTransformer(model, tokenizer)`` stay in-process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SERVER_START_TIMEOUT_S = 300

_servers: dict[str, tuple[subprocess.Popen, str]] = {}


def _server_url(name: str) -> str:
    if name not in _servers:
        process = subprocess.Popen(
            [sys.executable, "-m", "genlm_backend", "serve", "--backend", "hf"]
            + ["--model", name, "--port", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        for line in process.stdout:  # type: ignore[union-attr]
            if "listening on " in line:
                _servers[name] = (process, line.split("listening on ", 1)[1].strip())
                break
        else:
            raise RuntimeError(f"`genlm-backend serve --model {name}` ended before listening")
    return _servers[name][1]


def pytest_configure(config: pytest.Config) -> None:
    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.serve import RemoteLM

    def from_name(cls, model_id=None, *args, **kwargs):
        return RemoteLM(_server_url(str(model_id)))

    AsyncTransformer.from_name = classmethod(from_name)  # type: ignore[method-assign, assignment]


def pytest_unconfigure(config: pytest.Config) -> None:
    for process, _ in _servers.values():
        process.terminate()
        process.wait(timeout=60)
        process.stdout.close()  # type: ignore[union-attr]
    _servers.clear()
