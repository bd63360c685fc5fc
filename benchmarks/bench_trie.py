"""Trie benchmark: ours vs upstream genlm-backend 0.3.1, same vocabulary and weights, same run.

Workload: the SmolLM2 (49,152 tokens) and Qwen3 (151,669 tokens) byte
vocabularies; a batch of 32 weight rows (seeded log-softmax of N(0, 3^2)
logits; probabilities for sums, log-probabilities for max and logsumexp); CPU,
``torch.set_num_threads(2)`` (``--threads``). On a loaded machine, OpenMP
threads busy-wait at every parallel region and multi-thread timings mostly
measure that; compare with ``--threads 1`` there. Each operation is warmed up, then timed
``--repeats`` times; the table gives the median (and the minimum).

Upstream runs in its own virtualenv (``bash benchmarks/upstream_env.sh``) via a
subprocess of this same file in ``--upstream-driver`` mode, which reads the
vocabulary and weights from a temp file and prints JSON timings.

Usage: python benchmarks/bench_trie.py [--vocab smollm2 qwen3] [--repeats 20]
Prints a markdown table to stdout; appends nothing anywhere.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

UPSTREAM_PYTHON = "/work/venvs/upstream/bin/python"
BATCH_SIZE = 32
DEFAULT_NUM_THREADS = 2
NUM_WARMUP = 3


def timed(fn, repeats: int) -> dict:
    """Median and min wall-clock milliseconds of ``fn()`` after warm-up."""
    for _ in range(NUM_WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def make_workload(num_tokens: int, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH_SIZE, num_tokens, generator=generator) * 3.0
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.exp(), logprobs


def load_vocab(name: str) -> list[bytes]:
    from genlm_backend.tokenization import decode_vocab

    if name == "smollm2":
        from transformers import AutoTokenizer

        from genlm_backend.models import default_model_dir

        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    else:
        from genlm_backend import assets

        tokenizer = assets.load_tokenizer(name)
    return [bytes(token) for token in decode_vocab(tokenizer)[0]]


def bench_ours(vocab: list[bytes], repeats: int) -> dict:
    import numpy as np
    import torch

    from genlm_backend.tokenization.token import make_tokens
    from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie

    vocab = make_tokens(vocab)  # what decode_vocab returns (plain bytes are deprecated)
    start = time.perf_counter()
    trie = ParallelTokenCharacterTrie(vocab, device="cpu")
    build_s = time.perf_counter() - start
    probs, logprobs = make_workload(len(vocab))
    sequential = TokenCharacterTrie(vocab)
    internal = {node: trie.node2prefix[node] for node in range(trie.num_internal_nodes)}
    probs64, logprobs64 = probs.double().numpy(), logprobs.double().numpy()
    return {
        "num_nodes": trie.num_nodes,
        "build_s": build_s,
        "batch_weight_sum": timed(lambda: trie.batch_weight_sum(probs), repeats),
        "batch_weight_max": timed(lambda: trie.batch_weight_max(logprobs), repeats),
        "batch_weight_logsumexp": timed(lambda: trie.batch_weight_logsumexp(logprobs), repeats),
        "batch_weight_sum + C order": timed(
            lambda: np.ascontiguousarray(trie.batch_weight_sum(probs)), repeats
        ),
        "sequential float64 batch_weight_sum": timed(
            lambda: sequential.batch_weight_sum(probs64), max(3, repeats // 4)
        ),
        "sequential float64 batch_weight_max": timed(
            lambda: sequential.batch_weight_max(logprobs64), max(3, repeats // 4)
        ),
        "check": prefix_sums(internal, trie.batch_weight_sum(probs)[0].tolist(), vocab),
        "check_float64": prefix_sums(internal, sequential.batch_weight_sum(probs64)[0], vocab),
        "torch": torch.__version__,
    }


def prefix_sums(prefix_of: dict[int, bytes], sums, vocab) -> dict:
    """Row-0 sums at the root and every proper prefix of 20 sampled tokens, keyed by hex prefix."""
    wanted = {token[:i] for token in vocab[:: max(1, len(vocab) // 20)] for i in range(len(token))}
    return {prefix.hex(): float(sums[n]) for n, prefix in prefix_of.items() if prefix in wanted}


def upstream_driver(path: str, repeats: int, num_threads: int) -> None:
    """Runs inside the upstream venv: times genlm-backend 0.3.1's ParallelTokenCharacterTrie."""
    import torch
    from genlm.backend.tokenization import Token
    from genlm.backend.trie import ParallelTokenCharacterTrie

    torch.set_num_threads(num_threads)
    vocab = pickle.loads(Path(path).read_bytes())
    tokens = [Token(token_id, byte_string) for token_id, byte_string in enumerate(vocab)]
    start = time.perf_counter()
    trie = ParallelTokenCharacterTrie(tokens, device="cpu")
    build_s = time.perf_counter() - start
    probs, logprobs = make_workload(len(vocab))
    sums = trie.batch_weight_sum(probs)[0]
    internal = {n: bytes(p) for n, p in trie.node2prefix.items() if n not in trie.leaf2word}
    result = {
        "num_nodes": len(trie.children),
        "build_s": build_s,
        "batch_weight_sum": timed(lambda: trie.batch_weight_sum(probs), repeats),
        "batch_weight_max": timed(lambda: trie.batch_weight_max(logprobs), repeats),
        "check": prefix_sums(internal, sums, vocab),
    }
    print(json.dumps(result))


def bench_upstream(vocab: list[bytes], repeats: int, num_threads: int) -> dict | None:
    if not Path(UPSTREAM_PYTHON).exists():
        print(
            f"# upstream skipped: {UPSTREAM_PYTHON} missing; run bash benchmarks/upstream_env.sh",
            file=sys.stderr,
        )
        return None
    with tempfile.NamedTemporaryFile(suffix=".pkl") as file:
        file.write(pickle.dumps(vocab))
        file.flush()
        completed = subprocess.run(
            [
                UPSTREAM_PYTHON,
                "-W",
                "ignore",
                __file__,
                "--upstream-driver",
                file.name,
                "--repeats",
                str(repeats),
                "--threads",
                str(num_threads),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def relative_errors(reference: dict, sums: dict) -> float:
    """Largest relative difference of ``sums`` from ``reference`` at their shared prefixes."""
    shared = [key for key in sums if key in reference]
    if not shared:
        raise RuntimeError("no shared prefixes to compare the tries on")
    return max(abs(sums[k] - reference[k]) / max(abs(reference[k]), 1e-30) for k in shared)


def format_table(results: dict, num_threads: int) -> str:
    lines = [
        f"Trie benchmark: batch {BATCH_SIZE}, CPU, {num_threads} torch threads, "
        f"{platform.processor() or platform.machine()}; median (min) ms after warm-up.",
        "",
        "| vocabulary | operation | upstream 0.3.1 | ours | speedup |",
        "|---|---|---|---|---|",
    ]
    for name, (ours, upstream) in results.items():
        vocab_label = f"{name} (V={ours['num_tokens']:,}, {ours['num_nodes']:,} nodes)"
        lines.append(
            _row(
                vocab_label,
                "build (s)",
                upstream and upstream["build_s"],
                ours["build_s"],
                "{:.2f}",
            )
        )
        for op in (
            "batch_weight_sum",
            "batch_weight_max",
            "batch_weight_logsumexp",
            "batch_weight_sum + C order",
            "sequential float64 batch_weight_sum",
            "sequential float64 batch_weight_max",
        ):
            base = upstream.get(op) if upstream else None
            lines.append(_row(vocab_label, op, base, ours[op], None))
    return "\n".join(lines)


def _row(vocab_label, op, base, ours, fmt) -> str:
    def show(value):
        if value is None:
            return "n/a"
        if fmt:
            return fmt.format(value)
        return f"{value['median_ms']:.1f} ({value['min_ms']:.1f})"

    if base is None:
        speedup = "n/a"
    elif fmt:
        speedup = f"{base / ours:.1f}x"
    else:
        speedup = f"{base['median_ms'] / ours['median_ms']:.1f}x"
    return f"| {vocab_label} | {op} | {show(base)} | {show(ours)} | {speedup} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", nargs="+", default=["smollm2", "qwen3"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_NUM_THREADS,
        help="torch intra-op threads, for both tries (default 2)",
    )
    parser.add_argument("--upstream-driver", metavar="VOCAB_PICKLE", help=argparse.SUPPRESS)
    parser.add_argument("--no-upstream", action="store_true", help="time ours only")
    args = parser.parse_args()
    if args.upstream_driver:
        upstream_driver(args.upstream_driver, args.repeats, args.threads)
        return
    import torch

    torch.set_num_threads(args.threads)
    results = {}
    for name in args.vocab:
        vocab = load_vocab(name)
        upstream = None if args.no_upstream else bench_upstream(vocab, args.repeats, args.threads)
        ours = bench_ours(vocab, args.repeats) | {"num_tokens": len(vocab)}
        ours_error = relative_errors(ours["check_float64"], ours["check"])
        print(
            f"# {name}: float32 sums, largest relative error vs float64 at "
            f"{len(ours['check'])} sampled prefixes: ours {ours_error:.1e}",
            file=sys.stderr,
        )
        if upstream is not None:
            upstream_error = relative_errors(ours["check_float64"], upstream["check"])
            print(f"# {name}: ... upstream {upstream_error:.1e}", file=sys.stderr)
        if ours_error > 1e-5:
            raise RuntimeError(f"float32 sums are off on {name} ({ours_error:.1e})")
        results[name] = (ours, upstream)
    print(format_table(results, args.threads))
    print(
        f"\nCommand: python benchmarks/bench_trie.py --vocab {' '.join(args.vocab)} "
        f"--repeats {args.repeats} --threads {args.threads}; torch {torch.__version__}"
    )


if __name__ == "__main__":
    main()
