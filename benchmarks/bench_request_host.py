"""Host work one request costs the event loop, by context length, with no model work alongside.

What ``await next_token_logprobs(context)`` does on the event loop before
and after its batch, for a particle whose previous context was computed
(its keys/values in the tree, its row in the output cache): validating the
context and making its request (``AsyncLM.request``), the step's output-cache
lookup (a miss), the batch-cost estimate (``request_tokens``: the KV tree's
lookup), and the row handed back (a view of its step's output: its share of
``unbind``). Timed call by call, in this
process, on the default model behind a prompt of each length, every phase
the median over particles and repeats; no forward pass runs while timing, so
the figures are the work itself, not its contention with the model's threads.

    python benchmarks/bench_request_host.py [--lengths 64 1024 4096] [--particles 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_long_prompt import token_draws


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 1024, 4096])
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.models import default_model_dir

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir()).eval()
    vocab_size = model.config.vocab_size
    byte_vocab = [b"<%d>" % i for i in range(vocab_size)]
    print(
        "| context tokens | validate + request (us) | output cache lookup (us) "
        "| batch-cost estimate (us) | row view (us) | total (us) | vs the shortest |"
    )
    print("|---|---|---|---|---|---|---|")
    first_total = None
    for length in args.lengths:
        llm = AsyncTransformer(model, None, byte_vocab=byte_vocab)
        runner = llm.runner
        prompt, own = token_draws(vocab_size, args.particles, 2, length - 2, seed=1)
        # The previous step: each particle's context computed, its row cached.
        llm.batch_next_token_logprobs_sync([prompt + own[i][:1] for i in range(args.particles)])
        block = llm.batch_next_token_logprobs_sync([prompt + own[i][:1] for i in range(2)])
        phases: dict[str, list[float]] = {"requests": [], "cached": [], "cost": [], "view": []}
        for _ in range(args.repeats):
            for i in range(args.particles):
                context = prompt + own[i][:2]  # a new list, as a client makes it
                t0 = time.perf_counter()
                request = llm.request(context)
                t1 = time.perf_counter()
                assert llm.output_cache.get_many([request])[0] is None
                t2 = time.perf_counter()
                runner.request_tokens(request)
                t3 = time.perf_counter()
                block.unbind(0)
                t4 = time.perf_counter()
                spans = (t1 - t0, t2 - t1, t3 - t2, (t4 - t3) / len(block))
                for name, seconds in zip(phases, spans):
                    phases[name].append(seconds * 1e6)
        medians = [statistics.median(v) for v in phases.values()]
        total = sum(medians)
        first_total = first_total or total
        cells = " | ".join(f"{m:.1f}" for m in medians)
        print(f"| {length} | {cells} | {total:.1f} | {total / first_total:.2f}x |", flush=True)
        llm.close()


if __name__ == "__main__":
    main()
