"""One masked one-token forward pass of SmolLM2 on CPU: transformers' ``sdpa`` vs the runner's grouped-head attention.

The HF runner always passes a 4-D mask. With a mask, transformers' ``sdpa``
function repeats each key/value head for every query head it serves; the
runner's function (``genlm_backend.llm.hf.compat.grouped_kv_attention``)
keeps them grouped. Same model, same cache contents, same mask, same process;
the two are interleaved and the median of ``--repeats`` timings is reported,
with the largest difference between their logits.

    python benchmarks/bench_attention.py [--rows 64] [--past 32 130] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from genlm_backend.llm.hf.compat import StaticCaches
from genlm_backend.llm.hf.compat import (
    grouped_kv_attention as _grouped_kv_attention,
)
from genlm_backend.models import default_model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--past", type=int, nargs="+", default=[32, 130])
    parser.add_argument("--spare", type=int, default=8, help="masked free slots after the past")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    config = model.config
    print(
        f"SmolLM2-135M fp32, {args.threads} threads, {config.num_attention_heads} query heads, "
        f"{config.num_key_value_heads} key/value heads, {args.rows} rows, one new token each"
    )
    print(
        "| past tokens | transformers sdpa (ms) | grouped heads (ms) | speed-up | max abs logit diff |"
    )
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for past in args.past:
        with torch.inference_mode():
            ids = torch.randint(0, config.vocab_size, (args.rows, past), generator=generator)
            prefill = DynamicCache(config=config)
            model(ids, past_key_values=prefill, use_cache=True)
            slots = past + 1 + args.spare
            layers = []
            for prefilled in prefill.layers:
                keys = prefilled.keys.new_zeros(
                    *prefilled.keys.shape[:2], slots, prefilled.keys.shape[3]
                )
                values = torch.zeros_like(keys)
                keys[:, :, :past], values[:, :, :past] = prefilled.keys, prefilled.values
                layers.append((keys, values))
            caches = StaticCaches(config)
            mask = torch.zeros(args.rows, 1, 1, slots)
            mask[..., past + 1 :] = torch.finfo(torch.float32).min
            token = torch.randint(0, config.vocab_size, (args.rows, 1), generator=generator)
            positions = torch.full((args.rows, 1), past)

            def step(grouped: bool) -> torch.Tensor:
                cache = caches(layers, past)  # the new token goes to slot `past`
                with _grouped_kv_attention(model) if grouped else nullcontext():
                    return model(
                        token,
                        attention_mask=mask,
                        position_ids=positions,
                        past_key_values=cache,
                        use_cache=True,
                    ).logits[:, -1]

            step(False), step(True)  # warm-up
            times = {False: [], True: []}
            for _ in range(args.repeats):
                for grouped in (False, True):
                    start = time.perf_counter()
                    step(grouped)
                    times[grouped].append(time.perf_counter() - start)
            diff = (step(False) - step(True)).abs().max().item()
        plain, grouped = (1000 * statistics.median(times[g]) for g in (False, True))
        print(
            f"| {past} | {plain:.0f} | {grouped:.0f} | {plain / grouped:.2f}x | {diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
