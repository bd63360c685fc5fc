"""Runs bench_scoring's nested-prefix workload on upstream genlm-backend 0.3.1 (inside its own virtualenv).

Prints one JSON line per case: seconds and the summed log-probability of the
continuation (to check agreement with ours). Called by ``bench_scoring.py
--upstream``; not importable from this project's environment.
"""

import argparse
import asyncio
import json
import time

import torch
from genlm.backend.llm import AsyncTransformer
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    # The same draws as bench_scoring.py: same seed, same order, same torch.
    generator = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    prompt = torch.randint(0, vocab, (200,), generator=generator).tolist()
    torch.randint(0, vocab, (1500,), generator=generator)  # bench_scoring's long prompt
    continuations = {
        n: torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (64, 256)
    }
    for n in args.lengths:
        for cached in (False, True):
            llm = AsyncTransformer(model, tokenizer)
            if cached:
                llm.cache_kv(prompt)
            continuation = continuations[n]
            contexts = [prompt + continuation[:i] for i in range(n)]
            start = time.perf_counter()
            rows = asyncio.run(llm.batch_next_token_logprobs(contexts))
            seconds = time.perf_counter() - start
            total = float(sum(rows[i, t] for i, t in enumerate(continuation)))
            case = f"nested {n} {'prompt cached' if cached else 'cold'}"
            print(json.dumps({"case": case, "seconds": seconds, "sum": total}), flush=True)


if __name__ == "__main__":
    main()
