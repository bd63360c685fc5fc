"""Where ``deterministic=True`` stands on a device: row bits against the row computed alone.

Two probes, each figure printed as it is measured:

* **kernels**: does one row of a projection's product keep its bits whatever
  the number of rows beside it? ``F.linear`` at 1 to 256 rows; the same
  padded to 16 rows (what ``PaddedMatmuls`` does); and the rows cut into
  fixed chunks of 64 and multiplied as one batched product (one product shape
  whatever the row count).
* **rows**: ``AsyncTransformer(deterministic=True)`` on the device, a context
  batched with others (sizes 1 to 21, a cached prompt or not) and particles
  stepping behind a cached prompt, each row against the same context's row
  computed alone from an empty cache: bitwise mismatches and the largest
  difference.

    python benchmarks/gpu/exact_rows.py --device cuda --random-weights benchmarks/gpu/configs/smollm2_135m
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_long_prompt import load_model

from genlm_backend.llm.hf.exact import exact_rows_unsupported

ROW_COUNTS = (1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 256)
CHUNK = 64


def chunked_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as one batched product over fixed chunks of CHUNK rows."""
    rows = x.shape[0]
    padded = -(-rows // CHUNK) * CHUNK
    x = F.pad(x, (0, 0, 0, padded - rows)).view(-1, CHUNK, x.shape[1])
    return torch.matmul(x, weight.T).view(padded, -1)[:rows]


def kernel_probe(device: str, dtype: torch.dtype, in_features: int, out_features: int) -> None:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype) / in_features**0.5
    x = torch.randn(max(ROW_COUNTS), in_features, device=device, dtype=dtype)
    ways = {
        "linear": lambda rows: F.linear(x[:rows], weight),
        "padded to 16": lambda rows: F.linear(
            F.pad(x[:rows], (0, 0, 0, max(0, 16 - rows))), weight
        )[:rows],
        f"chunks of {CHUNK}": lambda rows: chunked_linear(x[:rows], weight),
    }
    for name, product in ways.items():
        reference = product(1)[0]
        same = [rows for rows in ROW_COUNTS if torch.equal(product(rows)[0], reference)]
        worst = max((product(rows)[0] - reference).abs().max().item() for rows in ROW_COUNTS)
        print(
            f"kernels {str(dtype)[6:]} {in_features}->{out_features} {name:14}: row 0 keeps its bits "
            f"at {len(same)}/{len(ROW_COUNTS)} row counts {same}; largest difference {worst:.3g}",
            flush=True,
        )


class Tally:
    def __init__(self):
        self.rows = self.mismatched = 0
        self.worst = 0.0

    def add(self, rows, contexts, alone) -> None:
        for row, context in zip(rows, contexts):
            expected = alone(context)
            self.rows += 1
            if not torch.equal(row, expected):
                self.mismatched += 1
                self.worst = max(self.worst, (row.float() - expected.float()).abs().max().item())


def rows_probe(model, device: str, label: str) -> None:
    from genlm_backend.cache.kv_tree import KVPrefixTree
    from genlm_backend.llm.hf import AsyncTransformer
    from genlm_backend.llm.hf.runner import HFRunner

    vocab_size = model.config.get_text_config().vocab_size
    vocab = [b"<%d>" % i for i in range(vocab_size)]
    memo: dict[tuple[int, ...], torch.Tensor] = {}

    def alone(context) -> torch.Tensor:
        context = tuple(context)
        if context not in memo:
            runner = HFRunner(model, KVPrefixTree(1 << 30), vocab_size, deterministic=True)
            memo[context] = runner.logprobs([context])[0]
        return memo[context]

    def exact_llm():
        return AsyncTransformer(
            model, None, byte_vocab=vocab, deterministic=True, output_cache_bytes=0
        )

    start = time.perf_counter()
    rng = random.Random(1)
    prompt = [rng.randrange(2000) for _ in range(300)]
    target = [*prompt, *(rng.randrange(2000) for _ in range(9))]
    others = [[*prompt[: rng.randrange(1, 300)], rng.randrange(2000)] for _ in range(20)]
    batched = Tally()
    for size in (1, 2, 3, 7, 15, 16, 21):
        for warm in (False, True):
            llm = exact_llm()
            if warm:
                llm.next_token_logprobs_sync(prompt)
            batch = [target, *others[: size - 1]]
            rng.shuffle(batch)
            batched.add(llm.batch_next_token_logprobs_sync(batch), batch, alone)
            llm.close()
    print(
        f"rows {label}: batched (sizes 1-21, prompt cached or not): {batched.mismatched}/{batched.rows} "
        f"rows differ from alone, largest difference {batched.worst:.3g} ({time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    start = time.perf_counter()
    stepped = Tally()
    llm = exact_llm()
    llm.next_token_logprobs_sync(prompt)
    particles = [[*prompt, rng.randrange(2000)] for _ in range(24)]
    for step in range(8):
        stepped.add(llm.batch_next_token_logprobs_sync(particles), particles, alone)
        if step == 3:  # resample
            particles = [list(rng.choice(particles)) for _ in particles]
        for particle in particles:
            particle.append(rng.randrange(2000))
    graphs = llm.runner.graphs.stats
    llm.close()
    print(
        f"rows {label}: 24 particles x 8 steps behind a cached 300-token prompt, resampled once: "
        f"{stepped.mismatched}/{stepped.rows} differ, largest difference {stepped.worst:.3g} "
        f"({graphs.num_captures} captures, {graphs.num_replays} replays; "
        f"{time.perf_counter() - start:.1f} s)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-weights", type=Path, nargs="+", required=True)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--even-refused",
        action="store_true",
        help="probe the dtypes deterministic=True refuses on the device too (is the refusal still due?)",
    )
    args = parser.parse_args()
    if args.even_refused:
        from genlm_backend.llm.hf import runner

        runner.exact_rows_unsupported = lambda device, dtype: None
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"# exact_rows: {args.device} ({name}), torch {torch.__version__}", flush=True)
    for dtype in args.dtypes:
        kernel_probe(args.device, getattr(torch, dtype), 2048, 8192)
    for config in args.random_weights:
        for dtype in args.dtypes:
            refused = exact_rows_unsupported(torch.device(args.device), getattr(torch, dtype))
            if refused is not None and not args.even_refused:
                print(
                    f"rows {config.name} {dtype}: not probed, deterministic=True refuses it: {refused}"
                )
                continue
            model = load_model(
                argparse.Namespace(random_weights=config, device=args.device, dtype=dtype)
            )
            label = f"{config.name} {dtype}" + (" (refused, probed)" if refused else "")
            rows_probe(model, args.device, label)
            del model


if __name__ == "__main__":
    main()
