"""AsyncVirtualLM vs vLLM's public full-vocabulary path (``logprobs=-1``), same engine, same run.

Workload: ``--particles`` sequences advance in lock-step for ``--steps`` steps
(as in sequential Monte Carlo); at each step every sequence asks for the
next-token distribution of its context, then grows by one random token.
Both methods follow the same seeded trajectory, each from an empty prefix
cache (it is reset in between), so vLLM's prefix cache helps both alike. Both produce a ``[particles, V]`` float32 tensor
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

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, logprobs=-1,
                            flat_logprobs=True)
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
                rows[position[output.request_id], token_ids[keep]] = torch.tensor(flat.logprobs)[keep]
                pending.discard(output.request_id)
    return rows


def timed_steps(run_step, steps, warmup: int) -> tuple[float, torch.Tensor]:
    """Seconds for the steps after ``warmup``, and the first step's rows."""
    first = None
    for i, contexts in enumerate(steps):
        if i == warmup:
            start = time.perf_counter()
        rows = run_step(contexts, i)
        first = rows if first is None else first
    return time.perf_counter() - start, first


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
    capture_s, capture_first = timed_steps(
        lambda contexts, _: loop.run_until_complete(capture_step(llm, contexts)),
        trajectories(0, vocab, *shape), args.warmup)
    llm.clear_cache()  # the public path starts from an empty prefix cache too
    public_s, public_first = timed_steps(
        lambda contexts, i: public_step(llm.llm_engine, contexts, vocab, i),
        trajectories(0, vocab, *shape), args.warmup)
    # Same seed: the first steps' contexts are equal, so the rows must agree.
    max_diff = (capture_first - public_first).abs().max().item()
    loop.run_until_complete(llm.aclose())
    loop.close()
    print_table(args, vocab, capture_s, public_s, max_diff)


def print_table(args, vocab: int, capture_s: float, public_s: float, max_diff: float) -> None:
    import vllm

    requests = args.particles * args.steps
    print(f"\nCommand: python {' '.join(sys.argv)}")
    print(f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"torch threads, vLLM {vllm.__version__}, vocabulary {vocab}")
    print(f"Workload: {args.particles} concurrent requests per step, {args.steps} timed steps "
          f"(+{args.warmup} warm-up), prompt {args.prompt_len} tokens + 1 per step")
    print(f"First-step rows agree within {max_diff:.2e} (max abs difference)\n")
    print("| method | total s | ms / step | requests / s | speed-up |")
    print("|---|---|---|---|---|")
    for name, seconds in (("AsyncVirtualLM (capture)", capture_s),
                          ("vLLM logprobs=-1, flat_logprobs", public_s)):
        print(f"| {name} | {seconds:.2f} | {1000 * seconds / args.steps:.1f} | "
              f"{requests / seconds:.0f} | {public_s / seconds:.2f}x |")


if __name__ == "__main__":
    main()
