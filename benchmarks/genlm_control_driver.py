"""One process of the genlm-control regex-SMC benchmark, on whichever backend imports.

genlm-control imports ``genlm.backend``. When genlm_backend (with its
``genlm_backend.alias`` module) is importable, the alias is installed first and
genlm-control runs on genlm_backend; otherwise ``genlm.backend`` is upstream
genlm-backend 0.3.1. ``bench_genlm_control.py`` runs this script in two
virtualenvs and compares them; it prints one JSON line on stdout. ``--workload``
picks the prompt and regex (``genlm_control_workloads.py``: ``email``, ``sql``).

``--critic`` adds a second ``PromptedLLM`` over the same model, with a judging
prompt (``CRITICS``), as the SMC's critic: every step it scores each particle's
whole context, one ``batch_next_token_logprobs`` over every prefix
(``PromptedLLM.log_probability``), the LLM used as a potential.

Modes:

* ``time``: one warm-up SMC run (seed ``--warmup-seed``, not timed), then one
  timed run per ``--seeds`` value. Each run starts with the model's caches
  cleared, so every timed run does the same work as the first.
* ``score``: next-token log-probabilities of the contexts in ``--contexts``
  (a JSON list of token-id lists), saved as a float64 ``.npy`` to ``--scores-out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

try:  # genlm_backend serves `import genlm.backend` when it is installed
    from genlm_backend.alias import install as install_alias

    install_alias()
    BACKEND_NAME = "genlm_backend"
except ImportError:
    BACKEND_NAME = "genlm-backend 0.3.1"

import numpy as np
import torch
from genlm.backend.llm import AsyncTransformer
from genlm.control import AWRS, BoolFSA, PromptedLLM
from genlm_control_workloads import BESIDE_TEXTS, CRITICS, WORKLOADS
from transformers import AutoModelForCausalLM, AutoTokenizer


def build_potentials(
    model_dir: str, workload: str = "email", deterministic: bool = False
) -> tuple[AsyncTransformer, PromptedLLM, object]:
    """The language model, the prompted potential and the regex condition over its tokens."""
    messages, regex = WORKLOADS[workload]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    options = {"deterministic": True} if deterministic else {}  # genlm_backend only
    llm = AsyncTransformer(model, tokenizer, **options)
    potential = PromptedLLM(llm)
    potential.prompt_ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    condition = BoolFSA.from_regex(regex).coerce(potential, f=b"".join)
    return llm, potential, condition


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_critic(llm, workload: str) -> PromptedLLM:
    """A ``PromptedLLM`` over ``llm`` whose prompt asks whether what follows fits the workload."""
    critic = PromptedLLM(llm)
    critic.prompt_ids = llm.tokenizer.encode(CRITICS[workload])
    return critic


async def other_workload(llm, prompt_ids, texts, seed: int, stop: asyncio.Event) -> int:
    """Traffic beside an SMC run, on the same model, until ``stop``: batches of 1 to 4
    contexts, each the prompt, then the start of one of ``texts`` (answers the SMC may
    also write), then 0 or 1 random token, drawn by a generator of its own; returns
    how many rows it asked for."""
    rng = random.Random(seed)
    pieces = [llm.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    vocab_size = len(llm.byte_vocab)
    asked = 0
    while not stop.is_set():
        contexts = []
        for _ in range(rng.randint(1, 4)):
            piece = rng.choice(pieces)
            tail = [rng.randrange(vocab_size) for _ in range(rng.randint(0, 1))]
            contexts.append(list(prompt_ids) + piece[: rng.randint(0, len(piece))] + tail)
        await asyncio.gather(*(llm.next_token_logprobs(context) for context in contexts))
        asked += len(contexts)
    return asked


async def run_smc(
    llm,
    potential,
    condition,
    seed: int,
    particles: int,
    max_tokens: int,
    cache_prompt: bool,
    critic=None,
    beside: tuple[int, list[str]] | None = None,
) -> dict:
    """One SMC run from cold model caches (the prompt's keys/values cached first if
    ``cache_prompt``, inside the timed span); returns its time and what it sampled.
    ``beside``: the seed and texts of :func:`other_workload`, run alongside."""
    llm.clear_cache()
    cache = getattr(llm, "output_cache", None)  # genlm_backend's: its hits and limit
    hits_before = None if cache is None else cache.stats.num_hits
    seed_everything(seed)
    sampler = AWRS(potential, condition, seed=seed)
    start = time.perf_counter()
    if cache_prompt:
        llm.cache_kv(list(potential.prompt_ids))
    prefill_seconds = time.perf_counter() - start
    stop = asyncio.Event()
    other = None
    if beside is not None:
        other_seed, texts = beside
        other = asyncio.create_task(
            other_workload(llm, potential.prompt_ids, texts, other_seed, stop)
        )
    sequences = await sampler.smc(
        n_particles=particles, ess_threshold=0.5, max_tokens=max_tokens, critic=critic
    )
    stop.set()
    other_rows = 0 if other is None else await other
    seconds = time.perf_counter() - start
    cache_stats = None if cache is None else cache.stats
    tokens = [[t for t in ctx if hasattr(t, "token_id")] for ctx in sequences.contexts]  # drops EOS
    return {
        "seed": seed,
        "seconds": seconds,
        "prefill_seconds": prefill_seconds,  # cache_kv(prompt), part of seconds
        "token_ids": [[t.token_id for t in ctx] for ctx in tokens],
        "texts": [
            b"".join(t.byte_string for t in ctx).decode("utf-8", "replace") for ctx in tokens
        ],
        "log_weights": [float(w) for w in sequences.log_weights],
        "log_ml": float(sequences.log_ml),
        "other_rows": other_rows,
        "output_cache_hits": None if cache_stats is None else cache_stats.num_hits - hits_before,
        "output_cache_limit_mib": (
            None if cache_stats is None else getattr(cache_stats, "limit_bytes", 0) / 2**20
        ),
    }


async def time_runs(args) -> dict:
    llm, potential, condition = build_potentials(args.model_dir, args.workload, args.deterministic)
    critic = build_critic(llm, args.workload) if args.critic else None
    beside = None if args.beside is None else (args.beside, BESIDE_TEXTS[args.workload])
    await run_smc(
        llm,
        potential,
        condition,
        args.warmup_seed,
        args.warmup_particles,
        args.max_tokens,
        args.cache_prompt,
        critic,
    )
    runs = [
        await run_smc(
            llm,
            potential,
            condition,
            seed,
            args.particles,
            args.max_tokens,
            args.cache_prompt,
            critic,
            beside,
        )
        for seed in args.seeds
    ]
    return {"backend": BACKEND_NAME, "prompt_ids": list(potential.prompt_ids), "runs": runs}


async def score_contexts(args) -> dict:
    llm, _, _ = build_potentials(args.model_dir, args.workload)
    contexts = json.loads(Path(args.contexts).read_text())
    rows = await asyncio.gather(*(llm.next_token_logprobs(context) for context in contexts))
    scores = torch.stack([row.detach().to(torch.float64).cpu() for row in rows]).numpy()
    np.save(args.scores_out, scores)
    return {"backend": BACKEND_NAME, "num_contexts": len(contexts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["time", "score"])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="email")
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--warmup-seed", type=int, default=1000)
    parser.add_argument("--warmup-particles", type=int, default=2)
    parser.add_argument(
        "--cache-prompt",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cache_kv(prompt) at the start of each run (upstream's advice)",
    )
    parser.add_argument("--critic", action="store_true", help="score particles with an LLM critic")
    parser.add_argument(
        "--deterministic", action="store_true", help="AsyncTransformer(deterministic=True)"
    )
    parser.add_argument(
        "--beside",
        type=int,
        metavar="SEED",
        help="run a second workload on the model beside each timed run, drawn with SEED",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", help="score mode: JSON list of token-id lists")
    parser.add_argument("--scores-out", help="score mode: where to save the log-probabilities")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = time_runs if args.mode == "time" else score_contexts
    print(json.dumps(asyncio.run(work(args))))


if __name__ == "__main__":
    main()
