"""The public LM API keeps upstream genlm-backend 0.3.1's names, signatures and call styles."""

from __future__ import annotations

import asyncio
import inspect
import json
import subprocess
import sys

import pytest
import torch

from genlm_backend.errors import BatcherClosedError
from genlm_backend.llm import MockAsyncLM
from genlm_backend.llm.hf import AsyncTransformer

SMALL_VOCAB = [bytes([b]) for b in b"abcdefgh"]

HIDE_VLLM = """
import importlib.abc, json, sys

class HideVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, HideVllm())
import importlib.util
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "vllm" else _find_spec(name, *a)
"""


def test_star_import_works_without_vllm_and_the_placeholder_explains_itself():
    script = (
        HIDE_VLLM
        + """
from genlm_backend import *
from genlm_backend.errors import BackendNotAvailableError
outcome = {"names": sorted(k for k in dir() if k[0].isupper())}
for build in (lambda: AsyncVirtualLM(None), lambda: AsyncVirtualLM.from_name("m", engine_opts={})):
    try:
        build()
        outcome.setdefault("errors", []).append(None)
    except BackendNotAvailableError as exc:
        outcome.setdefault("errors", []).append(str(exc))
print(json.dumps(outcome))
"""
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    outcome = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"AsyncVirtualLM", "AsyncTransformer", "MockAsyncLM", "AsyncLM"} <= set(outcome["names"])
    assert len(outcome["errors"]) == 2
    for message in outcome["errors"]:
        assert message is not None and "vLLM" in message and "pip install" in message


def test_reset_async_queries_needs_no_await():
    llm = MockAsyncLM(byte_vocab=SMALL_VOCAB, timeout_s=60.0, batch_size=100)
    assert not inspect.iscoroutinefunction(llm.reset_async_queries)
    assert llm.reset_async_queries() is None  # outside a loop: nothing is pending

    async def main():
        await llm.next_token_logprobs([1])  # this loop's batcher, with the long timeout
        pending = asyncio.ensure_future(llm.next_token_logprobs([2]))
        await asyncio.sleep(0)
        llm.reset_async_queries()  # as llamppl calls it: no await
        with pytest.raises(BatcherClosedError, match="closed"):
            await asyncio.wait_for(pending, 60)
        return await asyncio.wait_for(llm.next_token_logprobs([2]), 60)

    row = asyncio.run(main())
    expected = MockAsyncLM(byte_vocab=SMALL_VOCAB, output_cache_bytes=0).next_token_logprobs_sync(
        [2]
    )
    torch.testing.assert_close(row, expected, atol=1e-6, rtol=0)
    llm.close()


def test_sync_and_async_context_managers_close():
    with MockAsyncLM(byte_vocab=SMALL_VOCAB) as llm:
        llm.next_token_logprobs_sync([1])
    with pytest.raises(BatcherClosedError, match="closed"):
        llm.next_token_logprobs_sync([1])
    llm.cleanup()  # idempotent

    async def main():
        async with MockAsyncLM(byte_vocab=SMALL_VOCAB) as llm:
            await llm.next_token_logprobs([1])
        return llm

    with pytest.raises(BatcherClosedError, match="closed"):
        asyncio.run(main()).next_token_logprobs_sync([1])


def parameters(function) -> list[tuple[str, object]]:
    return [
        (name, p.default)
        for name, p in inspect.signature(function).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


@pytest.mark.parametrize(
    "function, expected",
    [
        (
            AsyncTransformer.__init__,
            [
                ("self", inspect._empty),
                ("hf_model", inspect._empty),
                ("hf_tokenizer", inspect._empty),
                ("batch_size", None),
                ("timeout", 0.02),
            ],
        ),
        (
            AsyncTransformer.from_name,
            [("model_id", None), ("bitsandbytes_opts", None), ("hf_opts", None)],
        ),
        (MockAsyncLM.__init__, [("self", inspect._empty), ("tokenizer", None)]),
        (MockAsyncLM.from_name, [("model_name", None)]),
        (
            AsyncTransformer.next_token_logprobs,
            [("self", inspect._empty), ("token_ids", inspect._empty), ("lora_name", None)],
        ),
        (
            AsyncTransformer.cache_kv,
            [("self", inspect._empty), ("prompt_tokens", inspect._empty), ("lora_name", None)],
        ),
        (
            AsyncTransformer.sample,
            [
                ("self", inspect._empty),
                ("prompt_token_ids", inspect._empty),
                ("max_tokens", inspect._empty),
                ("eos_token_ids", inspect._empty),
                ("temperature", 1.0),
                ("seed", None),
                ("lora_name", None),
            ],
        ),
        (AsyncTransformer.remove_lora, [("self", inspect._empty), ("lora_name", inspect._empty)]),
    ],
)
def test_signatures_follow_upstream(function, expected):
    assert parameters(function) == expected


def test_load_model_by_name_signature():
    from genlm_backend.llm import load_model_by_name

    assert parameters(load_model_by_name) == [("name", None), ("backend", None), ("llm_opts", None)]


def test_mock_serves_adapters_per_request():
    llm = MockAsyncLM(byte_vocab=SMALL_VOCAB)
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        llm.next_token_logprobs_sync([1], lora_name="a")
    llm.add_new_lora("weights-1", "a")
    base, adapted = (
        llm.next_token_logprobs_sync([1]),
        llm.next_token_logprobs_sync([1], lora_name="a"),
    )
    assert (base - adapted).abs().max() > 1e-3
    llm.add_new_lora("weights-2", "a")
    assert (llm.next_token_logprobs_sync([1], lora_name="a") - adapted).abs().max() > 1e-3
    llm.close()


def test_output_cache_as_an_upstream_mapping_with_maxsize():
    from genlm_backend.cache import OutputCache

    cache = OutputCache(maxsize=2)
    for name in ("a", "b", "c"):
        cache[name] = torch.full((4,), float(ord(name)))
    assert len(cache) == 2 and "a" not in cache and "b" in cache and "c" in cache
    assert cache["c"][0].item() == ord("c")
    with pytest.raises(KeyError):
        cache["a"]
    with pytest.raises(ValueError, match="budget_bytes or maxsize"):
        OutputCache()
    both = OutputCache(64, maxsize=10)  # the byte budget still binds: 4 rows of 16 bytes
    for i in range(6):
        both[i] = torch.zeros(4)
    assert len(both) == 4
