"""A particle step against the hardware's limit, in one process: R, G, ours-runner and ours.

Workload ``PxS@T`` (as ``bench_long_prompt.py``): P particles behind one
T-token prompt take S one-token steps, every row distinct. Per step:

* **R**, the limit: the bytes a step must read (the weights the step
  touches, the prompt's keys/values once, the particles' own keys/values, the
  logits written and read back by the log-softmax) over the device's copy
  bandwidth, measured in this process (a large device-to-device copy: bytes
  read and written over its time).
* **G**, a well-built engine step: the transformers model stepping the P rows
  over a ``StaticCache`` of their own tokens, captured as one CUDA graph on
  CUDA (eager elsewhere, or where capture fails: then said so), plus the
  prompt's attention once per layer for all rows (grouped queries against one
  copy, ``bench_long_prompt.prompt_attention_seconds``, also one CUDA graph on CUDA).
* **ours-runner**: ``HFRunner.logprobs`` called directly, one batch per step.
* **ours**: ``await next_token_logprobs``, one per particle per step; and
  the same with ``compute_in_loop=True`` (batches in the event loop's thread).

Also: the captured steps' count and the first step's time (capture included),
and on CUDA the GPU-busy fraction of ours's steps (kernel time from
``torch.profiler`` over wall time). G beyond 1.3R means the measurement or
the engine step is wrong. On CPU every figure is measured too (G eager);
only a GPU gives the figures the GPU issue asks for.

    python benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \\
        --random-weights LLAMA3_8B_CONFIG_DIR --workloads 64x32@4096
    python benchmarks/bench_gpu_step.py --workloads 8x4@64        # CPU, default model
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_long_prompt import (
    load_model,
    parse_workload,
    prompt_attention_seconds,
    synchronize,
    token_draws,
)

OWN_SLOTS = 64
"""Tokens of each row's own past G's static cache starts with (the floor's 64-token past)."""


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + written), the best of 5."""
    import torch

    nbytes = (1 << 30) if device.startswith("cuda") else (256 << 20)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def step_bytes(model, particles: int, steps: int, prompt_tokens: int) -> dict[str, float]:
    """The bytes one step must read, by part (own keys/values at the workload's mean length)."""
    from genlm_backend.llm.hf.compat import kv_shape

    config = model.config.get_text_config(decoder=True)
    num_kv_heads, head_dim = kv_shape(config)
    element = model.dtype.itemsize
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embeddings.weight is not head.weight:  # untied: the input table is gathered
        weights -= embeddings.weight.numel() * embeddings.weight.element_size()
    per_token = 2 * config.num_hidden_layers * num_kv_heads * head_dim * element
    vocab = config.vocab_size
    return {
        "weights": weights,
        "prompt keys/values": per_token * prompt_tokens,
        "own keys/values": per_token * particles * (steps + 1) / 2,
        "logits": particles * vocab * (element + 2 * 4),  # written; read and written in float32
    }


def graph_step_seconds(model, args, particles: int, steps: int) -> tuple[float, str]:
    """Seconds per step of the static-cache step (one CUDA graph where it captures), and how it ran."""
    import torch
    from transformers import StaticCache

    device = args.device
    cache = StaticCache(config=model.config, max_cache_len=OWN_SLOTS + steps + 1)
    ids = torch.randint(0, 1000, (particles, OWN_SLOTS), device=device)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)  # each row's own past
        step_ids = torch.zeros(particles, 1, dtype=torch.long, device=device)
        position = torch.full((particles, 1), OWN_SLOTS, device=device)
        cache_position = torch.tensor([OWN_SLOTS], device=device)  # transformers < 5.23 reads it
        # transformers >= 5.23: each layer writes at its own device counter, which a step
        # advances; one tensor holds them all, so one fill sets the write slot for a replay.
        lengths = torch.full((len(cache.layers),), OWN_SLOTS, device=device)
        for index, layer in enumerate(cache.layers):
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length = lengths[index]

        def step():
            logits = model(
                step_ids,
                position_ids=position,
                cache_position=cache_position,
                past_key_values=cache,
                use_cache=True,
            ).logits
            return torch.log_softmax(logits[:, -1].float(), -1)

        how, replay = "eager", step
        if device.startswith("cuda"):
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                how, replay = "one CUDA graph", graph.replay
            except Exception as exc:  # noqa: BLE001 - reported: G then runs eagerly
                how = f"eager (capture failed: {type(exc).__name__}: {str(exc)[:80]})"
        lengths.fill_(OWN_SLOTS)
        replay()
        synchronize(device)
        start = time.perf_counter()
        for index in range(steps):
            position.fill_(OWN_SLOTS + index)  # device data: a replay reads it
            cache_position.fill_(OWN_SLOTS + index)
            lengths.fill_(OWN_SLOTS + index)
            replay()
        synchronize(device)
    return (time.perf_counter() - start) / steps, how


def runner_steps(model, args, particles, steps, prompt, own, warm_up, deterministic=False) -> dict:
    """ours-runner: the HF runner called directly, one batch per step."""
    from genlm_backend.llm.hf import AsyncTransformer

    vocab = [b"<%d>" % i for i in range(model.config.get_text_config().vocab_size)]
    llm = AsyncTransformer(model, None, byte_vocab=vocab, deterministic=deterministic)
    runner = llm.runner
    warm_prompt, warm_own = warm_up
    for step in range(2):
        runner.logprobs([tuple(warm_prompt + o[: step + 1]) for o in warm_own])
    runner.logprobs([tuple(prompt)])
    times = []
    for step in range(steps):
        contexts = [tuple(prompt + own[i][: step + 1]) for i in range(particles)]
        synchronize(args.device)
        start = time.perf_counter()
        runner.logprobs(contexts)
        synchronize(args.device)
        times.append(time.perf_counter() - start)
    stats = runner.graphs.stats
    llm.close()
    return {
        "step_s": statistics.median(times[1:] or times),
        "first_step_s": times[0],
        "captures": stats.num_captures,
        "replays": stats.num_replays,
    }


def ours_steps(
    model, args, particles, steps, prompt, own, warm_up, in_loop=False, deterministic=False
) -> dict:
    """ours: awaited requests; on CUDA also the GPU-busy fraction of a few steps.

    ``in_loop``: batches run in the event loop's thread (``compute_in_loop=True``).
    ``deterministic``: ``deterministic=True``.
    """
    from genlm_backend.llm.hf import AsyncTransformer

    vocab = [b"<%d>" % i for i in range(model.config.get_text_config().vocab_size)]
    llm = AsyncTransformer(
        model, None, byte_vocab=vocab, compute_in_loop=in_loop, deterministic=deterministic
    )
    warm_prompt, warm_own = warm_up

    async def step(contexts) -> None:
        await asyncio.gather(*map(llm.next_token_logprobs, contexts))

    async def main() -> tuple[float, float | None]:
        for index in range(2):
            await step([warm_prompt + o[: index + 1] for o in warm_own])
        await llm.next_token_logprobs(prompt)
        synchronize(args.device)
        start = time.perf_counter()
        for index in range(steps):
            await step([prompt + own[i][: index + 1] for i in range(particles)])
        synchronize(args.device)
        step_s = (time.perf_counter() - start) / steps
        busy = None
        if args.device.startswith("cuda"):
            busy = await gpu_busy_fraction(step, [prompt + o for o in own], args.device)
        return step_s, busy

    step_s, busy = asyncio.run(main())
    llm.close()
    return {"step_s": step_s, "gpu_busy": busy}


async def gpu_busy_fraction(step, contexts, device: str) -> float:
    """Kernel time over wall time of 4 more steps (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        synchronize(device)
        start = time.perf_counter()
        for extra in range(4):
            await step([context + [extra + 1] for context in contexts])
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = sum(event.self_device_time_total for event in prof.key_averages()) / 1e6
    return kernels / wall


def measure(model, args, workload: str) -> dict:
    particles, steps, prompt_tokens = parse_workload(workload)
    vocab_size = model.config.get_text_config().vocab_size
    prompt, own = token_draws(vocab_size, particles, steps, prompt_tokens, seed=1)
    warm_up = token_draws(vocab_size, particles, 2, 64, seed=2)
    warm_up = ([t + 1 for t in warm_up[0]], warm_up[1])  # another prompt: nothing reused
    parts = step_bytes(model, particles, steps, prompt_tokens)
    bandwidth = copy_bandwidth(args.device)
    graph_s, how = graph_step_seconds(model, args, particles, steps)
    attention_s = (
        prompt_attention_seconds(model, args, particles, steps, prompt_tokens, captured=True)
        / steps
    )
    exact = {}
    if args.deterministic:
        exact = {
            "runner_exact": runner_steps(model, args, particles, steps, prompt, own, warm_up, True),
            "ours_exact": ours_steps(
                model, args, particles, steps, prompt, own, warm_up, True, True
            ),
        }
    return {
        **exact,
        "workload": workload,
        "bytes": parts,
        "bandwidth": bandwidth,
        "R": sum(parts.values()) / bandwidth,
        "G": graph_s + attention_s,
        "G_parts": (graph_s, attention_s),
        "G_how": how,
        "runner": runner_steps(model, args, particles, steps, prompt, own, warm_up),
        "ours": ours_steps(model, args, particles, steps, prompt, own, warm_up),
        "ours_in_loop": ours_steps(model, args, particles, steps, prompt, own, warm_up, True),
    }


def report(result: dict) -> None:
    limit = result["R"]
    ms = 1e3
    runner, ours = result["runner"], result["ours"]
    gigabytes = {k: round(v / 1e9, 3) for k, v in result["bytes"].items()}
    print(
        f"\n{result['workload']}: a step reads {gigabytes} GB; copy bandwidth "
        f"{result['bandwidth'] / 1e9:.0f} GB/s; G ran as {result['G_how']}: "
        f"{result['G_parts'][0] * ms:.2f} ms the model's step over its own tokens, "
        f"{result['G_parts'][1] * ms:.2f} ms the prompt's attention"
    )
    print("| per step | ms | vs R |")
    print("|---|---|---|")
    for name, seconds in (
        ("R (limit)", limit),
        ("G (engine step)", result["G"]),
        ("ours-runner", runner["step_s"]),
        ("ours", ours["step_s"]),
        ("ours, batches in the loop's thread", result["ours_in_loop"]["step_s"]),
    ):
        print(f"| {name} | {seconds * ms:.2f} | {seconds / limit:.2f}x |")
    if "runner_exact" in result:
        for name, exact, default in (
            ("ours-runner", result["runner_exact"], runner),
            ("ours, batches in the loop's thread", result["ours_exact"], result["ours_in_loop"]),
        ):
            print(
                f"| {name}, deterministic=True | {exact['step_s'] * ms:.2f} | "
                f"{exact['step_s'] / limit:.2f}x ({exact['step_s'] / default['step_s']:.2f}x the default) |"
            )
        exact = result["runner_exact"]
        print(
            f"ours-runner, deterministic=True: first step {exact['first_step_s'] * ms:.1f} ms; "
            f"{exact['captures']} captures, {exact['replays']} replays"
        )
        busy = result["ours_exact"]["gpu_busy"]
        if busy is not None:
            print(
                f"ours, deterministic=True: GPU busy {100 * busy:.0f}% of the wall time of 4 steps"
            )
    print(
        f"ours-runner: first step {runner['first_step_s'] * ms:.1f} ms (captures included); "
        f"{runner['captures']} captures, {runner['replays']} replays"
    )
    if ours["gpu_busy"] is not None:
        print(f"ours: GPU busy {100 * ours['gpu_busy']:.0f}% of the wall time of 4 steps")
    if result["G"] > 1.3 * limit:
        print(
            "G is beyond 1.3R: check the measurement or the engine step before reading ours's ratios"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["64x32@4096"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--random-weights", type=Path, help="config folder: random weights")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="also ours-runner and ours (loop's thread) with deterministic=True",
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    model = load_model(args)
    print(
        f"# bench_gpu_step: {args.device}, {args.dtype}, "
        f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'CPU'}"
    )
    for workload in args.workloads:
        report(measure(model, args, workload))


if __name__ == "__main__":
    main()
