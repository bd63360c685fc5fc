"""Particles behind a long shared prompt: the HF backend vs the N-copies loop vs the compute floor.

Workload ``PxS@T``: P particles behind one T-token prompt take S steps, one
``await next_token_logprobs`` per particle per step. Every particle's tokens
differ from the first one on (particle i starts with its own token, then
draws pre-seeded random tokens), so no step is deduplicated: each computes
P distinct rows. The prompt's prefill is timed apart from the steps. Token
ids are seeded random draws (compute does not depend on them; exactness is
the tests' business). Each variant runs in its own process (clean peak memory):

* ``ours``: ``genlm_backend.AsyncTransformer`` on default settings.
* ``baseline``: ``ours`` as another checkout runs it (``--baseline-tree``).
* ``ncopies``: a plain batched decode loop with a transformers ``DynamicCache``
  whose prompt keys/values are copied into every particle's row.
* ``upstream``: upstream genlm-backend 0.3.1's ``AsyncTransformer`` on its
  defaults, the prompt cached with ``cache_kv`` (its advice), run by the python
  of a virtualenv that has it (``--upstream-python``; ``benchmarks/upstream_env.sh``).
* ``floor``: what an exact answer cannot skip: the ``ncopies`` steps behind a
  64-token prompt (the model's weights and the particles' own tokens), plus the
  prompt's attention computed once per layer and step for all rows together
  (grouped queries against one copy, the fused kernel that returns the
  log-sum-exp, as the merge needs).

Usage::

    python benchmarks/bench_long_prompt.py                      # the four default workloads
    python benchmarks/bench_long_prompt.py --workloads 32x16@4096 --variants floor ours
    python benchmarks/bench_long_prompt.py --variants floor ours upstream --upstream-python PY
    python benchmarks/bench_long_prompt.py --device cuda --dtype bfloat16 --random-weights CONFIG_DIR
    python benchmarks/bench_long_prompt.py --workloads 32x16@4096 --paired 5   # floor and ours in turns

``--paired ROUNDS`` runs ``floor`` and ``ours`` in turns in one process (see
:func:`run_paired`) and reports the ratio of each round and their median: the
figure to trust on a machine whose speed drifts between processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("32x16@64", "32x16@1024", "32x16@4096", "64x32@2048")
VARIANTS = ("floor", "ncopies", "ours")
FLOOR_PROMPT_TOKENS = 64


def parse_workload(text: str) -> tuple[int, int, int]:
    shape, prompt = text.split("@")
    particles, steps = shape.split("x")
    return int(particles), int(steps), int(prompt)


def token_draws(vocab_size: int, particles: int, steps: int, prompt_tokens: int, seed: int = 0):
    """The prompt and each particle's tokens: seeded, distinct from each particle's first token on.

    The prompt does not depend on ``seed``; the particles' first tokens of
    one seed differ from those of every other seed.
    """
    import torch

    generator = torch.Generator().manual_seed(0)
    high = min(vocab_size, 32000)
    prompt = torch.randint(0, high, (prompt_tokens,), generator=generator).tolist()
    if seed:
        generator.manual_seed(seed)
    own = torch.randint(0, high, (particles, steps), generator=generator)
    own[:, 0] = torch.arange(particles) + 100 + seed * particles  # distinct first tokens
    return prompt, own.tolist()


def load_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.random_weights)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        from genlm_backend.models import default_model_dir

        path = args.model or default_model_dir()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ours(model, args, particles, steps, prompt, own, warm_up) -> dict:
    import asyncio

    from genlm_backend.llm.hf import AsyncTransformer

    vocab = [b"<%d>" % i for i in range(model.config.get_text_config().vocab_size)]
    llm = AsyncTransformer(model, None, byte_vocab=vocab)

    rows_before = 0

    async def main():
        warm_prompt, warm_own = warm_up  # other tokens: nothing of it is reused below
        for step in range(2):
            await llm.batch_next_token_logprobs([warm_prompt + o[: step + 1] for o in warm_own])
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        synchronize(args.device)
        prefilled = time.perf_counter()
        nonlocal rows_before
        rows_before = llm.stats.num_contexts_computed
        for step in range(steps):
            await asyncio.gather(
                *(llm.next_token_logprobs(prompt + own[i][: step + 1]) for i in range(particles))
            )
        synchronize(args.device)
        return start, prefilled, time.perf_counter()

    start, prefilled, end = asyncio.run(main())
    stats, kv = llm.stats, llm.kv_cache.stats
    return {
        "prefill_s": prefilled - start,
        "steps_s": end - prefilled,
        "kv_held_mb": kv.bytes_held / 2**20,
        "kv_shared_mb": getattr(kv, "bytes_shared", 0) / 2**20,
        "rows_per_step": (stats.num_contexts_computed - rows_before) / steps,
        "mean_batch_size": stats.mean_batch_size,
    }


def run_paired(model, args, particles, steps, prompt_tokens) -> dict:
    """``floor`` and ``ours`` in turns in one process, ``args.paired`` rounds, the order alternating.

    On a shared machine whose speed drifts over minutes, the two runs of a
    round are seconds apart, so their ratio is steadier than that of two
    processes a minute apart. Ours prefills the prompt once; each round's
    particles start with first tokens of their own, so a round reuses the
    prompt and nothing of an earlier round.
    """
    import asyncio
    import statistics

    from genlm_backend.llm.hf import AsyncTransformer

    vocab_size = model.config.get_text_config().vocab_size
    floor_prompt, floor_own = token_draws(vocab_size, particles, steps, FLOOR_PROMPT_TOKENS)
    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(vocab_size)])
    prompt, _ = token_draws(vocab_size, particles, steps, prompt_tokens)
    warm_prompt, warm_own = token_draws(vocab_size, particles, 2, 16)
    warm_prompt = [t + 1 for t in warm_prompt]

    def floor() -> float:
        _, steps_at_floor, _ = ncopies_steps(model, args, particles, steps, floor_prompt, floor_own)
        return steps_at_floor + prompt_attention_seconds(
            model, args, particles, steps, prompt_tokens
        )

    async def ours(seed: int) -> float:
        _, own = token_draws(vocab_size, particles, steps, prompt_tokens, seed=seed)
        start = time.perf_counter()
        for step in range(steps):
            await asyncio.gather(
                *(llm.next_token_logprobs(prompt + own[i][: step + 1]) for i in range(particles))
            )
        synchronize(args.device)
        return time.perf_counter() - start

    async def main():
        ncopies_steps(model, args, particles, 2, floor_prompt, floor_own)  # warm-ups
        await llm.batch_next_token_logprobs([warm_prompt + o[:1] for o in warm_own])
        start = time.perf_counter()
        await llm.next_token_logprobs(prompt)
        synchronize(args.device)
        prefill = time.perf_counter() - start
        rounds = []
        for index in range(args.paired):
            if index % 2 == 0:
                floor_s, ours_s = floor(), await ours(index + 1)
            else:
                ours_s, floor_s = await ours(index + 1), floor()
            rounds.append((floor_s, ours_s))
            print(f"round {index}: floor {floor_s:.2f} s, ours {ours_s:.2f} s", file=sys.stderr)
        return prefill, rounds

    prefill, rounds = asyncio.run(main())
    return {
        "prefill_s": prefill,
        "rounds": [{"floor_s": f, "ours_s": o, "ratio": o / f} for f, o in rounds],
        "median_ratio": statistics.median(o / f for f, o in rounds),
        "floor_median_s": statistics.median(f for f, _ in rounds),
        "ours_median_s": statistics.median(o for _, o in rounds),
    }


def run_upstream(model, args, particles, steps, prompt, own, warm_up) -> dict:
    """Upstream 0.3.1's AsyncTransformer, its defaults, the prompt cached by ``cache_kv``."""
    import asyncio

    from genlm.backend.llm import AsyncTransformer as UpstreamTransformer
    from transformers import AutoTokenizer

    llm = UpstreamTransformer(model, AutoTokenizer.from_pretrained(args.model))

    async def main():
        warm_prompt, warm_own = warm_up
        for step in range(2):
            await asyncio.gather(
                *(llm.next_token_logprobs(warm_prompt + o[: step + 1]) for o in warm_own)
            )
        start = time.perf_counter()
        llm.cache_kv(prompt)
        prefilled = time.perf_counter()
        for step in range(steps):
            await asyncio.gather(
                *(llm.next_token_logprobs(prompt + own[i][: step + 1]) for i in range(particles))
            )
        return start, prefilled, time.perf_counter()

    start, prefilled, end = asyncio.run(main())
    return {"prefill_s": prefilled - start, "steps_s": end - prefilled, "rows_per_step": particles}


def ncopies_steps(model, args, particles, steps, prompt, own) -> tuple[float, float, float]:
    """(prefill s, steps s, keys/values MB at the end) of the N-copies decode loop."""
    import torch
    from transformers import DynamicCache

    device = args.device
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prompt], device=device), past_key_values=cache, use_cache=True)
        synchronize(device)
        prefilled = time.perf_counter()
        for layer in cache.layers:  # every particle's row gets its own copy of the prompt
            layer.keys = layer.keys.repeat(particles, 1, 1, 1)
            layer.values = layer.values.repeat(particles, 1, 1, 1)
        tokens = torch.tensor(own, device=device)
        for step in range(steps):
            logits = model(tokens[:, step : step + 1], past_key_values=cache, use_cache=True).logits
            torch.log_softmax(logits[:, -1].float(), -1)
        synchronize(device)
        end = time.perf_counter()
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return prefilled - start, end - prefilled, held / 2**20


def prompt_attention_seconds(
    model, args, particles, steps, prompt_tokens, captured: bool = False
) -> float:
    """The prompt's attention once per layer and step: every row's grouped queries against one copy.

    Each layer reads its own copy of the prompt's keys/values, as in the
    model: the prompt's keys/values stream from memory once per step. With
    ``captured`` on CUDA, a step's attention over all layers runs as one CUDA
    graph (an engine's step launches it inside its graph, not layer by layer).
    """
    import torch

    from genlm_backend.llm.hf.attention import prefix_attention_with_lse
    from genlm_backend.llm.hf.compat import kv_shape

    config = model.config.get_text_config(decoder=True)
    num_kv_heads, head_dim = kv_shape(config)
    num_groups = config.num_attention_heads // num_kv_heads
    dtype, device = model.dtype, args.device
    query = torch.randn(
        1, num_kv_heads, particles * num_groups, head_dim, dtype=dtype, device=device
    )
    shape = (1, num_kv_heads, prompt_tokens, head_dim)
    layers = [
        (
            torch.randn(shape, dtype=dtype, device=device),
            torch.randn(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]
    scale = head_dim**-0.5

    def one_step() -> None:
        for keys, values in layers:
            prefix_attention_with_lse(query, keys, values, scale)

    one_step()  # warm-up
    if captured and device.startswith("cuda"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_step()
        one_step = graph.replay
        one_step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    synchronize(device)
    return time.perf_counter() - start


def run_child(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    particles, steps, prompt_tokens = parse_workload(args.workload)
    model = load_model(args)
    vocab_size = model.config.get_text_config().vocab_size
    if args.child == "paired":
        return run_paired(model, args, particles, steps, prompt_tokens)
    if args.child == "floor":
        prompt, own = token_draws(vocab_size, particles, steps, FLOOR_PROMPT_TOKENS)
        ncopies_steps(model, args, particles, 2, prompt, own)  # warm-up
        _, steps_at_floor, _ = ncopies_steps(model, args, particles, steps, prompt, own)
        attention = prompt_attention_seconds(model, args, particles, steps, prompt_tokens)
        result = {
            "steps_s": steps_at_floor + attention,
            "steps_at_64_s": steps_at_floor,
            "prompt_attention_s": attention,
        }
    else:
        prompt, own = token_draws(vocab_size, particles, steps, prompt_tokens)
        # warm-up at the workload's batch size, on other tokens
        warm_prompt, warm_own = token_draws(vocab_size, particles, 2, 16)
        warm_prompt = [t + 1 for t in warm_prompt]
        if args.child == "ncopies":
            ncopies_steps(model, args, particles, 2, warm_prompt, warm_own)
            prefill, seconds, held = ncopies_steps(model, args, particles, steps, prompt, own)
            result = {"prefill_s": prefill, "steps_s": seconds, "kv_held_mb": held}
            result["rows_per_step"] = particles
        else:
            run = run_upstream if args.child == "upstream" else run_ours
            result = run(model, args, particles, steps, prompt, own, (warm_prompt, warm_own))
    return result | {"peak_mb": peak_memory_mb(args.device)}


def peak_memory_mb(device: str) -> float:
    import resource

    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def spawn(variant: str, workload: str, args) -> dict:
    tree = HERE.parent
    child, python = variant, sys.executable
    if variant == "upstream":
        if args.upstream_python is None or args.random_weights:
            return {"error": "the upstream variant needs --upstream-python and a real model"}
        python = args.upstream_python
    if variant == "baseline":
        if args.baseline_tree is None:
            return {"error": "the baseline variant needs --baseline-tree"}
        tree, child = args.baseline_tree.resolve(), "ours"
    command = [
        python,
        str(Path(__file__).resolve()),
        "--child",
        child,
        "--workload",
        workload,
    ]
    command += ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    command += ["--paired", str(args.paired)]
    if args.random_weights:
        command += ["--random-weights", str(args.random_weights.resolve())]
    if args.model or variant == "upstream":  # upstream's venv lacks genlm_backend's model lookup
        command += ["--model", args.model or _default_model_dir()]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        cwd=tree,
        # the tree first; what the caller's path adds (e.g. newer wheels) stays after it
        env=os.environ
        | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))},
    )
    if result.returncode != 0:
        return {"error": result.stderr[-1500:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _default_model_dir() -> str:
    from genlm_backend.models import default_model_dir

    return str(default_model_dir())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument(
        "--baseline-tree", type=Path, help="checkout whose AsyncTransformer is 'baseline'"
    )
    parser.add_argument(
        "--upstream-python", help="python of a virtualenv with genlm-backend 0.3.1 ('upstream')"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per variant, interleaved; median kept"
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: floor and ours in turns in one process, ROUNDS rounds (ratio per round)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument(
        "--random-weights", type=Path, help="config folder: that architecture, random weights"
    )
    parser.add_argument("--json", type=Path, help="also write all results to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return
    print(
        f"# {platform.processor() or platform.machine()}, {args.device}, {args.dtype}, {args.threads} threads"
    )
    if args.paired:
        print(
            "| workload | floor steps (s), per round | ours steps (s), per round | ours / floor, per round | median ratio |"
        )
        print("|---|---|---|---|---|")
        results = []
        for workload in args.workloads:
            run = spawn("paired", workload, args)
            results.append({"workload": workload} | run)
            print(_paired_row(workload, run), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
        return
    print(
        "| workload | variant | prefill (s) | steps (s) | x floor | peak MB | KV held MB | KV shared MB | rows/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    run_interleaved(args, spawn, "floor", _row)


def run_interleaved(args, spawn, reference: str, row) -> None:
    """Each workload's variants, one process each, ``args.repeats`` times with the order
    alternating; prints ``row(workload, variant, median run, reference's steps_s)`` per
    variant and writes every median to ``args.json``."""
    results = []
    for workload in args.workloads:
        runs: dict[str, list[dict]] = {v: [] for v in args.variants}
        for repeat in range(args.repeats):
            for variant in args.variants if repeat % 2 == 0 else args.variants[::-1]:
                runs[variant].append(spawn(variant, workload, args))
                print(f"{workload} {variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)
        medians = {v: median_run(r) for v, r in runs.items()}
        reference_s = medians.get(reference, {}).get("steps_s")
        for variant, run in medians.items():
            results.append({"workload": workload, "variant": variant} | run)
            print(row(workload, variant, run, reference_s), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def median_run(runs: list[dict]) -> dict:
    """The run of median step time (the lower one of an even count), with every run's steps."""
    good = sorted((r for r in runs if "steps_s" in r), key=lambda r: r["steps_s"])
    if not good:
        return runs[0]
    return good[(len(good) - 1) // 2] | {"all_steps_s": [round(r["steps_s"], 3) for r in good]}


def _paired_row(workload: str, run: dict) -> str:
    if "error" in run:
        return f"| {workload} | error: {run['error'].splitlines()[-1][:80]} | | | |"

    def column(key, digits=2):
        return ", ".join(f"{r[key]:.{digits}f}" for r in run["rounds"])

    return (
        f"| {workload} | {column('floor_s')} | {column('ours_s')} | {column('ratio')} | "
        f"**{run['median_ratio']:.2f}x** |"
    )


def _row(workload: str, variant: str, run: dict, floor: float | None) -> str:
    if "error" in run:
        return (
            f"| {workload} | {variant} | error: {run['error'].splitlines()[-1][:80]} | | | | | | |"
        )

    def fmt(key, digits=2):
        return f"{run[key]:.{digits}f}" if key in run else ""

    ratio = f"{run['steps_s'] / floor:.2f}x" if floor else ""
    return (
        f"| {workload} | {variant} | {fmt('prefill_s')} | {fmt('steps_s')} | {ratio} | "
        f"{fmt('peak_mb', 0)} | {fmt('kv_held_mb', 0)} | {fmt('kv_shared_mb', 0)} | {fmt('rows_per_step', 1)} |"
    )


if __name__ == "__main__":
    main()
