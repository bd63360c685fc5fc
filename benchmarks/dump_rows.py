"""Rows of a fixed workload, saved to compare two commits bit for bit.

The workload: SMC-like particles behind a shared prompt (a resample, nested
contexts in one batch call, scores of continuations), through
``AsyncTransformer`` on the default model (or ``--random-weights CONFIG``),
in the default mode and with ``deterministic=True``. Every row and score is
saved in order; ``--compare`` reports, per mode, how many differ and by how
much.

    python benchmarks/dump_rows.py --out /tmp/rows_new.pt
    git worktree add /tmp/old OLD && (cd /tmp/old && python benchmarks/dump_rows.py --out /tmp/rows_old.pt)
    python benchmarks/dump_rows.py --compare /tmp/rows_old.pt /tmp/rows_new.pt

Options that change a step's shape are passed only where the commit knows them
(``--no-chunks`` sets ``chunk_tokens=None`` when the constructor takes it).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = {"default": False, "deterministic": True}


def workload(llm, seed: int = 0) -> list[torch.Tensor]:
    """The workload's rows and scores, in order."""
    rng = random.Random(seed)
    vocab = min(llm.vocab_size, 30000)
    prompt = [rng.randrange(vocab) for _ in range(300)]
    particles = [[*prompt, rng.randrange(vocab)] for _ in range(12)]
    out: list[torch.Tensor] = []

    async def run() -> None:
        for step in range(6):
            rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
            out.extend(row.clone() for row in rows)
            if step == 3:  # resample
                particles[:] = [list(particles[rng.randrange(4)]) for _ in particles]
            for p in particles:
                p.append(int(torch.argmax(rows[0][:vocab])) if step % 2 else rng.randrange(vocab))
        longest = [*particles[0], *(rng.randrange(vocab) for _ in range(5))]
        nested = [longest[:n] for n in range(len(longest) - 4, len(longest) + 1)]
        out.extend((await llm.batch_next_token_logprobs(nested)).clone().unbind(0))
        continuations = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17)]
        out.extend(await llm.batch_continuation_logprobs(particles[1], continuations))

    asyncio.run(run())
    return out


def load(model_dir: str | None, random_weights: str | None, deterministic: bool, chunks: bool):
    from genlm_backend.llm import AsyncTransformer

    options = {"deterministic": deterministic}
    if not chunks and "chunk_tokens" in inspect.signature(_lm_init()).parameters:
        options["chunk_tokens"] = None
    if random_weights is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(random_weights)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        vocab = [b"<%d>" % i for i in range(config.vocab_size)]
        return AsyncTransformer(model, None, byte_vocab=vocab, **options)
    return AsyncTransformer.from_name(model_dir, **options)


def _lm_init():
    from genlm_backend.llm.base import AsyncLM

    return AsyncLM.__init__


def compare(a_path: Path, b_path: Path) -> int:
    a, b = torch.load(a_path), torch.load(b_path)
    status = 0
    for mode in MODES:
        rows_a, rows_b = a[mode], b[mode]
        if len(rows_a) != len(rows_b):
            print(f"{mode}: {len(rows_a)} against {len(rows_b)} rows")
            status = 1
            continue
        differ = [i for i, (x, y) in enumerate(zip(rows_a, rows_b)) if not torch.equal(x, y)]
        worst = max(
            (float((rows_a[i] - rows_b[i]).abs().nan_to_num(0.0).max()) for i in differ),
            default=0.0,
        )
        print(
            f"{mode}: {len(differ)} of {len(rows_a)} rows differ (largest difference {worst:.3g})"
        )
        status |= bool(differ)
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path)
    parser.add_argument("--model", default=None, help="a local model folder (default: SmolLM2)")
    parser.add_argument("--random-weights", help="a config folder: random weights instead")
    parser.add_argument("--no-chunks", action="store_true", help="whole steps (chunk_tokens=None)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    torch.set_num_threads(args.threads)
    saved = {}
    for mode, deterministic in MODES.items():
        llm = load(args.model, args.random_weights, deterministic, chunks=not args.no_chunks)
        saved[mode] = workload(llm)
        llm.close()
        print(f"{mode}: {len(saved[mode])} rows")
    torch.save(saved, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
