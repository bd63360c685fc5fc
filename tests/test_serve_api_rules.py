"""What the server's small endpoints allow: adapters load only from the folders the
server was started with, and failures answer without exception texts.

The handlers are called in-process on a mock model (the rules are the server's,
not the transport's); ``test_serve.py`` runs adapters end to end.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from genlm_backend import MockAsyncLM
from genlm_backend.llm.remote import protocol
from genlm_backend.llm.remote.protocol import ServeLimits
from genlm_backend.serve.app import ServeApp
from genlm_backend.serve.asgi import Reject
from genlm_backend.serve.endpoints import model_routes

BYTES = [bytes([b]) for b in range(8)]


def lora(routes, op: str, name: str, path: str = "") -> dict:
    body = protocol.pack({"op": op, "name": name, "path": path})
    answer, _ = asyncio.run(routes[("POST", "/v1/lora")](body))
    return protocol.unpack(answer)


def routes_for(lm, *folders, log=lambda line: None):
    return model_routes(lm, {}, dict, [str(folder) for folder in folders], log=log)


def test_adapters_do_not_load_over_the_api_by_default():
    lm = MockAsyncLM(byte_vocab=BYTES)
    with pytest.raises(
        PermissionError, match="loads no adapters over its API; start it with --adapter-dir"
    ):
        lora(routes_for(lm), "add", "a", "/anywhere/a")
    assert lm.adapters.registered() == {}


def test_adapters_load_from_the_allowed_folders_only(tmp_path):
    allowed, elsewhere = tmp_path / "adapters", tmp_path / "elsewhere"
    (allowed / "a").mkdir(parents=True)
    (elsewhere / "b").mkdir(parents=True)
    (allowed / "link").symlink_to(elsewhere / "b")
    lm = MockAsyncLM(byte_vocab=BYTES)
    routes = routes_for(lm, allowed)
    assert lora(routes, "add", "a", "a")["adapters"] == {"a": str(allowed / "a")}
    assert lora(routes, "add", "a2", str(allowed / "a"))["adapters"]["a2"] == str(allowed / "a")
    for path in ("../elsewhere/b", str(elsewhere / "b"), "link", "/etc"):
        with pytest.raises(PermissionError, match="is not in a folder this server loads from"):
            lora(routes, "add", "x", path)
    assert set(lm.adapters.registered()) == {"a", "a2"}


def test_a_failed_load_answers_without_the_exception_s_text(tmp_path):
    lines = []
    lm = MockAsyncLM(byte_vocab=BYTES)

    def fail(path, name):
        raise FileNotFoundError(f"{path}/adapter_config.json: no such file")

    lm.add_new_lora = fail  # type: ignore[method-assign]
    routes = routes_for(lm, tmp_path, log=lines.append)
    with pytest.raises(ValueError) as failure:
        lora(routes, "add", "a", "org/hub-model")
    message = str(failure.value)
    assert (
        message
        == "adapter 'a' could not be loaded from 'org/hub-model' (the server's log says why)"
    )
    assert str(tmp_path) not in message and "no such file" not in message
    assert any("adapter_config.json: no such file" in line for line in lines)  # the log has it


def request_to(
    app: ServeApp, method: str, path: str, body: bytes, token: str | None = None
) -> tuple[bytes, str]:
    headers = (
        [] if token is None else [(protocol.TOKEN_HEADER.encode(), f"Bearer {token}".encode())]
    )
    scope = {"method": method, "path": path, "headers": headers, "type": "http"}

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return asyncio.run(app._answer(scope, receive))


def test_an_endpoint_s_failure_is_answered_without_its_text_and_logged():
    lines = []
    lm = MockAsyncLM(byte_vocab=BYTES)
    app = ServeApp(lm, ServeLimits(), token="t", log=lines.append)

    def fail():
        raise OSError(f"cannot write {os.sep}srv{os.sep}secret")

    lm.clear_cache = fail  # type: ignore[method-assign]
    with pytest.raises(Reject) as reject:
        request_to(app, "POST", "/v1/clear", protocol.pack({"what": "all"}), token="t")
    assert reject.value.kind == "ModelError" and "secret" not in str(reject.value)
    assert any("secret" in line for line in lines)
    with pytest.raises(Reject) as reject:
        body = protocol.pack({"op": "add", "name": "a", "path": "a"})
        request_to(app, "POST", "/v1/lora", body, token="t")
    assert reject.value.kind == "Forbidden" and "--adapter-dir" in str(reject.value)


def test_without_a_token_no_client_clears_the_server_s_caches():
    lm = MockAsyncLM(byte_vocab=BYTES)
    lm.next_token_logprobs_sync([1, 2])
    app = ServeApp(lm, ServeLimits(), log=lambda line: None)
    with pytest.raises(Reject) as reject:
        request_to(app, "POST", "/v1/clear", protocol.pack({"what": "all"}))
    assert reject.value.kind == "Forbidden" and "needs a server with a token" in str(reject.value)
    assert lm.stats.output_cache_bytes > 0  # nothing was cleared
    with_token = ServeApp(lm, ServeLimits(), token="t", log=lambda line: None)
    request_to(with_token, "POST", "/v1/clear", protocol.pack({"what": "all"}), token="t")
    assert lm.stats.output_cache_bytes == 0
    assert protocol.ERROR_STATUS["Forbidden"] == 403


def lora_by(routes, client: str, op: str, name: str, path: str = "") -> dict:
    body = protocol.pack({"op": op, "name": name, "path": path, "client": client})
    answer, _ = asyncio.run(routes[("POST", "/v1/lora")](body))
    return protocol.unpack(answer)


def test_without_a_token_a_client_removes_only_the_adapters_it_registered(tmp_path):
    lm = MockAsyncLM(byte_vocab=BYTES)
    lm.add_new_lora(str(tmp_path), "at-start")  # the server's own (no client registered it)
    routes = routes_for(lm, tmp_path)
    lora_by(routes, "alice", "add", "x", ".")
    for client, name in (("bob", "x"), ("bob", "at-start"), ("alice", "at-start")):
        with pytest.raises(PermissionError, match="registered by another client"):
            lora_by(routes, client, "remove", name)
    assert set(lm.adapters.registered()) == {"x", "at-start"}
    assert lora_by(routes, "alice", "remove", "x")["adapters"] == {"at-start": str(tmp_path)}
    with_token = model_routes(lm, {}, dict, [str(tmp_path)], log=lambda line: None, has_token=True)
    lora_by(with_token, "bob", "remove", "at-start")  # every client holds the token
    assert lm.adapters.registered() == {}
