"""Exact attention's fused kernels (``genlm_backend.llm.hf.exact.fused``): the same function as the torch order's.

They run where Triton compiles them (CUDA, ``-m gpu``) or under its
interpreter (``TRITON_INTERPRET=1 GENLM_EXACT_FUSED=1``, products made
row-independent: ``tests/triton_emulation.py``). There, every test of
``tests/test_deterministic.py`` checks their rows bitwise against the rows
computed alone; here they are checked against the torch operations'
order within rounding, and against a plain forward. Elsewhere they skip.
"""

from __future__ import annotations

import random

import pytest
import torch

from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.llm.hf import exact
from genlm_backend.llm.hf.runner import HFRunner
from tests.conftest import build_tiny_llama
from tests.hf_reference import ATOL, reference
from tests.triton_emulation import interpreted

VOCAB = 2000

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not interpreted(),
            reason="the fused kernels run on the CPU only under Triton's interpreter "
            "(TRITON_INTERPRET=1 GENLM_EXACT_FUSED=1)",
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def rows_of(model, history, batch) -> list[torch.Tensor]:
    runner = HFRunner(model, KVPrefixTree(1 << 30), VOCAB, deterministic=True)
    for contexts in history:
        runner.logprobs([tuple(context) for context in contexts])
    return [row.float().cpu() for row in runner.logprobs([tuple(context) for context in batch])]


@pytest.mark.parametrize("device", DEVICES)
def test_fused_rows_agree_with_the_torch_order_and_a_plain_forward(device, monkeypatch):
    """A batch behind two cached prompts (levels read by some rows, nested, none), a long prefill
    in position runs, and a step: the fused kernels' rows against the torch operations' rows."""
    assert exact.uses_fused_kernels(torch.device(device))
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_tiny_llama(VOCAB).to(device=device, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    model.config.max_position_embeddings = (
        1024  # two nested 256-token levels and more (RoPE has no limit)
    )
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (300, 20)]
    nested = [*prompts[0], *(rng.randrange(VOCAB) for _ in range(260))]  # a second level
    batch = [
        [*prompts[0], rng.randrange(VOCAB)],
        [*prompts[0], *(rng.randrange(VOCAB) for _ in range(40))],
        [*nested, rng.randrange(VOCAB)],
        [*prompts[1], *(rng.randrange(VOCAB) for _ in range(5))],
        [rng.randrange(VOCAB) for _ in range(200)],  # no cached prefix: positions in runs
    ]
    history = [prompts, [nested]]
    fused = rows_of(model, history, batch)
    monkeypatch.setattr(exact, "uses_fused_kernels", lambda device: False)
    torch_order = rows_of(model, history, batch)
    # bfloat16 rows round their attention outputs and every projection: compare loosely there
    atol = ATOL if dtype == torch.float32 else 0.1
    for row, other, context in zip(fused, torch_order, batch):
        torch.testing.assert_close(row, other, atol=atol, rtol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(
                row, reference(model, context)[:VOCAB].cpu(), atol=ATOL, rtol=0
            )


@pytest.mark.parametrize("device", DEVICES)
def test_row_means_are_means_and_a_row_s_bits_do_not_depend_on_the_others(device):
    """An RMS norm's mean under :class:`RowMeans`: torch's mean within rounding, and a row's
    bits the same alone, among 5 rows, and among 300 (torch's CUDA launch shape follows the count)."""
    from genlm_backend.llm.hf.exact.fused import RowMeans, row_means

    torch.manual_seed(0)
    x = torch.randn(300, 2048, device=device)
    with RowMeans():
        means = [x[:n].pow(2).mean(-1, keepdim=True) for n in (1, 5, 300)]
        untouched = x.mean(0)  # not over the last dimension: torch's own
    torch.testing.assert_close(means[2], x.pow(2).mean(-1, keepdim=True), atol=1e-5, rtol=1e-6)
    assert torch.equal(means[2], row_means(x.pow(2), keepdim=True))  # the mode computed them
    assert means[0].shape == (1, 1) and untouched.shape == (2048,)
    assert torch.equal(means[0], means[1][:1]) and torch.equal(means[1], means[2][:5])
