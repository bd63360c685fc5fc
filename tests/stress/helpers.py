"""Tools of the stress suite: references, memory sampling, forward gates and fault injection.

Ordering between the test and the model's worker thread always goes through
``threading.Event``\\ s (a forward announces that it started and waits to be
released), never through sleeps; every wait has a timeout so a broken backend
fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import random
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import psutil
import torch

ATOL = 1e-4
"""Absolute tolerance on log-probabilities against an uncached forward (fp32)."""

WAIT_S = 120.0
"""Longest any event wait may take before the test fails: a guard against a hang, far
beyond any wait of a correct build on a loaded machine (no verdict depends on it)."""

MIB = 1 << 20


# ---------------------------------------------------------------------------- references


@torch.inference_mode()
def reference_logprobs(
    model, contexts: Sequence[tuple[int, ...]], vocab_size: int, rows_per_forward: int = 64
) -> list[torch.Tensor]:
    """Plain uncached forwards: ``log_softmax(model(ids).logits[:, -1])[:vocab_size]`` per context.

    Contexts of equal length run together, at most ``rows_per_forward`` at a
    time (no padding, so each row is exactly the single-context forward);
    returns ``float32 [vocab_size]`` rows in the order of ``contexts``.
    """
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, context in enumerate(contexts):
        by_length[len(context)].append(i)
    rows: list[torch.Tensor | None] = [None] * len(contexts)
    for positions in by_length.values():
        for start in range(0, len(positions), rows_per_forward):
            chunk = positions[start : start + rows_per_forward]
            ids = torch.tensor([list(contexts[i]) for i in chunk])
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)[:, :vocab_size]
            for i, row in zip(chunk, logprobs):
                rows[i] = row
    return rows


class ReferenceChecker:
    """Checks results against :func:`reference_logprobs` in chunks, so few rows are held at once.

    ``add`` keeps a result until ``chunk`` of them wait, then checks them all
    (on the calling thread); ``flush`` checks the rest. ``num_checked`` counts
    results compared and ``max_error`` is the largest absolute difference seen;
    a difference over ``atol`` raises ``AssertionError`` naming the context.
    At most ``chunk`` results and ``chunk`` reference rows are alive at once.
    """

    def __init__(self, model, vocab_size: int, chunk: int = 128, atol: float = ATOL):
        self.model = model
        self.vocab_size = vocab_size
        self.chunk = chunk
        self.atol = atol
        self.num_checked = 0
        self.max_error = 0.0
        self._waiting: list[tuple[tuple[int, ...], torch.Tensor]] = []

    def add(self, context: Sequence[int], result: torch.Tensor) -> None:
        self._waiting.append((tuple(context), result))
        if len(self._waiting) >= self.chunk:
            self.flush()

    def flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        expected = reference_logprobs(
            self.model, [c for c, _ in waiting], self.vocab_size, rows_per_forward=self.chunk
        )
        for (context, result), want in zip(waiting, expected):
            assert result.dtype == torch.float32 and result.shape == (self.vocab_size,), context
            error = (result - want).abs().max().item()
            assert error <= self.atol, f"context {context}: max |error| {error:.2e} > {self.atol}"
            self.max_error = max(self.max_error, error)
        self.num_checked += len(waiting)


# ---------------------------------------------------------------------------- memory


class PeakSampler:
    """Samples a value (e.g. this process's RSS) in a thread every ``interval_s``; keeps the peak.

    Use as a context manager; ``peak`` is valid after exit (and while running).
    """

    def __init__(self, read: Callable[[], int] | None = None, interval_s: float = 0.005):
        process = psutil.Process()
        self._read = read or (lambda: process.memory_info().rss)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-sampler", daemon=True)
        self.peak = self._read()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, self._read())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._read())


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def resting_rss_bytes() -> int:
    """RSS after garbage collection and, on glibc, ``malloc_trim(0)``.

    Trimming hands freed heap pages back to the system, so what remains is
    memory still referenced: growth of this figure between two equal phases
    of a workload is a leak, not allocator fragmentation.
    """
    gc.collect()
    # Not glibc: the figure includes free heap pages.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd")
        + ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap_in_use_bytes() -> int | None:
    """Bytes that malloc has handed out and not yet got back, over all arenas and
    mmapped blocks (glibc's ``mallinfo2``: ``uordblks + hblkhd``); ``None`` off glibc.

    Unlike RSS this does not count freed memory the allocator keeps (glibc keeps
    freed pages in per-thread arenas, by chance more or less of them): a peak of
    this figure is the memory the workload really held at once.
    """
    mallinfo2 = _glibc_mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@functools.cache
def _glibc_mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    mallinfo2.restype = _MallInfo2
    return mallinfo2


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector can reach.

    An exact count of what Python code keeps alive (model weights, caches,
    results held anywhere), free of allocator noise; tensors referenced only
    from C++ are not seen.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            if isinstance(obj, (FakeTensor, FunctionalTensor)):
                continue  # torch.compile's traced stand-ins (kept by compiled code): no memory
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# ---------------------------------------------------------------------------- model hooks


class ForwardGate:
    """A forward pre-hook that, when armed, holds the next forward until released.

    ``hold_next()`` arms it; the next forward (in the worker thread) sets
    ``entered`` and waits for ``release()``; later forwards pass. Remove with
    ``remove()`` (or use as a context manager).
    """

    def __init__(self, model: torch.nn.Module, wait_s: float = WAIT_S):
        self.entered = threading.Event()
        self.timed_out = False
        """Whether a held forward gave up waiting for ``release()`` (and raised ``TimeoutError``)."""
        self._wait_s = wait_s
        self._release = threading.Event()
        self._armed = False
        self._lock = threading.Lock()
        self._handle = model.register_forward_pre_hook(self._hook)

    def hold_next(self) -> None:
        with self._lock:
            self.entered.clear()
            self._release.clear()
            self._armed = True

    def release(self) -> None:
        self._release.set()

    async def wait_entered(self) -> None:
        """Wait (without blocking the loop) until a held forward started."""
        is_set = await asyncio.to_thread(self.entered.wait, self._wait_s)
        assert is_set, f"no forward started within {self._wait_s} s"

    def _hook(self, module, args) -> None:
        with self._lock:
            armed, self._armed = self._armed, False
        if armed:
            self.entered.set()
            if not self._release.wait(self._wait_s):
                self.timed_out = True
                raise TimeoutError(f"the gated forward was not released within {self._wait_s} s")

    def remove(self) -> None:
        self._release.set()
        self._handle.remove()

    def __enter__(self) -> ForwardGate:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


class ForwardFaults:
    """A forward pre-hook that raises ``error`` in the forward number ``n`` for each ``n -> error`` planned.

    Forwards are counted from 0 since the hook was installed (or since ``plan``).
    """

    def __init__(self, model: torch.nn.Module):
        self.num_forwards = 0
        self._planned: dict[int, BaseException] = {}
        self._handle = model.register_forward_pre_hook(self._hook)

    def plan(self, errors: dict[int, BaseException]) -> None:
        self.num_forwards = 0
        self._planned = dict(errors)

    def _hook(self, module, args) -> None:
        number = self.num_forwards
        self.num_forwards += 1
        error = self._planned.pop(number, None)
        if error is not None:
            raise error

    def remove(self) -> None:
        self._handle.remove()

    def __enter__(self) -> ForwardFaults:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


def out_of_memory_error() -> torch.OutOfMemoryError:
    """The error a CUDA allocator raises when a batch does not fit (constructed on CPU)."""
    return torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB (injected by the stress suite)"
    )


# ---------------------------------------------------------------------------- workloads


def fresh_contexts(
    rng: random.Random, vocab_size: int, count: int, lengths=(4, 12)
) -> list[tuple[int, ...]]:
    """``count`` distinct random contexts of lengths in ``lengths`` (inclusive)."""
    contexts: dict[tuple[int, ...], None] = {}
    while len(contexts) < count:
        length = rng.randint(*lengths)
        contexts[tuple(rng.randrange(vocab_size) for _ in range(length))] = None
    return list(contexts)


def bad_cases(vocab_size: int, max_length: int) -> dict[str, tuple[object, type, str]]:
    """Every case of the input contract: name -> (input, exception type, a phrase of its message)."""
    return {
        "empty": ([], ValueError, "empty"),
        "negative": ([3, -1, 4], ValueError, r"token_ids\[1\] = -1 is outside the vocabulary"),
        "too large": ([3, vocab_size], ValueError, rf"token_ids\[1\] = {vocab_size} is outside"),
        "float element": ([3, 2.0], TypeError, r"token_ids\[1\] is 2.0 of type float"),
        "str element": ([3, "4"], TypeError, "token ids must be ints"),
        "bool element": ([True, 4], TypeError, r"token_ids\[0\] is True of type bool"),
        "none element": ([3, None], TypeError, "token ids must be ints"),
        "text": ("hello", TypeError, "encode text"),
        "not a sequence": (None, TypeError, "sequence of ints"),
        "2-D tensor": (torch.ones(2, 2, dtype=torch.long), TypeError, "must be 1-D"),
        "float tensor": (torch.tensor([1.0, 2.0]), TypeError, "integer dtype"),
        "float array": (np.array([1.5]), TypeError, "integer dtype"),
        "too long": ([1] * (max_length + 1), ValueError, "more than the model's context"),
    }


async def settle(tasks: Iterable[asyncio.Task]) -> list:
    """Outcomes of ``tasks`` (result, exception or ``CancelledError``), waiting at most ``WAIT_S``."""
    tasks = list(tasks)
    _, pending = await asyncio.wait(tasks, timeout=WAIT_S) if tasks else (set(), set())
    assert not pending, f"{len(pending)} requests still pending after {WAIT_S} s"
    outcomes = []
    for task in tasks:
        if task.cancelled():
            outcomes.append(asyncio.CancelledError())
        else:
            outcomes.append(task.exception() or task.result())
    return outcomes
