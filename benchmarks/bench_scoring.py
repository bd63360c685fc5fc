"""Scoring text: genlm-control's nested-prefix batch and the continuation_logprobs call, against one forward pass.

Workloads (SmolLM2-135M fp32 by default, seeded random tokens):

* ``nested``: genlm-control's ``PromptedLLM.log_probability`` pattern: one
  ``batch_next_token_logprobs`` over every prefix ``prompt + continuation[:i]``
  (a 200-token prompt), the continuation's tokens gathered; cold (fresh
  backend) and with the prompt cached (``cache_kv`` first, not timed).
* ``call``: ``batch_continuation_logprobs`` of 16 continuations of 64 tokens
  behind a 1,500-token prompt, cold.

Baseline, in the same process and in turns with ours: the transformers model
called directly, one forward pass over the same tokens, the same
log-probabilities gathered: cold, over prompt + continuation; prompt cached,
over the continuation behind the prompt's keys/values (``DynamicCache``, made
before the timed span); ``call``, the prompt once, then the 16
continuations as one batch over its keys/values repeated per row. Prints one line per round and
the medians of ours / baseline.

With ``--upstream``, the nested cases also run on upstream genlm-backend
0.3.1's ``AsyncTransformer`` (``benchmarks/upstream_env.sh`` builds its venv),
once each, in a child process after ours: same tokens, the continuation's
summed log-probability printed for both.

Usage: python benchmarks/bench_scoring.py [--rounds 3] [--threads 2] [--model M] [--upstream]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

HERE = Path(__file__).resolve().parent
UPSTREAM_PYTHON = Path(os.environ.get("UPSTREAM_VENV", "/work/venvs/upstream")) / "bin" / "python"


def random_tokens(generator: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=generator).tolist()


@torch.inference_mode()
def one_forward_nested(model, prompt, continuation) -> torch.Tensor:
    logits = model(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs[torch.arange(len(continuation)), torch.tensor(continuation)]


@torch.inference_mode()
def prompt_cache(model, prompt) -> DynamicCache:
    """Keys/values of ``prompt[:-1]``: what a cached prompt holds before its last token runs again."""
    cache = DynamicCache()
    model(torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    return cache


@torch.inference_mode()
def one_forward_behind(model, cache, prompt, continuation) -> torch.Tensor:
    """One forward pass over the prompt's last token and the continuation, the rest cached."""
    inputs = torch.tensor([[prompt[-1], *continuation[:-1]]])
    logits = model(inputs, past_key_values=cache, use_cache=True).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs[torch.arange(len(continuation)), torch.tensor(continuation)]


@torch.inference_mode()
def one_forward_call(model, prompt, continuations) -> torch.Tensor:
    cache = DynamicCache()
    model(torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(len(continuations))
    inputs = torch.tensor([[prompt[-1], *c[:-1]] for c in continuations])
    logits = model(inputs, past_key_values=cache, use_cache=True).logits
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs.gather(2, torch.tensor(continuations)[..., None])[..., 0]


def ours_nested(llm, prompt, continuation) -> torch.Tensor:
    contexts = [prompt + continuation[:i] for i in range(len(continuation))]
    rows = llm.batch_next_token_logprobs_sync(contexts)
    return rows[torch.arange(len(continuation)), torch.tensor(continuation)]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--upstream", action="store_true", help="also run upstream 0.3.1")
    parser.add_argument("--upstream-lengths", type=int, nargs="+", default=[64])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from genlm_backend.llm.hf import AsyncTransformer

    base = AsyncTransformer.from_name(args.model)
    model, tokenizer, vocab = base.model, base.tokenizer, base.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = random_tokens(generator, 200, vocab)
    long_prompt = random_tokens(generator, 1500, vocab)
    continuations = {n: random_tokens(generator, n, vocab) for n in (64, 256)}
    calls = [random_tokens(generator, 64, vocab) for _ in range(16)]

    def fresh():
        return AsyncTransformer(model, tokenizer)

    cases = {}
    for n, continuation in continuations.items():
        cases[f"nested {n} cold"] = (
            lambda c=continuation: (fresh(), None),
            lambda llm, c=continuation: ours_nested(llm, prompt, c),
            lambda c=continuation: functools.partial(one_forward_nested, model, prompt, c),
        )
        cases[f"nested {n} prompt cached"] = (
            lambda: (llm := fresh(), llm.cache_kv(prompt))[0:1] + (None,),
            lambda llm, c=continuation: ours_nested(llm, prompt, c),
            lambda c=continuation: functools.partial(
                one_forward_behind, model, prompt_cache(model, prompt), prompt, c
            ),
        )
    cases["call 16x64 behind 1500"] = (
        lambda: (fresh(), None),
        lambda llm: torch.stack(llm.batch_continuation_logprobs_sync(long_prompt, calls)),
        lambda: functools.partial(one_forward_call, model, long_prompt, calls),
    )
    medians = {}
    for name, (setup, ours, floor) in cases.items():
        ratios, times = [], []
        for r in range(args.rounds):
            llm = setup()[0]
            t_ours, got = timed(lambda llm=llm, ours=ours: ours(llm))
            t_floor, expected = timed(floor())  # floor() prepares untimed, returns the timed call
            error = (got - expected).abs().max().item()
            ratios.append(t_ours / t_floor)
            times.append(t_ours)
            if name.startswith("nested") and r == 0:
                print(f"{name}: ours' summed log-probability {got.sum().item():.3f}", flush=True)
            print(
                f"{name} round {r}: ours {t_ours:.3f} s, one forward {t_floor:.3f} s, "
                f"{t_ours / t_floor:.2f}x, max |diff| {error:.1e}, "
                f"tokens computed {llm.stats.num_tokens_computed}",
                flush=True,
            )
            llm.close()
        medians[name] = statistics.median(times)
        print(f"{name}: median {statistics.median(ratios):.2f}x one forward pass", flush=True)
    if args.upstream:
        run_upstream(base.model.name_or_path, args, medians)


def run_upstream(model_dir: str, args, medians: dict[str, float]) -> None:
    command = [
        str(UPSTREAM_PYTHON),
        str(HERE / "upstream_scoring_driver.py"),
        "--model-dir",
        model_dir,
        "--threads",
        str(args.threads),
        "--lengths",
        *map(str, args.upstream_lengths),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        if not line.startswith("{"):
            continue
        found = json.loads(line)
        ours = medians[found["case"]]
        print(
            f"{found['case']}: upstream {found['seconds']:.3f} s (summed log-probability "
            f"{found['sum']:.3f}), {found['seconds'] / ours:.1f}x ours' median",
            flush=True,
        )


if __name__ == "__main__":
    main()
