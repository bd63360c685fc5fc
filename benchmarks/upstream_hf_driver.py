"""Runs the bench_hf workload on upstream genlm-backend 0.3.1 (inside its own virtualenv).

Prints one JSON line: seconds and peak RSS. Called by ``bench_hf.py``; not
importable from this project's environment (it needs ``genlm.backend``).
"""

import argparse
import asyncio
import json
import resource
import time

import torch
from genlm.backend.llm import AsyncTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPT = "Write a short story about a fox who learns to read. Once upon a time, in a quiet forest,"


def sample_token(logits, generator):
    """The same inverse-CDF draw as genlm_backend.llm.base.sample_token."""
    cdf = torch.softmax(logits.double(), dim=-1).cumsum_(0)
    u = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1))


def load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-kv", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--particles", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load(args.model_dir)
    llm = AsyncTransformer(model, tokenizer)
    prompt = tokenizer.encode(PROMPT)[:25]
    llm.next_token_logprobs_uncached(prompt)  # warm-up
    if args.cache_kv:
        llm.cache_kv(prompt)

    async def particle(seed):
        generator = torch.Generator().manual_seed(seed)
        context = list(prompt)
        for _ in range(args.steps):
            logprobs = await llm.next_token_logprobs(context)
            context.append(sample_token(logprobs, generator))

    async def run():
        await asyncio.gather(*(particle(seed) for seed in range(args.particles)))

    start = time.perf_counter()
    asyncio.run(run())
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    variant = "upstream+cache_kv" if args.cache_kv else "upstream"
    print(json.dumps({"variant": variant, "seconds": seconds, "peak_rss_mb": peak}))


if __name__ == "__main__":
    main()
