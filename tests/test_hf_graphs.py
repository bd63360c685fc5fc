"""Captured one-token steps: every replayed row equals a plain uncached forward.

Reference: ``tests/hf_reference.py``'s plain forward of a copy of the model taken
before the runner got it (adapters loaded by peft), one context at a time, no cache, fp32.
Tolerance: 1e-4 absolute on log-probabilities (``tests/hf_reference.py``).
The steps run as real CUDA graphs with ``-m gpu`` on a CUDA device, and
everywhere as graphs emulated on CPU (``tests/graph_emulation.py``: a host
value baked into a captured step gives the capture's value on every replay),
with CPU attention kernels or CUDA's emulated ones (``tests/cuda_emulation.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import weakref

import pytest
import torch

from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.cache.plan import LevelPolicy
from genlm_backend.llm.hf import graphs as hf_graphs
from genlm_backend.llm.hf.runner import HFRunner
from genlm_backend.llm.runner import Request
from tests import conftest
from tests.cuda_emulation import EmulatedCudaKernels, cuda_branches
from tests.graph_emulation import EmulatedGraphs, HostSyncDuringCapture, emulated_graphs
from tests.hf_reference import ATOL, Reference, random_workload

VOCAB = 2000

NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(
    params=[pytest.param("cuda", marks=NEEDS_CUDA), "emulated", "emulated-cuda-kernels"]
)
def graph_device(request):
    """Where captured steps run: CUDA graphs on a GPU, or graphs emulated on CPU (with CPU or CUDA attention kernels)."""
    if request.param == "cuda":
        yield "cuda"
        return
    kernels = EmulatedCudaKernels()
    cuda_kernels = request.param == "emulated-cuda-kernels"
    with emulated_graphs(), contextlib.ExitStack() as stack:
        if cuda_kernels:
            stack.enter_context(cuda_branches())
            stack.enter_context(kernels)
        yield "cpu"
    if cuda_kernels:
        assert sum(kernels.calls.values()) > 0, "the CUDA kernels were never called"


def make_runner(device, build="build_tiny_llama", budget_bytes=1 << 30, **graph_bounds):
    model = getattr(conftest, build)(VOCAB).to(device)
    model.config._attn_implementation = "sdpa"
    reference = Reference(model, VOCAB)
    runner = HFRunner(model, KVPrefixTree(budget_bytes), VOCAB)
    REFERENCES[runner] = reference
    for name, value in graph_bounds.items():
        setattr(runner.graphs, name, value)
    return runner


REFERENCES: weakref.WeakKeyDictionary[HFRunner, Reference] = weakref.WeakKeyDictionary()
"""Each runner's reference (made by :func:`make_runner`)."""


def assert_rows_match(runner: HFRunner, contexts, rows) -> None:
    for context, row in zip(contexts, rows):
        expected = REFERENCES[runner].row(context)
        torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)


def step(runner: HFRunner, contexts) -> None:
    """One batch of distinct contexts, every row checked."""
    contexts = list(dict.fromkeys(contexts))
    assert_rows_match(runner, contexts, runner.logprobs(contexts))


def prompt_of(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(length))


def extend(rng: random.Random, particles):
    return [(*p, rng.randrange(VOCAB)) for p in particles]


def random_smc_trace(runner: HFRunner, rng: random.Random, num_steps: int) -> None:
    """Particles behind prompts: resampling, particle counts changing bucket, requests leaving a step (cancelled), new prompts."""
    particles: list[tuple[int, ...]] = []
    for number in range(num_steps):
        if number % 8 == 0:  # a new prompt, long enough to be read as a level, or short and copied
            prompt = prompt_of(rng, rng.choice([20, 140, 200]))
            runner.logprobs([prompt])
            particles = extend(rng, [prompt] * rng.choice([3, 5, 8, 9]))
        present = [p for p in particles if rng.random() > 0.15] or particles[:1]
        step(runner, present)
        if rng.random() < 0.4:
            particles = [rng.choice(particles) for _ in particles]
        elif rng.random() < 0.2:  # a particle ends; or one more joins
            particles = particles[:-1] if len(particles) > 1 else particles * 2
        particles = extend(rng, particles)


WITHOUT_LEVELS = pytest.mark.parametrize(
    "graph_device", [pytest.param("cuda", marks=NEEDS_CUDA), "emulated"], indirect=True
)
"""For tests reading no shared level: CUDA's fused kernels are never called on CPU tensors then."""


def assert_steps_were_replayed(runner: HFRunner) -> None:
    stats = runner.graphs.stats
    assert stats.unsupported is None
    assert stats.num_replays > 0 and stats.num_captures > 0


# ---------------------------------------------------------------- the emulation itself


def test_emulated_replay_repeats_the_capture_s_host_values_and_reads_new_device_inputs():
    graphs = EmulatedGraphs()
    inputs = torch.zeros(3)
    storage = torch.zeros(4, 3)
    host_slot = 1

    def captured():
        storage[host_slot].copy_(inputs * 2)  # the slot is a host value: baked in
        return inputs + 1

    replay, output = graphs.capture(captured)
    inputs.copy_(torch.tensor([1.0, 2.0, 3.0]))
    host_slot = 3
    replay()
    torch.testing.assert_close(output, torch.tensor([2.0, 3.0, 4.0]))
    torch.testing.assert_close(storage[1], torch.tensor([2.0, 4.0, 6.0]))  # the capture's slot
    assert storage[3].eq(0).all()
    assert (graphs.num_captures, graphs.num_replays) == (1, 1)


def test_emulated_replay_recomputes_conversions_and_reshapes_that_copied_at_capture():
    """``to``, ``reshape`` and ``contiguous`` are views only when nothing needs converting or moving."""
    graphs = EmulatedGraphs()
    positions = torch.zeros(2, 3, dtype=torch.long)
    replay, output = graphs.capture(lambda: positions.t().float().reshape(6).contiguous() * 2)
    positions.copy_(torch.arange(6).view(2, 3))
    replay()
    torch.testing.assert_close(output, torch.tensor([0.0, 6.0, 2.0, 8.0, 4.0, 10.0]))


@pytest.mark.parametrize(
    "host_read",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: x.nonzero(),
        lambda x: x[x > 0],
        lambda x: bool(x.any()),
        lambda x: x + torch.tensor([1.0, 2.0, 3.0]),
    ],
    ids=["item", "tolist", "nonzero", "boolean-index", "bool", "tensor-from-host-data"],
)
def test_a_host_sync_or_host_data_during_capture_raises(host_read):
    inputs = torch.ones(3)
    with pytest.raises(HostSyncDuringCapture):
        EmulatedGraphs().capture(lambda: host_read(inputs))


def test_a_write_slot_taken_from_the_host_gives_wrong_rows_on_the_next_replay(monkeypatch):
    """The emulation catches what a real graph would get wrong: the eager cache's write slot, a Python int, baked in."""
    from genlm_backend.llm.hf.compat import StaticCaches

    last_inputs = {}
    host_inputs = hf_graphs.GraphStep.host_inputs

    def remembered(self, max_positions):
        last_inputs["writes"] = host_inputs(self, max_positions)[2]
        return host_inputs(self, max_positions)

    monkeypatch.setattr(hf_graphs.GraphStep, "host_inputs", remembered)
    monkeypatch.setattr(
        StaticCaches,
        "scattered",
        lambda self, layers, slots: self(layers, last_inputs["writes"][0]),
    )
    with emulated_graphs():
        runner = make_runner("cpu")
        rng = random.Random(0)
        prompt = prompt_of(rng, 140)
        runner.logprobs([prompt])
        particles = extend(rng, [prompt] * 4)
        step(runner, particles)  # the capture's step: right
        particles = extend(rng, particles)
        rows = runner.logprobs(particles)
    with pytest.raises(AssertionError):
        assert_rows_match(runner, particles, rows)


# ---------------------------------------------------------------- the runner's captured steps


@pytest.mark.parametrize("build", ["build_tiny_llama", "build_tiny_gpt2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_captured_steps_over_random_smc_traces_match_the_uncached_forward(
    graph_device, build, seed
):
    runner = make_runner(graph_device, build)
    random_smc_trace(runner, random.Random(seed), num_steps=20)
    assert_steps_were_replayed(runner)


def test_one_capture_per_bucket_and_none_per_resample(graph_device):
    runner = make_runner(graph_device)
    rng = random.Random(2)
    prompt = prompt_of(rng, 200)
    runner.logprobs([prompt])
    particles = extend(rng, [prompt] * 8)
    for _ in range(6):  # every step resampled: rows copied into the same storage
        step(runner, particles)
        particles = extend(rng, [rng.choice(particles) for _ in particles])
    stats = runner.graphs.stats
    assert (stats.num_captures, stats.num_replays) == (1, 6)
    for _ in range(3):  # 3 particles: padded to the bucket of 4
        step(runner, particles[:3])
        particles = extend(rng, particles)
    assert runner.graphs.stats.num_captures == 2
    step(runner, particles[:4])  # 4 rows: the same bucket, copied
    assert runner.graphs.stats.num_captures == 2


def test_steps_without_resampling_write_in_place_into_the_graph_s_block(graph_device):
    runner = make_runner(graph_device)
    rng = random.Random(3)
    prompt = prompt_of(rng, 140)
    runner.logprobs([prompt])
    particles = extend(rng, [prompt] * 5)
    step(runner, particles)
    first_block = runner.kv_tree.longest_prefix(particles[0])[0].block
    for _ in range(4):
        particles = extend(rng, particles)
        step(runner, particles)
    entries = [runner.kv_tree.longest_prefix(p)[0] for p in particles]
    assert all(entry.block is first_block for entry in entries)
    assert runner.graphs.stats.num_captures == 1


def test_particles_left_behind_by_a_resample_keep_their_keys_and_values(graph_device):
    """A resample renews the graph's storage: the block the tree holds there moves to a copy first."""
    runner = make_runner(graph_device)
    rng = random.Random(12)
    prompt = prompt_of(rng, 140)
    runner.logprobs([prompt])
    particles = extend(rng, [prompt] * 4)
    for _ in range(3):
        step(runner, particles)
        particles = extend(rng, particles)
    step(runner, particles)
    survivors = extend(rng, [particles[0]] * 2 + [particles[1]] * 2)
    step(runner, survivors)  # rows copied into the storage the others' entries were in
    before = runner.num_tokens_computed
    step(runner, extend(rng, particles[2:]))  # the dropped particles, one token further
    assert runner.num_tokens_computed - before == 2  # their pasts were found, not recomputed
    assert runner.graphs.stats.num_captures == 2  # 4 rows, then 2 rows


def test_own_parts_outgrowing_their_storage_move_to_a_graph_with_more_slots(graph_device):
    runner = make_runner(graph_device)
    rng = random.Random(4)
    prompt = prompt_of(rng, 140)  # a level: own parts start empty, 32 slots at first
    runner.logprobs([prompt])
    particles = extend(rng, [prompt] * 2)
    for _ in range(36):  # slots 0 to 35: the 33rd step needs the 33rd slot
        step(runner, particles)
        particles = extend(rng, particles)
    stats = runner.graphs.stats
    assert stats.num_captures == 2 and stats.num_graphs == 2
    assert stats.num_replays == 36


@WITHOUT_LEVELS
def test_own_parts_growing_past_256_slots_stay_captured_within_the_storage_bound(graph_device):
    """A long generation: own parts pass 248 tokens (256 slots with 8 free) and every step stays
    captured. Past 256 the storage grows by 128 slots, not to 512, so a bound that 512 slots
    would pass holds it; and the default bound is at least the tree's budget."""
    runner = make_runner(graph_device, budget_bytes=8 << 30)
    assert runner.graphs.max_storage_bytes == 8 << 30  # the tree's budget, over 2 GiB
    rng = random.Random(9)
    prompt = prompt_of(rng, 120)  # under min_shared_tokens: copied into each row's own part
    runner.logprobs([prompt])
    particles = extend(rng, [prompt] * 2)
    step(runner, particles)
    bytes_per_slot = runner.graphs.stats.storage_bytes // 256  # the first graph has 256 slots
    runner.graphs.max_storage_bytes = 384 * bytes_per_slot
    num_steps = 180  # own parts of 121 to 300 tokens: 256 slots, then 384
    for number in range(1, num_steps):
        particles = extend(rng, particles)
        if number % 40 == 0 or number >= num_steps - 3:
            step(runner, particles)  # rows checked against the plain forward
        else:
            runner.logprobs(particles)
    stats = runner.graphs.stats
    assert stats.unsupported is None
    assert stats.num_replays == num_steps, "a step ran eagerly"
    assert stats.num_captures == 2
    assert stats.storage_bytes <= runner.graphs.max_storage_bytes


@WITHOUT_LEVELS
def test_a_short_prompt_is_copied_into_every_row_s_own_part(graph_device):
    runner = make_runner(graph_device)
    rng = random.Random(5)
    prompt = prompt_of(rng, 20)  # under min_shared_tokens: no level
    runner.logprobs([prompt])
    particles = extend(rng, [prompt] * 4)
    for _ in range(5):
        step(runner, particles)
        particles = extend(rng, [rng.choice(particles) for _ in particles])
    assert runner.graphs.stats.num_captures == 1
    assert_steps_were_replayed(runner)


def test_a_graph_is_dropped_when_the_prompt_it_reads_is_evicted(graph_device):
    runner = make_runner(graph_device)
    rng = random.Random(6)
    for _ in range(2):
        prompt = prompt_of(rng, 140)
        runner.logprobs([prompt])
        particles = extend(rng, [prompt] * 4)
        for _ in range(2):
            step(runner, particles)
            particles = extend(rng, particles)
        assert runner.graphs.stats.num_graphs == 1
        runner.kv_tree.reserve(runner.kv_tree.budget_bytes)  # evicts everything
    assert runner.graphs.stats.num_captures == 2


def test_graphs_stay_within_their_count_and_storage_bounds(graph_device):
    runner = make_runner(graph_device, max_graphs=2)
    rng = random.Random(7)
    prompt = prompt_of(rng, 140)
    runner.logprobs([prompt])
    for num_particles in (1, 2, 3, 5, 9, 2):
        particles = extend(rng, [prompt] * num_particles)
        step(runner, particles)
        assert runner.graphs.stats.num_graphs <= 2
    assert runner.graphs.stats.num_captures == 6  # the last bucket's graph had been dropped
    runner.graphs.max_storage_bytes = 0
    step(runner, extend(rng, [prompt] * 4))  # storage over the bound: eager
    assert runner.graphs.stats.num_captures == 6
    runner.graphs.max_graphs = 0  # captured steps off
    replays = runner.graphs.stats.num_replays
    step(runner, extend(rng, [prompt] * 2))
    assert runner.graphs.stats.num_replays == replays


@WITHOUT_LEVELS
@pytest.mark.parametrize("budget_bytes", [300_000, 700_000])
def test_tiny_kv_budgets_evict_under_captured_steps_and_stay_exact(graph_device, budget_bytes):
    runner = make_runner(graph_device, budget_bytes=budget_bytes)
    random_smc_trace(runner, random.Random(8), num_steps=16)
    assert runner.kv_tree.bytes_held <= budget_bytes
    assert runner.kv_tree.stats.num_evictions > 0
    assert_steps_were_replayed(runner)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_workloads_with_every_piece_a_level_match(graph_device, seed):
    """Mixed batches: one-token passes captured, longer ones eager, cached pieces read as levels."""
    runner = make_runner(graph_device)
    runner.level_policy = LevelPolicy(min_shared_tokens=1, min_unshared_tokens=1)
    for batch in random_workload(random.Random(seed), VOCAB, num_rounds=6, per_round=9):
        step(runner, [tuple(c) for c in batch])
        step(runner, extend(random.Random(seed), [tuple(c) for c in batch]))
    assert_steps_were_replayed(runner)
    assert runner.graphs.stats.num_graphs <= runner.graphs.max_graphs


@WITHOUT_LEVELS
def test_models_whose_levels_are_unsupported_run_eagerly(graph_device):
    model = conftest.build_tiny_llama(VOCAB).to(graph_device)
    model.config._attn_implementation = "eager"
    reference = Reference(model, VOCAB)
    runner = HFRunner(model, KVPrefixTree(1 << 30), VOCAB)
    REFERENCES[runner] = reference
    rng = random.Random(9)
    prompt = prompt_of(rng, 40)
    particles = extend(rng, [prompt] * 3)
    for _ in range(3):
        step(runner, particles)
        particles = extend(rng, particles)
    assert "shared levels unsupported" in runner.graphs.stats.unsupported
    assert runner.graphs.stats.num_captures == 0


def test_each_adapter_gets_its_own_graph_and_unloading_drops_them(graph_device, tmp_path):
    peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    from genlm_backend.llm.runner import Adapter

    torch.manual_seed(0)
    lora = peft.get_peft_model(
        conftest.build_tiny_llama(VOCAB),
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False
        ),
    )
    lora.save_pretrained(tmp_path / "adapter")
    runner = make_runner(graph_device)
    adapter = Adapter("keys", 1, str(tmp_path / "adapter"))
    runner.load_adapter(adapter)
    rng = random.Random(10)
    prompt = prompt_of(rng, 140)
    particles = {name: extend(rng, [prompt] * 4) for name in (adapter, None)}
    for number in range(4):
        requests = [Request(name, p) for name, group in particles.items() for p in group]
        rows = runner.run(requests)
        for request, row in zip(requests, rows):
            torch.testing.assert_close(row, REFERENCES[runner].of(request), atol=ATOL, rtol=0)
        particles = {
            name: extend(rng, [rng.choice(group) for group_row in group] if number % 2 else group)
            for name, group in particles.items()
        }
    stats = runner.graphs.stats
    assert stats.num_captures == 2 and stats.num_graphs == 2  # one per adapter, none per resample
    base = REFERENCES[runner].of(Request(None, particles[None][0]))
    adapted = REFERENCES[runner].of(Request(adapter, particles[None][0]))
    assert (base - adapted).abs().max() > 1e-3  # the adapter changes keys/values
    runner.unload_adapter(adapter)
    assert runner.graphs.stats.num_graphs == 0
    step(runner, particles[None])
    assert runner.graphs.stats.num_captures == 3


@pytest.mark.parametrize("graph_device", [pytest.param("cuda", marks=NEEDS_CUDA)], indirect=True)
def test_steps_are_captured_after_every_graph_of_the_process_is_gone(graph_device):
    """torch releases a graph pool with the last graph captured into it: later runners still capture."""
    rng = random.Random(3)
    for _ in range(3):
        runner = make_runner(graph_device)
        particles = extend(rng, [prompt_of(rng, 20)] * 3)
        for _ in range(2):
            step(runner, particles)
            particles = extend(rng, particles)
        assert_steps_were_replayed(runner)
        runner.graphs.clear()
        del runner
        gc.collect()  # every graph of this process is gone now


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_garbage_collection_during_a_capture_leaves_it_valid():
    """Unreachable runners whose graphs a collection inside a capture would destroy."""
    rng = random.Random(5)
    for _ in range(2):
        old = make_runner("cuda")
        random_smc_trace(old, rng, num_steps=4)
        assert_steps_were_replayed(old)
        cycle: list = [old]
        cycle.append(cycle)  # freed only by the cyclic collector
        del old, cycle
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # a collection at almost every allocation
    try:
        runner = make_runner("cuda", "build_tiny_gpt2")
        random_smc_trace(runner, rng, num_steps=12)
    finally:
        gc.set_threshold(*thresholds)
    assert_steps_were_replayed(runner)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_another_thread_synchronising_with_the_device_during_captures_leaves_them_valid():
    """As the event loop's thread does when it draws tokens from CUDA rows while the worker captures."""
    import threading

    started, stop = threading.Event(), threading.Event()
    num_syncs = 0

    def synchronise():
        nonlocal num_syncs
        x = torch.ones(1024, device="cuda")
        while not stop.is_set():
            num_syncs += int((x * 2).sum().item() == 2048)  # a kernel, then a copy to the host
            started.set()

    thread = threading.Thread(target=synchronise)
    thread.start()
    try:
        started.wait()
        runner = make_runner("cuda")
        random_smc_trace(runner, random.Random(6), num_steps=12)
    finally:
        stop.set()
        thread.join()
    assert_steps_were_replayed(runner)
    assert num_syncs > 0


async def test_cancelled_requests_leave_the_captured_steps_of_the_others_exact(tiny_llama):
    from genlm_backend.llm.hf import AsyncTransformer
    from tests.hf_reference import assert_matches_reference

    model, tokenizer = tiny_llama
    rng = random.Random(11)
    with emulated_graphs():
        llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
        prompt = list(prompt_of(rng, 140))
        await llm.next_token_logprobs(prompt)
        particles = [prompt + [t] for t in range(6)]
        for number in range(6):
            tasks = [asyncio.create_task(llm.next_token_logprobs(p)) for p in particles]
            if number % 2:
                await asyncio.sleep(0)  # submitted: cancelled while waiting for their batch
            for task in rng.sample(tasks, 2):
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for context, result in zip(particles, results):
                if not isinstance(result, asyncio.CancelledError):
                    assert_matches_reference(llm, context, result)
            particles = [p + [rng.randrange(VOCAB)] for p in particles]
        assert_steps_were_replayed(llm.runner)
        llm.close()
