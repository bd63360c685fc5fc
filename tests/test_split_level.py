"""A level's attention split along its keys: the chunks merged by log-sum-exp equal the unsplit attention.

The torch reference (``genlm_backend.llm.hf.split_level``) runs everywhere. The
Triton kernels (``genlm_backend.llm.hf.split_level_fused``) run on CUDA
(``-m gpu``) or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``,
bfloat16 products made right by ``tests/triton_emulation.py``); elsewhere they
skip. Unsplit attention: torch's ``scaled_dot_product_attention`` over the
whole level, and the log-sum-exp of the float32 scores.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from genlm_backend.cache.kv_block import KVBlock
from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.cache.plan import LevelPolicy
from genlm_backend.llm.hf import split_level
from genlm_backend.llm.hf.attention import Cascade, Level, cascade_attention
from genlm_backend.llm.hf.runner import HFRunner
from genlm_backend.llm.hf.split_level import split_level_reference
from tests.conftest import build_tiny_llama
from tests.hf_reference import ATOL, reference

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not INTERPRETED or importlib.util.find_spec("triton") is None,
            reason="the split kernel runs on the CPU only under Triton's interpreter "
            "(TRITON_INTERPRET=1, Triton installed)",
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
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Absolute, on outputs of values drawn from N(0, 1). Half precision: the kernel rounds each
weight to the values' dtype before their product (as flash attention does) and its output once."""


def level_inputs(num_rows, num_q_heads, num_kv_heads, num_keys, head_dim, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(num_rows, num_q_heads, head_dim, generator=generator)
    key, value = torch.randn(2, num_kv_heads, num_keys, head_dim, generator=generator)
    return [t.to(device, dtype) for t in (query, key, value)]


def unsplit(query, key, value, scale):
    """torch's attention over the whole level (``[N, Hq, D]``) and the scores' log-sum-exp (``[N, Hq]``)."""
    output = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], key[None], value[None], scale=scale, enable_gqa=True
    )[0].transpose(0, 1)
    grouped_keys = key.float().repeat_interleave(query.shape[1] // key.shape[0], dim=0)
    scores = torch.einsum("nhd,hsd->nhs", query.float(), grouped_keys) * scale
    return output, scores.logsumexp(-1)


def assert_close(actual, expected, atol):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=0)


# ----------------------------------------------------------------------- the reference


@pytest.mark.parametrize("chunk_keys", [1, 16, 40, 100, 1000])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_reference_equals_unsplit_attention(chunk_keys, heads):
    query, key, value = level_inputs(5, *heads, 100, 32, torch.float32, "cpu")
    output, lse = split_level_reference(query, key, value, 0.2, chunk_keys)
    expected, expected_lse = unsplit(query, key, value, 0.2)
    assert_close(output, expected, 1e-5)
    assert_close(lse, expected_lse, 1e-5)


def test_reference_over_no_keys_weighs_nothing():
    query, key, value = level_inputs(3, 4, 2, 0, 16, torch.float32, "cpu")
    output, lse = split_level_reference(query, key, value, 0.2, 8)
    assert torch.equal(output, torch.zeros(3, 4, 16)) and torch.equal(
        lse, torch.full((3, 4), -torch.inf)
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"query": torch.zeros(2, 3, 16)}, "not a multiple of 2 key/value heads"),
        ({"query": torch.zeros(2, 4, 32)}, "head size 32 is not the keys' 16"),
        ({"key": torch.zeros(2, 5, 16, dtype=torch.float64)}, "expected one dtype"),
        ({"value": torch.zeros(2, 6, 16)}, "expected query"),
        ({"chunk_keys": 0}, "chunk_keys must be positive"),
    ],
)
def test_bad_inputs_are_refused_naming_the_problem(change, message):
    inputs = {
        "query": torch.zeros(2, 4, 16),
        "key": torch.zeros(2, 5, 16),
        "value": torch.zeros(2, 5, 16),
        "scale": 1.0,
        "chunk_keys": 4,
    }
    with pytest.raises(ValueError, match=message):
        split_level_reference(**(inputs | change))


def test_the_split_kernel_runs_on_cuda_only_for_head_sizes_its_tiles_fit():
    triton_installed = importlib.util.find_spec("triton") is not None
    assert split_level.uses_split_kernel(torch.device("cuda"), 128) is triton_installed
    assert not split_level.uses_split_kernel(torch.device("cuda"), 80)  # not a power of two
    assert not split_level.uses_split_kernel(torch.device("cuda"), 8)  # below the products' 16
    assert not split_level.uses_split_kernel(torch.device("cpu"), 64)  # torch's CPU kernel stays


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton installed")
def test_chunks_fill_the_device_and_no_chunk_is_short():
    """The automatic chunking: about two programs per multiprocessor, chunks of 256 keys or more
    in whole blocks, no split where the unsplit programs fill the device or the level is short."""
    from genlm_backend.llm.hf.split_level_fused import chunk_keys_for, splits

    # 64 rows x 4 grouped heads = 256 queries per key/value head: 4 blocks x 8 heads = 32 programs
    assert chunk_keys_for(4096, 32, 132, 64) == 512  # 8 chunks, 256 programs on 132 SMs
    assert chunk_keys_for(16384, 32, 132, 64) == 1856  # 9 chunks (the last one ragged)
    assert chunk_keys_for(1024, 32, 132, 64) == 256  # 4 chunks: none shorter than 256 keys
    assert chunk_keys_for(300, 32, 132, 64) == 320  # one chunk
    assert chunk_keys_for(4096, 512, 132, 64) == 4096  # one chunk: 512 programs already
    assert not splits(
        256, 8, 4096, 128, torch.device("cpu")
    )  # the interpreter: one program at a time


# ----------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_keys", [None, 100, 64, 40, 16])  # None: the device's choice
def test_kernel_equals_the_reference_and_unsplit_attention(device, dtype, chunk_keys):
    """3 rows x 8 query heads over 2 key/value heads, 100 keys: one chunk, chunks of whole key
    blocks and a ragged last one, chunks that end inside a block, 7 chunks."""
    from genlm_backend.llm.hf.split_level_fused import split_level_attention

    query, key, value = level_inputs(3, 8, 2, 100, 32, dtype, device)
    output, lse = split_level_attention(query, key, value, 0.2, chunk_keys)
    assert output.dtype == dtype and lse.dtype == torch.float32
    expected, expected_lse = split_level_reference(query, key, value, 0.2, chunk_keys or 100)
    assert_close(output, expected, TOLERANCE[dtype])
    assert_close(lse, expected_lse, 1e-5)
    unsplit_output, unsplit_lse = unsplit(query, key, value, 0.2)
    assert_close(output, unsplit_output, TOLERANCE[dtype])
    assert_close(lse, unsplit_lse, 1e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    "num_rows, num_q_heads, num_kv_heads, head_dim",
    [(1, 1, 1, 16), (2, 4, 4, 64), (9, 8, 2, 16), (40, 2, 1, 32)],  # 40 x 2: several query blocks
)
def test_kernel_serves_grouped_heads_and_strided_views(
    device, num_rows, num_q_heads, num_kv_heads, head_dim
):
    """Queries as a view of ``[Hq, N, D]`` storage, the level a slice of a longer block's keys."""
    from genlm_backend.llm.hf.split_level_fused import split_level_attention

    query, key, value = level_inputs(
        num_q_heads, num_rows, num_kv_heads, 90, head_dim, torch.float32, device
    )
    query = query.transpose(0, 1)  # [N, Hq, D], heads outermost in memory
    key, value = key[:, 10:83], value[:, 10:83]  # 73 keys
    output, lse = split_level_attention(query, key, value, 0.3, 32)
    expected, expected_lse = unsplit(query, key, value, 0.3)
    assert_close(output, expected, 1e-5)
    assert_close(lse, expected_lse, 1e-5)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_over_no_keys_or_no_queries(device):
    from genlm_backend.llm.hf.split_level_fused import split_level_attention

    query, key, value = level_inputs(3, 4, 2, 0, 16, torch.float32, device)
    output, lse = split_level_attention(query, key, value, 0.2)
    assert torch.equal(output.cpu(), torch.zeros(3, 4, 16))
    assert torch.equal(lse.cpu(), torch.full((3, 4), -torch.inf))
    query, key, value = level_inputs(0, 4, 2, 50, 16, torch.float32, device)
    output, lse = split_level_attention(query, key, value, 0.2)
    assert output.shape == (0, 4, 16) and lse.shape == (0, 4)
    with pytest.raises(ValueError, match="head sizes 16 to 256"):
        split_level_attention(*level_inputs(1, 2, 1, 5, 24, torch.float32, device), 0.2)


# ----------------------------------------------------------------------- wired into the cascade


@pytest.fixture
def split_levels(monkeypatch):
    """Levels read by the split kernel on this device (on the CPU: under the interpreter), in
    chunks of 32 keys (several, the last one ragged, merged), each call's level length recorded;
    the test fails if none ran."""
    from genlm_backend.llm.hf import split_level_fused

    lengths = []
    kernel = split_level_fused.split_level_attention

    def in_chunks(query, key, value, scale):
        lengths.append(key.shape[1])
        return kernel(query, key, value, scale, chunk_keys=32)

    monkeypatch.setattr(split_level, "uses_split_kernel", lambda device, head_dim: True)
    monkeypatch.setattr(split_level_fused, "splits", lambda *shape: True)
    monkeypatch.setattr(split_level_fused, "split_level_attention", in_chunks)
    yield lengths
    assert lengths, "the split kernel never ran"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_cascade_attention_with_split_levels_equals_attention_over_the_concatenation(
    device, split_levels
):
    """Three rows behind a level all read, a level rows 0 and 2 read, and a level with a
    row bias that leaves row 1 out; each row against attention over its keys put together."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(3, 4, 2, 32, generator=generator)  # [B, Hq, L, D]
    own_keys, own_values = torch.randn(2, 3, 2, 6, 32, generator=generator)
    mask = torch.zeros(3, 1, 2, 6)
    mask[:, :, 0, 5] = -torch.inf  # the first query does not see the last own key
    mask[1, :, :, :2] = -torch.inf
    block_keys, block_values = torch.randn(2, 2, 2, 80, 32, generator=generator)
    block = KVBlock(torch.stack([block_keys, block_values])[None].to(device))
    row_bias = torch.tensor([0.0, -torch.inf, 0.0], device=device)
    levels = [
        Level(block, 0, 0, 70, None),
        Level(block, 1, 5, 12, torch.tensor([0, 2], device=device)),
        Level(block, 1, 30, 40, None, row_bias),
    ]
    on_device = [t.to(device) for t in (query, own_keys, own_values, mask)]
    output = cascade_attention(0, *on_device, 0.125, Cascade(levels)).cpu()
    every_level = [(0, 0, 70), (1, 5, 17), (1, 30, 70)]
    read = {0: every_level, 1: every_level[:1], 2: every_level}
    for row, spans in read.items():
        keys = [block_keys[r, :, a:b] for r, a, b in spans] + [own_keys[row]]
        values = [block_values[r, :, a:b] for r, a, b in spans] + [own_values[row]]
        hidden = [torch.zeros(2, b - a) for _, a, b in spans] + [mask[row, 0]]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[row], torch.cat(keys, 1), torch.cat(values, 1), torch.cat(hidden, 1),
            scale=0.125, enable_gqa=True,
        )  # fmt: skip
        assert_close(output[row], expected.transpose(0, 1), 1e-5)
    assert len(split_levels) == 3


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_runner_rows_behind_split_levels_equal_a_plain_forward(device, split_levels):
    """The runner's rows behind a cached prompt and two continuations of it (nested levels: every
    row reads the prompt, two rows one continuation), in a one-token step and a longer pass,
    against an uncached forward."""
    model = build_tiny_llama(2000).to(device)
    runner = HFRunner(model, KVPrefixTree(1 << 30), 2000)
    runner.level_policy = LevelPolicy(min_shared_tokens=32)  # levels from 32 tokens: short ones
    rng = random.Random(5)
    prompt = [rng.randrange(2000) for _ in range(50)]
    longer, other = ([*prompt, *(rng.randrange(2000) for _ in range(40))] for _ in range(2))
    runner.logprobs([tuple(prompt)])
    runner.logprobs([tuple(longer), tuple(other)])  # behind the prompt, read as a level
    step = [[*prompt, 7], [*longer, 11], [*longer, 12], [*other, 13]]
    longer_pass = [[*prompt, 8, 9, 10], [*longer, *(rng.randrange(2000) for _ in range(20))]]
    for batch in (step, longer_pass):
        rows = runner.logprobs([tuple(context) for context in batch])
        for row, context in zip(rows, batch):
            assert_close(row, reference(model, context)[:2000], ATOL)
    assert set(split_levels) == {50, 40}  # the lengths of the levels the kernel read


@pytest.mark.skipif(
    not INTERPRETED or importlib.util.find_spec("triton") is None,
    reason="the benchmark's CPU smoke run needs Triton's interpreter (TRITON_INTERPRET=1)",
)
def test_the_gpu_benchmark_runs_on_the_cpu_and_its_splits_agree(monkeypatch, capsys):
    """``benchmarks/gpu/bench_split_level.py`` at a tiny size: every way runs, every split within
    float32 rounding of the unsplit attention."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "bench_split_level.py"
    bench = runpy.run_path(str(script))
    argv = "--device cpu --rows 3 --heads 4 2 --head-dim 16 --keys 100 --dtype float32"
    monkeypatch.setattr(sys, "argv", [str(script), *argv.split(), "--chunk-keys", "32"])
    bench["main"]()
    printed = capsys.readouterr().out
    found = re.search(r"outputs within (\S+), log-sum-exps within (\S+);", printed)
    assert found is not None, printed
    assert float(found[1]) < 1e-5 and float(found[2]) < 1e-5
    for way in ("unsplit", "split (auto)", "split 32 keys"):
        assert re.search(rf"^S=100 {re.escape(way)}: [\d.]+ us", printed, re.MULTILINE), printed
