"""Where a ``deterministic=True`` step's time goes: operators by device time and by host time.

P particles behind a T-token prompt (``PxS@T``, as ``bench_gpu_step.py``)
step S times; the last steps run under ``torch.profiler``. Prints the wall
time per step, the device's busy fraction, and the top operators by device
time and by host time, for the default mode and ``deterministic=True``.

    python benchmarks/gpu/profile_exact.py --device cuda --dtype bfloat16 \\
        --random-weights benchmarks/gpu/configs/llama3_8b --workload 64x6@4096
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_long_prompt import load_model, parse_workload, synchronize, token_draws

PROFILED_STEPS = 3


def profile_mode(model, args, deterministic: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from genlm_backend.llm.hf import AsyncTransformer

    particles, steps, prompt_tokens = parse_workload(args.workload)
    vocab_size = model.config.get_text_config().vocab_size
    prompt, own = token_draws(vocab_size, particles, steps + PROFILED_STEPS, prompt_tokens, seed=1)
    vocab = [b"<%d>" % i for i in range(vocab_size)]
    llm = AsyncTransformer(model, None, byte_vocab=vocab, deterministic=deterministic)

    async def step(index: int) -> None:
        contexts = [prompt + own[i][: index + 1] for i in range(particles)]
        await asyncio.gather(*map(llm.next_token_logprobs, contexts))

    async def main() -> None:
        await llm.next_token_logprobs(prompt)
        for index in range(steps):
            await step(index)
        activities = [ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            synchronize(args.device)
            start = time.perf_counter()
            for index in range(steps, steps + PROFILED_STEPS):
                await step(index)
            synchronize(args.device)
            wall = time.perf_counter() - start
        averages = prof.key_averages()
        device_s = sum(event.self_device_time_total for event in averages) / 1e6
        print(
            f"\n## deterministic={deterministic}: {wall / PROFILED_STEPS * 1e3:.2f} ms a step "
            f"(profiled), device busy {100 * device_s / wall:.0f}%",
            flush=True,
        )
        if args.device.startswith("cuda"):
            print(averages.table(sort_by="self_cuda_time_total", row_limit=args.rows), flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)

    asyncio.run(main())
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="64x6@4096")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random-weights", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--modes", nargs="+", default=["deterministic", "default"])
    args = parser.parse_args()
    model = load_model(args)
    for mode in args.modes:
        profile_mode(model, args, deterministic=mode == "deterministic")


if __name__ == "__main__":
    main()
