"""Drawing tokens from next-token distributions."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence

import numpy as np
import torch


def sample_token(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0) -> int:
    """Draw one index with probability ``softmax(logits / temperature)``, by inverting the CDF.

    ``logits``: 1-D tensor, on the CPU or a CUDA device, where the CDF is
    then computed (other devices' rows are moved to the CPU first). One
    exponential, one cumulative sum and one binary search (``torch.multinomial`` is slower on
    large vocabularies); accumulates in float64 so tiny probabilities keep
    their share; never returns an index of probability zero. The uniform draw
    comes from ``generator``, a CPU generator, whatever the device.
    """
    if logits.device.type not in ("cpu", "cuda"):  # MPS has no float64
        logits = logits.cpu()
    # exp(logits - max), summed in place in one float64 buffer; normalising is left
    # to the draw (u times the total).
    cdf = _scratch(logits.shape[0]) if logits.device.type == "cpu" else None
    if cdf is None:
        cdf = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    torch.sub(logits, logits.max(), out=cdf)
    if temperature != 1:
        cdf.div_(temperature)
    cdf.exp_().cumsum_(0)
    # The uniform goes in as a Python number (a kernel argument, not a copy to the device).
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    return min(int(torch.searchsorted(cdf, cdf[-1:] * u, right=True)), cdf.numel() - 1)


_SCRATCH = threading.local()


def _scratch(size: int) -> torch.Tensor:
    """This thread's float64 buffer of ``size`` for CPU CDFs, kept between draws.

    Fresh megabyte buffers per draw cost page faults whenever the C heap has
    given its memory back: 0.5 to 1.6 ms a draw on a 128k row, depending on
    what else the thread allocates, against 0.47 to 0.55 with the buffer kept
    (``benchmarks/bench_sampling.py``, one thread).
    """
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.shape[0] != size:
        buffer = _SCRATCH.buffer = torch.empty(size, dtype=torch.float64)
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
        # On the row's device: a CUDA row is not copied to the host (0.5 MB for a
        # 128k vocabulary), and its CDF costs microseconds there against a
        # millisecond on a CPU core.
        token = sample_token(logprobs, generator, temperature)
        if token in eos:
            break
        generated.append(token)
    return generated
