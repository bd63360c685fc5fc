"""A particle step against the hardware's limit, in one process: R, G, G-fused, ours-runner and ours.

Workload ``PxS@T`` (as ``bench_long_prompt.py``): P particles behind one
T-token prompt take S one-token steps, every row distinct. Per step:

* **R**, the limit: the bytes a step must read (the weights the step
  touches, the prompt's keys/values once, the particles' own keys/values, the
  logits written and read back by the log-softmax) over the device's copy
  bandwidth, measured in this process (a large device-to-device copy: bytes
  read and written over its time).
* **G**, a well-built engine step: the transformers model stepping the P rows
  over a ``StaticCache`` of their own tokens, captured as one CUDA graph on
  CUDA (eager elsewhere, or where capture fails: then said so), plus the
  prompt's attention once per layer for all rows (grouped queries against one
  copy, ``bench_long_prompt.prompt_attention_seconds``, also one CUDA graph on CUDA).
* **G-fused**: the same step with the library's fused decoder
  (:class:`~genlm_backend.llm.hf.fused.FusedDecoder`, compiled unless
  ``--fused-eager``) in place of the transformers model, over preallocated
  slots of the rows' own keys/values, captured alike: our fused step alone, no
  host work. Its rows are checked against G's (the largest difference is printed).
* **ours-runner**: ``HFRunner.logprobs`` called directly, one batch per step.
* **ours**: ``await next_token_logprobs``, one per particle per step, each
  particle then drawing its next token from its row as a client does: drawn
  on the rows' device (Gumbel-max over the step's rows, seeded), one index per
  row back to the host. Also: the same with the step's rows brought to the
  host in one page-locked copy a step (the copy's own time beside it), and
  with batches in the event loop's thread (``compute_in_loop=True``).

Each figure is printed as it is measured (most valuable first), so a run cut
short keeps what it measured. Also: the captured steps' count and the first
step's time (capture included), and on CUDA the GPU-busy fraction of ours's
steps (kernel time from ``torch.profiler`` over wall time). G beyond 1.3R
means the measurement or the engine step is wrong. On CPU every figure is
measured too (eagerly: no CUDA graphs); only a GPU gives the figures the GPU
issue asks for.

    python benchmarks/bench_gpu_step.py --device cuda --dtype bfloat16 \\
        --random-weights LLAMA3_8B_CONFIG_DIR --workloads 64x32@4096
    python benchmarks/bench_gpu_step.py --workloads 8x4@64        # CPU, default model
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_long_prompt import (
    load_model,
    parse_workload,
    prompt_attention_seconds,
    synchronize,
    token_draws,
)

OWN_SLOTS = 64
"""Tokens of each row's own past G's static cache starts with (the floor's 64-token past)."""


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + written), the best of 5."""
    import torch

    nbytes = (1 << 30) if device.startswith("cuda") else (256 << 20)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def step_bytes(model, particles: int, steps: int, prompt_tokens: int) -> dict[str, float]:
    """The bytes one step must read, by part (own keys/values at the workload's mean length)."""
    from genlm_backend.llm.hf.compat import kv_shape

    config = model.config.get_text_config(decoder=True)
    num_kv_heads, head_dim = kv_shape(config)
    element = model.dtype.itemsize
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or embeddings.weight is not head.weight:  # untied: the input table is gathered
        weights -= embeddings.weight.numel() * embeddings.weight.element_size()
    per_token = 2 * config.num_hidden_layers * num_kv_heads * head_dim * element
    vocab = config.vocab_size
    return {
        "weights": weights,
        "prompt keys/values": per_token * prompt_tokens,
        "own keys/values": per_token * particles * (steps + 1) / 2,
        "logits": particles * vocab * (element + 2 * 4),  # written; read and written in float32
    }


def captured(step, device: str):
    """``(how, replay)``: ``replay()`` runs ``step`` and returns its output; on CUDA one CUDA
    graph (its static output), elsewhere or where capture fails ``step`` itself (said in ``how``)."""
    import torch

    if not device.startswith("cuda"):
        return "eager", step
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step()
    except Exception as exc:  # noqa: BLE001 - reported: the step then runs eagerly
        return f"eager (capture failed: {type(exc).__name__}: {str(exc)[:80]})", step

    def replay():
        graph.replay()
        return output

    return "one CUDA graph", replay


def timed_steps(replay, advance, steps: int, device: str):
    """Seconds per step of ``steps`` replays, ``advance(index)`` setting each one's position; the
    last replay's output."""
    advance(0)
    replay()
    synchronize(device)
    start = time.perf_counter()
    for index in range(steps):
        advance(index)
        output = replay()
    synchronize(device)
    return (time.perf_counter() - start) / steps, output


def own_past(particles: int, vocab_size: int, device: str):
    """Each row's own past: ``[P, OWN_SLOTS]`` seeded token ids (G and G-fused read the same)."""
    import torch

    generator = torch.Generator().manual_seed(3)
    high = min(vocab_size, 1000)
    return torch.randint(0, high, (particles, OWN_SLOTS), generator=generator).to(device)


def graph_step_seconds(model, args, particles: int, steps: int):
    """G: seconds per step of the static-cache step, how it ran, and its last rows ``[P, V]``."""
    import torch
    from transformers import StaticCache

    device = args.device
    cache = StaticCache(config=model.config, max_cache_len=OWN_SLOTS + steps + 1)
    ids = own_past(particles, model.config.get_text_config().vocab_size, device)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)  # each row's own past
        step_ids = torch.zeros(particles, 1, dtype=torch.long, device=device)
        position = torch.full((particles, 1), OWN_SLOTS, device=device)
        cache_position = torch.tensor([OWN_SLOTS], device=device)  # transformers < 5.23 reads it
        # transformers >= 5.23: each layer writes at its own device counter, which a step
        # advances; one tensor holds them all, so one fill sets the write slot for a replay.
        lengths = torch.full((len(cache.layers),), OWN_SLOTS, device=device)
        for index, layer in enumerate(cache.layers):
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                layer.cumulative_length = lengths[index]

        def step():
            logits = model(
                step_ids,
                position_ids=position,
                cache_position=cache_position,
                past_key_values=cache,
                use_cache=True,
            ).logits
            return torch.log_softmax(logits[:, -1].float(), -1)

        def advance(index: int) -> None:  # device data: a replay reads it
            position.fill_(OWN_SLOTS + index)
            cache_position.fill_(OWN_SLOTS + index)
            lengths.fill_(OWN_SLOTS + index)

        how, replay = captured(step, device)
        seconds, rows = timed_steps(replay, advance, steps, device)
    return seconds, how, rows.clone()


class OwnSlots:
    """The fused step's attention: each row's own keys/values in preallocated slots
    ``[L, P, Hkv, S, D]``; a step writes slot :attr:`slot` (device data, so a captured step
    reads it) and attends over the slots up to it."""

    def __init__(self, decoder, particles: int, slots: int, dtype, device: str):
        import torch

        shape = (decoder.num_layers, particles, decoder.num_kv_heads, slots, decoder.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.zeros(1, 1, 1, slots, dtype=dtype, device=device)
        self._slots = torch.arange(slots, device=device)
        self.scale = decoder.scale

    def prefill(self, layer: int, query, key, value):
        """Attention of a pass over nothing cached (causal), its keys/values kept from slot 0."""
        from torch.nn.functional import scaled_dot_product_attention

        self.keys[layer, :, :, : key.shape[2]] = key
        self.values[layer, :, :, : key.shape[2]] = value
        output = scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.scale, enable_gqa=True
        )
        return output.transpose(1, 2)

    def set_mask(self) -> None:
        """Unmask the slots up to :attr:`slot` (a device operation: part of a captured step)."""
        import torch

        unmasked = torch.where(self._slots <= self.slot, 0.0, float("-inf"))
        self.mask.view(-1).copy_(unmasked)

    def step(self, layer: int, query, key, value):
        """Attention of a one-token pass: its key/value written at :attr:`slot`."""
        from torch.nn.functional import scaled_dot_product_attention

        self.keys[layer].index_copy_(2, self.slot, key)
        self.values[layer].index_copy_(2, self.slot, value)
        output = scaled_dot_product_attention(
            query,
            self.keys[layer],
            self.values[layer],
            attn_mask=self.mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return output.transpose(1, 2)


def fused_step_seconds(model, args, particles: int, steps: int):
    """G-fused: as :func:`graph_step_seconds`, with the fused decoder; also the seconds of its
    first pass (the own past's prefill), which compiles every function a step runs.

    Raises:
        TimeoutError: the first pass ran past ``--compile-deadline`` seconds (checked on the
            main thread, with ``SIGALRM``).
    """
    import signal
    import threading

    import torch

    from genlm_backend.llm.hf.fused import FusedDecoder

    device = args.device
    decoder = FusedDecoder.of(model, compiled=not args.fused_eager)
    slots = OwnSlots(decoder, particles, OWN_SLOTS + steps + 1, model.dtype, device)
    ids = own_past(particles, model.config.get_text_config().vocab_size, device)
    step_ids = torch.zeros(particles, 1, dtype=torch.long, device=device)
    position = torch.full((particles, 1), OWN_SLOTS, device=device)

    overdue_message = f"its first pass (compiling) took over {args.compile_deadline} s"
    fired = []

    def overdue(signum, frame):
        fired.append(True)
        raise TimeoutError(overdue_message)

    alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
    with torch.inference_mode():
        began = time.perf_counter()
        if alarm:  # raised again each second past the deadline: a compiler may catch one
            previous = signal.signal(signal.SIGALRM, overdue)
            signal.setitimer(signal.ITIMER_REAL, args.compile_deadline, 1.0)
        try:
            past = torch.arange(OWN_SLOTS, device=device).expand(particles, -1)
            decoder(ids, past, slots.prefill)
            synchronize(device)
        except Exception as exc:
            if fired:  # a compiler wraps what it caught in its own error
                raise TimeoutError(overdue_message) from exc
            raise
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
        first_pass_s = time.perf_counter() - began

        def step():
            slots.set_mask()
            return torch.log_softmax(decoder(step_ids, position, slots.step), -1)

        def advance(index: int) -> None:  # device data: a replay reads it
            position.fill_(OWN_SLOTS + index)
            slots.slot.fill_(OWN_SLOTS + index)

        advance(0)
        how, replay = captured(step, device)
        seconds, rows = timed_steps(replay, advance, steps, device)
    return seconds, how, rows.clone(), first_pass_s


def runner_steps(model, args, particles, steps, prompt, own, warm_up, deterministic=False) -> dict:
    """ours-runner: the HF runner called directly, one batch per step."""
    from genlm_backend.llm.hf import AsyncTransformer

    vocab = [b"<%d>" % i for i in range(model.config.get_text_config().vocab_size)]
    llm = AsyncTransformer(model, None, byte_vocab=vocab, deterministic=deterministic)
    runner = llm.runner
    warm_prompt, warm_own = warm_up
    for step in range(2):
        runner.logprobs([tuple(warm_prompt + o[: step + 1]) for o in warm_own])
    runner.logprobs([tuple(prompt)])
    times = []
    for step in range(steps):
        contexts = [tuple(prompt + own[i][: step + 1]) for i in range(particles)]
        synchronize(args.device)
        start = time.perf_counter()
        runner.logprobs(contexts)
        synchronize(args.device)
        times.append(time.perf_counter() - start)
    stats = runner.graphs.stats
    llm.close()
    return {
        "step_s": statistics.median(times[1:] or times),
        "first_step_s": times[0],
        "captures": stats.num_captures,
        "replays": stats.num_replays,
    }


DRAW_SEED = 5
"""Seed of ours's draws (a generator on the rows' device)."""


def draw_tokens(block, generator) -> list[int]:
    """Each row's next token drawn from ``block`` ``[P, V]`` of log-probabilities, on its device:
    Gumbel-max (``argmax(row - log E)``, ``E ~ Exp(1)``: a draw from the row's distribution);
    one index per row comes back."""
    import torch

    noise = torch.empty_like(block).exponential_(generator=generator)
    return (block - noise.log_()).argmax(-1).tolist()


def ours_steps(
    model,
    args,
    particles,
    steps,
    prompt,
    own,
    warm_up,
    in_loop=False,
    deterministic=False,
    to_host=False,
) -> dict:
    """ours: awaited requests, each particle drawing its next token from its row
    (:func:`draw_tokens`); on CUDA also the GPU-busy fraction of a few steps.

    A particle's first token is its ``own[i][0]``; its later ones are drawn.
    ``in_loop``: batches run in the event loop's thread (``compute_in_loop=True``).
    ``deterministic``: ``deterministic=True``. ``to_host``: the step's rows also
    come to the host in one copy (page-locked on CUDA) before the draw.

    Returns:
        ``step_s``; ``tokens``: each particle's drawn tokens, step by step;
        ``copy_s``: one copy of a step's rows alone, the median of 5 (``to_host``);
        ``gpu_busy``.
    """
    import torch

    from genlm_backend.llm.hf import AsyncTransformer

    vocab_size = model.config.get_text_config().vocab_size
    vocab = [b"<%d>" % i for i in range(vocab_size)]
    llm = AsyncTransformer(
        model, None, byte_vocab=vocab, compute_in_loop=in_loop, deterministic=deterministic
    )
    warm_prompt, warm_own = warm_up
    generator = torch.Generator(device=args.device).manual_seed(DRAW_SEED)
    cuda = args.device.startswith("cuda")
    host = torch.empty(particles, vocab_size, pin_memory=cuda) if to_host else None

    async def step(contexts) -> list[int]:
        rows = await asyncio.gather(*map(llm.next_token_logprobs, contexts))
        block = torch.stack(rows)
        if host is not None:  # the copy is done when the draw's indices are back
            host[: len(rows)].copy_(block, non_blocking=True)
        return draw_tokens(block, generator)

    def copy_seconds() -> float:
        block = torch.zeros(particles, vocab_size, device=args.device)
        times = []
        for _ in range(5):
            synchronize(args.device)
            start = time.perf_counter()
            host.copy_(block, non_blocking=True)
            synchronize(args.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    async def main() -> dict:
        for index in range(2):
            await asyncio.gather(
                *(llm.next_token_logprobs(warm_prompt + o[: index + 1]) for o in warm_own)
            )
        await llm.next_token_logprobs(prompt)
        contexts = [prompt + [own[i][0]] for i in range(particles)]
        drawn: list[list[int]] = [[] for _ in range(particles)]
        synchronize(args.device)
        start = time.perf_counter()
        for _ in range(steps):
            tokens = await step(contexts)
            for token, mine in zip(tokens, drawn):
                mine.append(token)
            contexts = [context + [token] for context, token in zip(contexts, tokens)]
        synchronize(args.device)
        result = {"step_s": (time.perf_counter() - start) / steps, "tokens": drawn}
        result["copy_s"] = copy_seconds() if host is not None else None
        result["gpu_busy"] = await gpu_busy_fraction(step, contexts, args.device) if cuda else None
        return result

    result = asyncio.run(main())
    llm.close()
    return result


async def gpu_busy_fraction(step, contexts, device: str) -> float:
    """Kernel time over wall time of 4 more steps (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            tokens = await step(contexts)
            contexts = [context + [token] for context, token in zip(contexts, tokens)]
        synchronize(device)
        wall = time.perf_counter() - start
    kernels = sum(event.self_device_time_total for event in prof.key_averages()) / 1e6
    return kernels / wall


def measure(model, args, workload: str) -> dict:
    """Every figure of ``workload``, each printed as it is measured (most valuable first)."""
    particles, steps, prompt_tokens = parse_workload(workload)
    vocab_size = model.config.get_text_config().vocab_size
    prompt, own = token_draws(vocab_size, particles, steps, prompt_tokens, seed=1)
    warm_up = token_draws(vocab_size, particles, 2, 64, seed=2)
    warm_up = ([t + 1 for t in warm_up[0]], warm_up[1])  # another prompt: nothing reused
    parts = step_bytes(model, particles, steps, prompt_tokens)
    bandwidth = copy_bandwidth(args.device)
    limit = sum(parts.values()) / bandwidth
    result: dict = {"workload": workload, "prompt": prompt, "own": own, "bytes": parts}
    result.update(bandwidth=bandwidth, R=limit)
    gigabytes = {k: round(v / 1e9, 3) for k, v in parts.items()}
    print(
        f"\n{workload}: a step reads {gigabytes} GB; copy bandwidth {bandwidth / 1e9:.0f} GB/s",
        flush=True,
    )
    print("| per step | ms | vs R |\n|---|---|---|", flush=True)

    def row(name: str, seconds: float, note: str = "") -> None:
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / limit:.2f}x{note} |", flush=True)

    row("R (limit)", limit)
    attention_s = (
        prompt_attention_seconds(model, args, particles, steps, prompt_tokens, captured=True)
        / steps
    )
    graph_s, how, graph_rows = graph_step_seconds(model, args, particles, steps)
    result.update(G=graph_s + attention_s, G_parts=(graph_s, attention_s), G_how=how)
    parts_note = f"model {graph_s * 1e3:.2f} ms + prompt {attention_s * 1e3:.2f} ms"
    row("G (engine step)", result["G"], f" ({how}: {parts_note})")
    if result["G"] > 1.3 * limit:
        print("G is beyond 1.3R: check the measurement or the engine step before reading ratios")
    try:
        fused_s, how, fused_rows, first_pass_s = fused_step_seconds(model, args, particles, steps)
    except Exception as exc:  # noqa: BLE001 - reported; the other figures still run
        reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
        print(f"| G-fused (our fused step) | - | - (not measured: {reason}) |", flush=True)
    else:
        difference = (fused_rows - graph_rows).abs().max().item()
        result.update(G_fused=fused_s + attention_s, G_fused_how=how)
        result.update(G_fused_difference=difference, G_fused_first_pass_s=first_pass_s)
        layers = "eager layers" if args.fused_eager else "compiled layers"
        row(
            "G-fused (our fused step)",
            result["G_fused"],
            f" ({how}, {layers}; first pass {first_pass_s:.2f} s; rows within "
            f"{difference:.2e} of G's)",
        )
    result["ours"] = ours = ours_steps(model, args, particles, steps, prompt, own, warm_up)
    busy = "" if ours["gpu_busy"] is None else f" (GPU busy {100 * ours['gpu_busy']:.0f}%)"
    row("ours (each particle draws on the device)", ours["step_s"], busy)
    result["runner"] = runner = runner_steps(model, args, particles, steps, prompt, own, warm_up)
    first = f"first step {runner['first_step_s'] * 1e3:.1f} ms"
    graphs = f"{runner['captures']} captures, {runner['replays']} replays"
    row("ours-runner", runner["step_s"], f" ({first}; {graphs})")
    host = ours_steps(model, args, particles, steps, prompt, own, warm_up, to_host=True)
    result["ours_to_host"] = host
    kind = "page-locked" if args.device.startswith("cuda") else "plain"
    copy_note = f" ({kind} copy alone {host['copy_s'] * 1e3:.2f} ms)"
    row("ours, rows to the host (one copy a step)", host["step_s"], copy_note)
    in_loop = ours_steps(model, args, particles, steps, prompt, own, warm_up, in_loop=True)
    result["ours_in_loop"] = in_loop
    row("ours, batches in the loop's thread", in_loop["step_s"])
    if args.deterministic:
        exact_runner = runner_steps(model, args, particles, steps, prompt, own, warm_up, True)
        exact = ours_steps(model, args, particles, steps, prompt, own, warm_up, True, True)
        result.update(runner_exact=exact_runner, ours_exact=exact)
        for name, figures, default in (
            ("ours-runner", exact_runner, runner),
            ("ours, batches in the loop's thread", exact, in_loop),
        ):
            note = f" ({figures['step_s'] / default['step_s']:.2f}x the default)"
            row(f"{name}, deterministic=True", figures["step_s"], note)
        first = f"first step {exact_runner['first_step_s'] * 1e3:.1f} ms"
        graphs = f"{exact_runner['captures']} captures, {exact_runner['replays']} replays"
        print(f"ours-runner, deterministic=True: {first}; {graphs}", flush=True)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["64x32@4096"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--random-weights", type=Path, help="config folder: random weights")
    parser.add_argument(
        "--fused-eager", action="store_true", help="G-fused without torch.compile (eager layers)"
    )
    parser.add_argument(
        "--compile-deadline",
        type=int,
        default=240,
        help="seconds G-fused's first pass (its compilation) may take before G-fused is skipped",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="also ours-runner and ours (loop's thread) with deterministic=True",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    model = load_model(args)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"# bench_gpu_step: {args.device}, {args.dtype}, {device}", flush=True)
    for workload in args.workloads:
        measure(model, args, workload)


if __name__ == "__main__":
    main()
