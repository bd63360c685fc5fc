"""AsyncVirtualLM vs vLLM's public full-vocabulary path (``logprobs=-1``), same engine, same run.

Workload: ``--particles`` sequences advance in lock-step for ``--steps`` steps
(as in sequential Monte Carlo); at each step every sequence asks for the
next-token distribution of its context, then grows by one random token.
Every method follows the same seeded trajectory, each from an empty prefix
cache (it is reset in between), so vLLM's prefix cache helps all alike. The
capture path runs twice: with particle sessions (the default) and with
``max_sessions=0`` (one finished request per context, as the public path). Each produces a ``[particles, V]`` float32 tensor
per step: the capture path directly, the public path by scattering vLLM's
``FlatLogprobs`` (``flat_logprobs=True``) into a tensor. Warm-up steps are
excluded. Prints a markdown table (append it to BENCHMARKS.md by hand).

    python benchmarks/bench_vllm.py [--model DIR] [--particles 64] [--steps 32]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import time

import torch

from genlm_backend.llm.vllm import AsyncVirtualLM

ENGINE_OPTS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "block_size": 32,  # the CPU attention kernel's smallest block: most of each context is reused
    "max_logprobs": -1,
    "gpu_memory_utilization": 0.5,
}


def trajectories(seed: int, vocab: int, particles: int, steps: int, prompt_len: int):
    """Per step, the ``particles`` contexts of that step."""
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    contexts = [list(prompt) for _ in range(particles)]
    for _ in range(steps):
        yield [tuple(c) for c in contexts]
        for context in contexts:
            context.append(rng.randrange(vocab))


async def capture_step(llm: AsyncVirtualLM, contexts) -> torch.Tensor:
    return torch.stack(await asyncio.gather(*(llm.next_token_logprobs(c) for c in contexts)))


def public_step(engine, contexts, vocab: int, step: int) -> torch.Tensor:
    """vLLM's ``logprobs=-1`` path: full-vocabulary logprobs through RequestOutput."""
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    params = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, logprobs=-1, flat_logprobs=True
    )
    request_ids = [f"public-{step}-{i}" for i in range(len(contexts))]
    for request_id, context in zip(request_ids, contexts):
        engine.add_request(request_id, tokens_input(list(context)), params)
    rows = torch.full((len(contexts), vocab), float("-inf"))
    position = {request_id: i for i, request_id in enumerate(request_ids)}
    pending = set(request_ids)
    while pending:
        for output in engine.step():
            if output.finished:
                flat = output.outputs[0].logprobs  # FlatLogprobs, one position
                token_ids = torch.tensor(flat.token_ids)
                keep = token_ids < vocab
                rows[position[output.request_id], token_ids[keep]] = torch.tensor(flat.logprobs)[
                    keep
                ]
                pending.discard(output.request_id)
    return rows


def timed_steps(run_step, steps, warmup: int) -> tuple[float, list[torch.Tensor]]:
    """Seconds for the steps after ``warmup``, and the rows of the first and last steps."""
    first = last = None
    for i, contexts in enumerate(steps):
        if i == warmup:
            start = time.perf_counter()
        last = run_step(contexts, i)
        first = last if first is None else first
    return time.perf_counter() - start, [first, last]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()

    llm = AsyncVirtualLM.from_name(args.model, engine_opts=ENGINE_OPTS, batch_size=args.particles)
    vocab, shape = llm.vocab_size, (args.particles, args.steps + args.warmup, args.prompt_len)
    loop = asyncio.new_event_loop()
    seconds, rows = {}, {}
    for name, max_sessions in (("capture", llm.max_sessions), ("capture, no sessions", 0)):
        llm.clear_cache()  # every method starts from an empty prefix cache
        llm.max_sessions = max_sessions
        seconds[name], rows[name] = timed_steps(
            lambda contexts, _: loop.run_until_complete(capture_step(llm, contexts)),
            trajectories(0, vocab, *shape),
            args.warmup,
        )
    llm.clear_cache()
    seconds["public"], rows["public"] = timed_steps(
        lambda contexts, i: public_step(llm.llm_engine, contexts, vocab, i),
        trajectories(0, vocab, *shape),
        args.warmup,
    )
    # Same seed, same contexts: first and last steps' rows must agree across methods.
    max_diff = max(
        (a - b).abs().max().item()
        for name in ("capture", "capture, no sessions")
        for a, b in zip(rows[name], rows["public"])
    )
    loop.run_until_complete(llm.aclose())
    loop.close()
    print_table(args, vocab, seconds, max_diff)


def print_table(args, vocab: int, seconds: dict[str, float], max_diff: float) -> None:
    import vllm

    requests = args.particles * args.steps
    print(f"\nCommand: python {' '.join(sys.argv)}")
    print(
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"torch threads, vLLM {vllm.__version__}, vocabulary {vocab}"
    )
    print(
        f"Workload: {args.particles} concurrent requests per step, {args.steps} timed steps "
        f"(+{args.warmup} warm-up), prompt {args.prompt_len} tokens + 1 per step"
    )
    print(f"Rows of the first and last steps agree within {max_diff:.2e} (max abs difference)\n")
    print("| method | total s | ms / step | requests / s | speed-up |")
    print("|---|---|---|---|---|")
    names = {
        "capture": "AsyncVirtualLM (capture, particle sessions)",
        "capture, no sessions": "AsyncVirtualLM (capture, max_sessions=0)",
        "public": "vLLM logprobs=-1, flat_logprobs",
    }
    for key, name in names.items():
        print(
            f"| {name} | {seconds[key]:.2f} | {1000 * seconds[key] / args.steps:.1f} | "
            f"{requests / seconds[key]:.0f} | {seconds['public'] / seconds[key]:.2f}x |"
        )


if __name__ == "__main__":
    main()
