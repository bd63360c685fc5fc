"""Backend selection by name, optional backends, and a side-effect-free import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from genlm_backend.errors import BackendNotAvailableError
from genlm_backend.llm import MockAsyncLM, load_model_by_name, loader


@pytest.mark.slow
def test_mock_backend_over_the_default_tokenizer(smollm2_tokenizer):
    llm = load_model_by_name(None, backend="mock", llm_opts={"batch_size": 3})
    assert isinstance(llm, MockAsyncLM)
    assert llm.vocab_size == len(smollm2_tokenizer)
    assert llm.batch_size == 3
    row = llm.next_token_logprobs_sync(smollm2_tokenizer.encode("Hello"))
    assert row.shape == (len(smollm2_tokenizer),)
    llm.close()


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'.*hf.*vllm.*mock"):
        load_model_by_name(None, backend="tpu")


def test_vllm_without_vllm_names_what_to_install(monkeypatch):
    monkeypatch.setattr(loader, "vllm_is_available", lambda: False)
    with pytest.raises(BackendNotAvailableError, match=r"pip install .*vllm") as info:
        load_model_by_name(None, backend="vllm")
    assert isinstance(info.value, ImportError)


def test_default_backend_without_cuda_or_vllm(monkeypatch):
    monkeypatch.setattr(loader, "vllm_is_available", lambda: False)
    assert loader.default_backend() == "hf"


def test_import_has_no_side_effects():
    script = """
import json, os, sys
before = dict(os.environ)
import genlm_backend
import genlm_backend.llm
print(json.dumps({
    "vllm": "vllm" in sys.modules,
    "modeling_utils": "transformers.modeling_utils" in sys.modules,
    "environ_changed": dict(os.environ) != before,
}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "vllm": False,
        "modeling_utils": False,
        "environ_changed": False,
    }
