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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("readers", ["every row", "rows 0 and 2", "no level"])
def test_fused_kernels_fold_a_small_step_as_plain_attention_does(device, readers):
    """Both kernels at a small shape, called directly: a captured step's layout (3 rows, 4 query
    heads over 2, head size 16, 64 own slots) behind a 256-token level read by every row, by
    rows 0 and 2, or no level; against attention over each row's keys put together, and the
    torch operations' order."""
    from genlm_backend.cache.kv_block import KVBlock
    from genlm_backend.llm.hf.attention import Level
    from genlm_backend.llm.hf.exact.fused import fused_exact_attention

    generator = torch.Generator().manual_seed(7)
    query = torch.randn(3, 4, 1, 16, generator=generator).to(device)  # [B, Hq, 1, D]
    level_kv = torch.randn(2, 1, 2, 256, 16, generator=generator).to(device)
    own_keys, own_values = torch.randn(2, 3, 2, 64, 16, generator=generator).to(device)
    writes = torch.tensor([10, 63, 30], device=device)  # each row's last own slot
    rows = None if readers == "every row" else torch.tensor([0, 2], device=device)
    levels = [] if readers == "no level" else [(Level(KVBlock(level_kv[None]), 0, 0, 256, rows), 0)]
    layout = exact.ExactLayout.of_step(
        splits=torch.full((3,), 256 if levels else 0, device=device),
        firsts=torch.zeros(3, dtype=torch.long, device=device),
        writes=writes,
        levels=levels,
        num_groups=2,
        num_slots=64,
    )
    fused = fused_exact_attention(0, query, own_keys, own_values, 0.25, layout)  # [B, 1, Hq, D]
    torch_order = exact.exact_attention(0, query, own_keys, own_values, 0.25, layout)
    torch.testing.assert_close(fused, torch_order, atol=1e-5, rtol=0)
    for row in range(3):
        reads_level = levels and (rows is None or row in (0, 2))
        keys = [own_keys[row, :, : writes[row] + 1]]
        values = [own_values[row, :, : writes[row] + 1]]
        if reads_level:
            keys, values = [level_kv[0, 0], *keys], [level_kv[1, 0], *values]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[row], torch.cat(keys, 1), torch.cat(values, 1), scale=0.25, enable_gqa=True
        )  # [Hq, 1, D]
        torch.testing.assert_close(fused[row], expected.transpose(0, 1), atol=1e-5, rtol=0)
