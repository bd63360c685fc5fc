"""What the CPU's span order takes from torch's CPU attention kernel, checked on this machine.

:mod:`genlm_backend.llm.hf.exact.spans` hands the kernel a fixed number of keys
per batch entry and a multiple of 16 queries, and relies on a query's output and
log-sum-exp then having the same bits whatever else the call holds. These tests
hold the kernel to that; the rows themselves are checked against rows computed
alone in ``tests/test_deterministic.py``.
"""

from __future__ import annotations

import pytest
import torch

from genlm_backend.llm.hf.exact import BLOCK_TOKENS, SPAN_TOKENS, exp_of_difference
from genlm_backend.llm.hf.exact.spans import QUERY_ROWS, padded_queries

flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
HEAD = 64


def attend(queries, keys, values, mask=None):
    return flash(queries, keys, values, 0.0, False, attn_mask=mask, scale=HEAD**-0.5)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("num_keys", [BLOCK_TOKENS, SPAN_TOKENS])
def test_a_query_s_bits_do_not_depend_on_the_other_queries_of_the_call(dtype, num_keys):
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(4, 3, num_keys, HEAD, generator=gen).to(dtype)
    values = torch.randn(4, 3, num_keys, HEAD, generator=gen).to(dtype)
    queries = torch.randn(1, 3, 800, HEAD, generator=gen).to(dtype)
    out, lse = attend(queries.expand(4, -1, -1, -1), keys, values)
    # counts past the kernel's query blocks of 32, 64 and 256, and rows moved within them
    for first, count in [(0, 16), (0, 48), (16, 96), (5, 192), (100, 256), (7, 784)]:
        part = queries[:, :, first : first + count]
        found_out, found_lse = attend(part.expand(4, -1, -1, -1), keys, values)
        assert torch.equal(found_out, out[:, :, first : first + count])
        assert torch.equal(found_lse, lse[:, :, first : first + count])
    alone_out, alone_lse = attend(queries[:, :, :16].contiguous(), keys[2:3], values[2:3])
    assert torch.equal(alone_out, out[2:3, :, :16]), "one batch entry, queries not expanded"
    assert torch.equal(alone_lse, lse[2:3, :, :16])


def test_a_mask_of_zeros_gives_the_bits_of_no_mask_and_hidden_keys_weigh_nothing(dtype):
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, SPAN_TOKENS, HEAD, generator=gen).to(dtype)
    values = torch.randn(2, 3, SPAN_TOKENS, HEAD, generator=gen).to(dtype)
    queries = torch.randn(2, 3, 32, HEAD, generator=gen).to(dtype)
    out, lse = attend(queries, keys, values)
    zeros = torch.zeros(2, 1, 32, SPAN_TOKENS)
    assert torch.equal(attend(queries, keys, values, zeros)[0], out)
    assert torch.equal(attend(queries, keys, values, zeros)[1], lse)
    hidden = zeros.clone()
    hidden[..., 200:] = -torch.inf
    masked_out, masked_lse = attend(queries, keys, values, hidden)
    changed = values.clone()
    changed[:, :, 200:] = 1e4  # a hidden key's value does not reach the output
    assert torch.equal(attend(queries, keys, changed, hidden)[0], masked_out)
    reference = (
        torch.softmax(
            (queries.double() @ keys[:, :, :200].double().transpose(-1, -2)) * HEAD**-0.5, -1
        )
        @ values[:, :, :200].double()
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(masked_out.double(), reference, atol=tolerance)
    assert masked_lse.isfinite().all()


def test_the_thread_count_does_not_change_a_query_s_bits(dtype):
    """One thread against two (set here, whatever the machine's count: the kernel splits
    its batch entries and heads over them)."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 2, SPAN_TOKENS, HEAD, generator=gen).to(dtype)
    values = torch.randn(3, 2, SPAN_TOKENS, HEAD, generator=gen).to(dtype)
    queries = torch.randn(3, 2, 64, HEAD, generator=gen).to(dtype)
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch build runs one thread only (no OpenMP): no counts to compare")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        single = attend(queries, keys, values)
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2, "an OpenMP build kept another thread count"
        several = attend(queries, keys, values)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single[0], several[0]) and torch.equal(single[1], several[1])


def test_a_weight_at_the_top_is_exactly_one():
    """A span's weight ``exp(m - top)`` at its own top is 1: merging one span is exact."""
    scales = torch.randn(5, 7, 3) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1e30])[:, None, None]
    assert torch.equal(exp_of_difference(scales, scales), torch.ones_like(scales))


def test_queries_are_padded_to_multiples_of_the_query_rows():
    assert [padded_queries(n) for n in (1, 3, 16, 17, 96, 97)] == [16, 16, 16, 32, 96, 112]
    assert all(padded_queries(n) % QUERY_ROWS == 0 for n in range(1, 300))
