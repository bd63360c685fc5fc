"""Model names that name nothing: a missing path fails without asking the hub, an unknown
name after one hub request bounded in time (name resolution included).

The hub is always a stand-in here (unreachable, silent, or answering): no
verdict depends on the network.
"""

from __future__ import annotations

import os
import threading

import pytest
from huggingface_hub import HfApi, constants

from genlm_backend import models
from genlm_backend.errors import ModelNotFoundError
from genlm_backend.llm import load_model_by_name

UNKNOWN_NAME = "genlm-backend-tests/no-such-model-7f3a"


@pytest.fixture
def empty_hub_cache(monkeypatch, tmp_path):
    """An empty hub cache, on a machine allowed to ask the hub (whatever HF_HUB_OFFLINE says)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hub"


@pytest.fixture
def hub_calls(monkeypatch):
    """Records hub requests and fails them as an unreachable hub would."""
    calls = []

    def unreachable(self, repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    return calls


@pytest.mark.parametrize(
    "name",
    [
        "/does/not/exist",
        "./missing",
        "../missing",
        "~/missing-model",
        "a/b/c",
        "missing.gguf",
        "dir/",
    ],
)
def test_a_missing_path_is_a_file_not_found_error_without_asking_the_hub(name, hub_calls):
    with pytest.raises(FileNotFoundError, match=f"no such file or folder: '{name}'") as info:
        models.resolve_model_path(name)
    assert isinstance(info.value, ModelNotFoundError)
    assert hub_calls == []  # never asked the hub


def test_an_unknown_name_fails_saying_what_was_tried(empty_hub_cache, hub_calls):
    environ = dict(os.environ)
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve_model_path(UNKNOWN_NAME)
    message = str(info.value)
    assert "\n" not in message
    assert f"model {UNKNOWN_NAME!r} is not a local folder or .gguf file" in message
    assert f"not in the local Hugging Face cache ({empty_hub_cache})" in message
    assert "the Hugging Face hub did not provide it (Name or service not known)" in message
    assert "pass a local transformers folder" in message and ".gguf file" in message
    assert dict(os.environ) == environ  # no global switch such as HF_HUB_OFFLINE
    assert len(hub_calls) == 1


def test_a_hub_that_never_answers_is_abandoned_after_the_timeout(monkeypatch, empty_hub_cache):
    """As when name resolution hangs, which the hub client's own timeout does not bound."""
    asked, never = threading.Event(), threading.Event()

    def silent(self, repo_id, **kwargs):
        asked.set()
        never.wait(60)  # released at teardown; the lookup must not wait for it

    monkeypatch.setattr(HfApi, "model_info", silent)
    monkeypatch.setattr(models, "HUB_TIMEOUT_S", 0.05)
    try:
        with pytest.raises(
            ModelNotFoundError, match=r"did not provide it \(no answer within 1.05 s\)"
        ):
            models.resolve_model_path(UNKNOWN_NAME)
        assert asked.is_set() and not never.is_set()
    finally:
        never.set()


def test_the_hub_is_asked_once_with_a_timeout(empty_hub_cache, hub_calls):
    with pytest.raises(ModelNotFoundError, match="Name or service not known"):
        models.resolve_model_path("gpt2")
    assert hub_calls == [("gpt2", {"timeout": models.HUB_TIMEOUT_S})]
    assert models.HUB_TIMEOUT_S <= 10


def test_offline_mode_skips_the_hub(monkeypatch, empty_hub_cache, hub_calls):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ModelNotFoundError, match=r"the hub was not asked \(HF_HUB_OFFLINE is set\)"
    ):
        models.resolve_model_path("gpt2")
    assert hub_calls == []


def test_an_invalid_hub_id_says_so(empty_hub_cache, hub_calls):
    with pytest.raises(ModelNotFoundError, match="nor a valid hub model id"):
        models.resolve_model_path("not a model")
    assert hub_calls == []


def test_a_name_in_the_local_hub_cache_resolves_to_its_snapshot(empty_hub_cache, hub_calls):
    snapshot = empty_hub_cache / "models--some-org--some-model" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    assert models.resolve_model_path("some-org/some-model") == snapshot
    assert hub_calls == []


def test_a_name_the_hub_has_is_returned_for_the_loader(monkeypatch, empty_hub_cache):
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kwargs: object())
    assert models.resolve_model_path("some-org/some-model") == "some-org/some-model"


def test_an_existing_file_that_is_not_gguf_is_a_value_error(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a file but not a \.gguf file"):
        models.resolve_model_path(weights)


@pytest.mark.parametrize("backend", ["hf", "mock"])
def test_load_model_by_name_reports_a_missing_path(backend, hub_calls):
    with pytest.raises(FileNotFoundError, match=r"'\./missing'"):
        load_model_by_name("./missing", backend=backend)
    assert hub_calls == []
