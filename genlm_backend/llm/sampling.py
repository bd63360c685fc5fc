"""Drawing tokens from next-token distributions."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import numpy.random  # numpy loads it on first use: at import here, not in a first sample
import torch


def sample_token(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0) -> int:
    """Draw one index with probability ``softmax(logits / temperature)``, by inverting the CDF.

    ``logits``: 1-D tensor, on the CPU or a CUDA device, where the draw is
    then computed (other devices' rows are moved to the CPU first; only the
    index comes back to the host). Weights ``exp((logits - max) / T)``,
    accumulated in float64 so tiny probabilities keep their share (never an
    index of probability zero). ``torch.multinomial`` is slower on large
    vocabularies. The uniform draw comes from ``generator``, a CPU
    generator, whatever the device: one per call, so a seed gives the same
    uniforms on every device (and the same tokens but where rounding moves
    the edge of a token's share across one).
    """
    if logits.device.type not in ("cpu", "cuda"):  # MPS has no float64
        logits = logits.cpu()
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()  # exact for half precisions: the subtraction below must not round
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    if logits.device.type == "cpu":
        return _draw_on_cpu(logits, u, temperature)
    # On the device: one float64 CDF, the uniform as a kernel argument, one index back.
    cdf = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    torch.sub(logits, logits.max(), out=cdf)
    if temperature != 1:
        cdf.div_(temperature)
    cdf.exp_().cumsum_(0)
    return min(int(torch.searchsorted(cdf, cdf[-1:] * u, right=True)), cdf.numel() - 1)


BLOCK = 1024
"""Weights per block of :func:`_draw_on_cpu`'s two-level search."""


def _draw_on_cpu(logits: torch.Tensor, u: float, temperature: float) -> int:
    """The index at ``u`` of the row's CDF, found block by block.

    The weights go into this thread's buffer, kept between draws (fresh
    megabyte buffers cost page faults whenever the C heap has given its
    memory back). Their float64 sums per block of :data:`BLOCK` locate the
    block, and one block's float64 cumulative sum the index: a cumulative
    sum of 1,024 entries instead of the whole row, float32 exponentials
    instead of float64 (``benchmarks/bench_sampling.py`` measures it against a
    float64 softmax into fresh buffers). All of it is numpy's, in this thread:
    no torch operation, so no OpenMP team of this thread's is started and
    left spinning (the model's steps keep the process's one team).
    """
    size = logits.shape[0]
    padded = _weights_buffer(size).numpy()  # [num_blocks * BLOCK], zeros past ``size``
    weights = padded[:size]
    values = logits.detach().numpy()
    np.subtract(values, values.max(), out=weights, casting="same_kind")
    if temperature != 1:
        np.divide(weights, temperature, out=weights)
    np.exp(weights, out=weights)
    blocks = padded.reshape(-1, BLOCK)
    sums = blocks.sum(1, dtype=np.float64)
    ends = np.cumsum(sums)
    target = u * ends[-1]
    block = int(np.searchsorted(ends, target, side="right"))
    if block == len(ends):  # u * total rounded up to the total: the last possible block
        block = int(np.flatnonzero(sums)[-1])
        within = sums[block]
    else:
        within = target - (ends[block - 1] if block else 0.0)
    index = int(np.searchsorted(np.cumsum(blocks[block], dtype=np.float64), within, side="right"))
    if index >= BLOCK or block * BLOCK + index >= size:  # rounding ran past the block's sum
        index = int(np.flatnonzero(blocks[block])[-1])
    return block * BLOCK + index


_SCRATCH = threading.local()


def _weights_buffer(size: int) -> torch.Tensor:
    """This thread's float32 buffer for a row of ``size``: whole blocks, zeros past ``size``."""
    buffer = getattr(_SCRATCH, "weights", None)
    if buffer is None or _SCRATCH.size != size:
        buffer = _SCRATCH.weights = torch.zeros(-(-size // BLOCK) * BLOCK)
        _SCRATCH.size = size
    return buffer


def check_sampling_options(max_tokens: int, temperature: float) -> None:
    """Raise ``ValueError`` unless ``max_tokens >= 0`` and ``temperature > 0``."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or from the OS when ``None``."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def stream_seeds(seed: int | None, num_streams: int) -> list[int | None]:
    """Independent per-stream seeds derived from ``(seed, i)`` (all ``None`` without a seed)."""
    if seed is None:
        return [None] * num_streams
    children = np.random.SeedSequence(seed).spawn(num_streams)
    return [int(child.generate_state(1, dtype=np.uint64)[0] >> 1) for child in children]


async def sample_continuation(
    next_logprobs: Callable[[list[int]], Awaitable[torch.Tensor]],
    prompt: Sequence[int],
    max_tokens: int,
    eos_token_ids: Sequence[int],
    temperature: float,
    generator: torch.Generator,
) -> list[int]:
    """Tokens drawn one by one after ``prompt``; stops after ``max_tokens`` or before the first eos token."""
    eos = set(eos_token_ids)
    generated: list[int] = []
    for _ in range(max_tokens):
        logprobs = await next_logprobs(list(prompt) + generated)
        # On the row's device: a CUDA row is not copied to the host, and its CDF
        # is a few kernels there instead of a pass over the row on a CPU core.
        token = sample_token(logprobs, generator, temperature)
        if token in eos:
            break
        generated.append(token)
    return generated
