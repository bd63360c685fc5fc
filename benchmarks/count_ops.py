"""Device operations one step of particles behind a long prompt dispatches: ours vs the floor's step.

When a step is bound by host work (a GPU running a model small for its
batch: every kernel finishes before the host has launched the next), its
time follows the operations the host dispatches: kernel launches, and views
made on the host. This counts them, deterministically, with a torch dispatch
mode, for one one-token step of ``--particles`` rows behind ``--prompt-tokens``:

* ``ours``: one ``await next_token_logprobs`` per particle (the event loop's
  operations and the worker thread's), after two warm-up steps;
* ``floor``: one step of the N-copies loop behind 64 tokens (transformers'
  ``DynamicCache``), plus the prompt's attention once per layer
  (``bench_long_prompt``'s floor).

``--cuda-path`` on a CPU counts the CUDA code path, CUDA's fused attention
kernels emulated (``tests/cuda_emulation.py``): the operations a GPU step
dispatches, on a machine without one. ``--graphs`` on a CPU runs one-token
steps as captured graphs, emulated (``tests/graph_emulation.py``): a replay
counts as one ``graph replay``, the host's other operations (the step's
input copy, copies of resampled rows) as themselves.

Usage::

    python benchmarks/count_ops.py --random-weights CONFIG_DIR --dtype bfloat16 --cuda-path
    python benchmarks/count_ops.py --random-weights CONFIG_DIR --dtype bfloat16 --cuda-path --resample
    python benchmarks/count_ops.py --random-weights CONFIG_DIR --dtype bfloat16 --cuda-path --graphs
    python benchmarks/count_ops.py --device cuda --dtype bfloat16 --random-weights CONFIG_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.cuda_emulation

import torch
from bench_long_prompt import load_model, token_draws
from torch.utils._python_dispatch import TorchDispatchMode


class Counting(TorchDispatchMode):
    """Counts by name the operations dispatched on a thread where it is active, while ``counting`` is set."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.counting = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ours(
    llm, prompt, own, thread_modes=contextlib.nullcontext, resample=False, graphs=None
) -> collections.Counter:
    """Operations of the third step (two warm-up steps first) on the event loop and the worker thread.

    ``thread_modes()`` is entered on each thread below the counting mode
    (dispatch modes are per thread). ``resample``: before each step, particle
    ``i`` continues particle ``7 i mod P`` (then its own token), so each row
    copies another's past into a new block instead of writing in place.
    ``graphs``: the emulated graphs the runner captures with; a replay counts once.
    """
    counting = Counting()
    if graphs is not None:
        count_replays_once(graphs, counting)
    run = llm.runner.run

    def counted_run(requests):
        with thread_modes(), counting:
            return run(requests)

    async def steps():
        await llm.next_token_logprobs(prompt)
        contexts = [prompt + tokens[:1] for tokens in own]
        for step in range(3):
            counting.counting = step == 2
            await asyncio.gather(*map(llm.next_token_logprobs, contexts))
            parents = [contexts[7 * i % len(own) if resample else i] for i in range(len(own))]
            contexts = [
                parent + tokens[step + 1 : step + 2] for parent, tokens in zip(parents, own)
            ]
        counting.counting = False

    llm.runner.run = counted_run
    try:
        with thread_modes(), counting:
            asyncio.run(steps())
    finally:
        llm.runner.run = run
    return counting.counts


def count_replays_once(graphs, counting: Counting) -> None:
    """A replay of ``graphs`` (emulated) counts as one operation, not as the operations it re-runs."""
    capture = graphs.capture

    def capture_counted(step):
        replay, output = capture(step)

        def launch():
            counted, counting.counting = counting.counting, False
            try:
                replay()
            finally:
                counting.counting = counted
            if counted:
                counting.counts["graph replay"] += 1

        return launch, output

    graphs.capture = capture_counted


def count_floor(model, prompt: list[int], own: list[list[int]], device) -> collections.Counter:
    """Operations of one N-copies step behind 64 tokens, plus the prompt's attention once per layer."""
    from transformers import DynamicCache

    from genlm_backend.llm.hf.attention import prefix_attention_with_lse
    from genlm_backend.llm.hf.compat import kv_shape

    config = model.config.get_text_config(decoder=True)
    num_kv_heads, head_dim = kv_shape(config)
    num_groups = config.num_attention_heads // num_kv_heads
    tokens = torch.tensor(own, device=device)
    counting = Counting()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prompt[:64]], device=device), past_key_values=cache, use_cache=True)
        for layer in cache.layers:
            layer.keys = layer.keys.repeat(len(own), 1, 1, 1)
            layer.values = layer.values.repeat(len(own), 1, 1, 1)
        model(tokens[:, :1], past_key_values=cache, use_cache=True)
        query = torch.randn(
            1, num_kv_heads, len(own) * num_groups, head_dim, dtype=model.dtype, device=device
        )
        keys = torch.randn(1, num_kv_heads, len(prompt), head_dim, dtype=model.dtype, device=device)
        counting.counting = True
        with counting:
            logits = model(tokens[:, 1:2], past_key_values=cache, use_cache=True).logits
            torch.log_softmax(logits[:, -1].float(), -1)
            for _ in range(config.num_hidden_layers):
                prefix_attention_with_lse(query, keys, keys, head_dim**-0.5)
    return counting.counts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--random-weights", type=Path, help="config folder: random weights")
    parser.add_argument("--cuda-path", action="store_true", help="on CPU: CUDA kernels emulated")
    parser.add_argument(
        "--resample", action="store_true", help="every particle continues another before each step"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="on CPU: one-token steps as emulated graphs"
    )
    args = parser.parse_args(argv)

    from genlm_backend.llm.hf import AsyncTransformer

    model = load_model(args)
    vocab_size = model.config.get_text_config().vocab_size
    prompt, own = token_draws(vocab_size, args.particles, 3, args.prompt_tokens)
    llm = AsyncTransformer(model, None, byte_vocab=[b"<%d>" % i for i in range(vocab_size)])
    thread_modes = contextlib.nullcontext
    if args.cuda_path:
        from tests.cuda_emulation import EmulatedCudaKernels, cuda_branches

        thread_modes = EmulatedCudaKernels  # below the counting mode: its own work is not counted
    with contextlib.ExitStack() as stack:
        if args.cuda_path:
            stack.enter_context(cuda_branches())
        graphs = None
        if args.graphs:
            from tests.graph_emulation import emulated_graphs

            graphs = stack.enter_context(emulated_graphs())
        ours = count_ours(llm, prompt, own, thread_modes, args.resample, graphs)
        with thread_modes():
            floor = count_floor(model, prompt, own, args.device)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    print(
        f"{args.particles} particles behind {args.prompt_tokens} tokens, {layers} layers, "
        f"{args.dtype} on {args.device}{' (CUDA path, kernels emulated)' if args.cuda_path else ''}"
        f"{', resampled before each step' if args.resample else ''}"
        f"{', one-token steps as graphs (emulated)' if args.graphs else ''}"
    )
    total_ours, total_floor = sum(ours.values()), sum(floor.values())
    print(
        f"operations per step: ours {total_ours}, floor {total_floor} "
        f"({total_ours / total_floor:.2f}x); per layer beyond the floor's: "
        f"{(total_ours - total_floor) / layers:.1f}"
    )
    print("| operation | ours | floor |\n|---|---|---|")
    for name in sorted(ours.keys() | floor.keys(), key=lambda n: floor[n] - ours[n]):
        if ours[name] != floor[name]:
            print(f"| {name} | {ours[name]} | {floor[name]} |")


if __name__ == "__main__":
    main()
