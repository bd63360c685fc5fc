"""Time ``decode_vocab`` on real vocabularies, against per-token decoding in the same run.

Workload: each tokenizer is loaded once (not timed); ``decode_vocab`` is run
once to warm up, then ``--repeats`` times, and the median and best are reported.
The baseline is the lossy approach it replaces: ``tokenizer.batch_decode`` of
every id on its own (Rust, multi-threaded). When ``/work/venvs/upstream`` (or
``$UPSTREAM_VENV``) holds a Python with upstream genlm-backend installed, its
``decode_vocab`` is timed the same way in that interpreter.

Prints a markdown table to stdout (nothing is written to BENCHMARKS.md).

Usage::

    python benchmarks/bench_vocab.py                       # all tokenizers
    python benchmarks/bench_vocab.py --tokenizers qwen3 --repeats 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
UPSTREAM_PYTHON = Path(os.environ.get("UPSTREAM_VENV", "/work/venvs/upstream")) / "bin" / "python"
NAMES = ("gpt2", "qwen3", "llama3", "gemma3", "deepseek_v3")

# Run by the upstream interpreter: loads the same files, times upstream decode_vocab.
UPSTREAM_SNIPPET = """
import statistics, sys, time
from transformers import AutoTokenizer, GPT2Tokenizer
from genlm.backend.tokenization import decode_vocab
folder, name, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
if name == "gpt2":
    tok = GPT2Tokenizer(vocab_file=folder + "/encoder.json", merges_file=folder + "/vocab.bpe")
else:
    tok = AutoTokenizer.from_pretrained(folder)
decode_vocab(tok)
times = []
for _ in range(repeats):
    start = time.perf_counter(); decode_vocab(tok); times.append(time.perf_counter() - start)
print(statistics.median(times))
"""


def load(name: str):
    """The tokenizer under test; DeepSeek-V3 from its tokenizer.json (see docs/tokenization.md)."""
    from transformers import PreTrainedTokenizerFast

    from genlm_backend import assets

    if name == "deepseek_v3":
        path = assets.tokenizer_dir(name) / "tokenizer.json"
        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    return assets.load_tokenizer(name)


def time_calls(function, repeats: int) -> list[float]:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return times


def vocab_megabytes(tokenizer) -> float:
    """Python heap held by the returned ``(byte_vocab, str_vocab)``."""
    from genlm_backend.tokenization import decode_vocab

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = decode_vocab(tokenizer)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del result
    return held / 2**20


def upstream_median(name: str, repeats: int) -> float | None:
    if not UPSTREAM_PYTHON.exists():
        return None
    from genlm_backend import assets

    completed = subprocess.run(
        [
            str(UPSTREAM_PYTHON),
            "-c",
            UPSTREAM_SNIPPET,
            str(assets.tokenizer_dir(name)),
            name,
            str(repeats),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if completed.returncode != 0:
        print(f"upstream failed on {name}: {completed.stderr[-500:]}", file=sys.stderr)
        return None
    return float(completed.stdout.strip().splitlines()[-1])


def bench(name: str, repeats: int) -> dict:
    from genlm_backend.tokenization import decode_vocab

    tokenizer = load(name)
    ids = [[i] for i in range(len(tokenizer))]
    ours = time_calls(lambda: decode_vocab(tokenizer), repeats)
    baseline = time_calls(lambda: tokenizer.batch_decode(ids), max(1, repeats // 2))
    return {
        "name": name,
        "size": len(tokenizer),
        "median_s": statistics.median(ours),
        "best_s": min(ours),
        "baseline_s": statistics.median(baseline),
        "upstream_s": upstream_median(name, repeats),
        "megabytes": vocab_megabytes(tokenizer),
    }


def print_table(rows: list[dict], repeats: int) -> None:
    print(
        f"decode_vocab, {repeats} timed runs after 1 warm-up; python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    print()
    print(
        "| tokenizer | vocab | decode_vocab median s | best s | batch_decode per id s "
        "| upstream median s | vocab heap MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        upstream = "n/a" if row["upstream_s"] is None else f"{row['upstream_s']:.3f}"
        print(
            f"| {row['name']} | {row['size']:,} | {row['median_s']:.3f} | {row['best_s']:.3f} "
            f"| {row['baseline_s']:.3f} | {upstream} | {row['megabytes']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", nargs="+", choices=NAMES, default=list(NAMES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [bench(name, args.repeats) for name in args.tokenizers]
    print_table(rows, args.repeats)


if __name__ == "__main__":
    main()
