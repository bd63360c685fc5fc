"""Serving one model to several processes: throughput, memory, and the round trip's own cost.

Workload: P particles per process sample S tokens each (``batch_sample``,
one ``next_token_logprobs`` per particle per step, seeded) from a shared
25-token prompt; SmolLM2-135M-Instruct fp32 on CPU. Setups, in one run:

* **in-process**: one process, one ``AsyncTransformer``, 4P particles;
* **served**: one ``genlm-backend serve`` process, 4 client processes of P
  particles each (``RemoteLM``), started together on a "go" line;
* **served, before** (with ``--baseline-tree PATH``, a checkout of an earlier
  version): the same, server and clients running that checkout's code (with
  ``--random-weights``, a checkout whose ``bench_serve.py`` has that option);
* **4 models**: 4 processes each loading its own ``AsyncTransformer``, P particles each;
* **in-process, steps in a worker** (only when named): the in-process setup with
  ``compute_in_loop=False``, and the same with the loop's thread on one torch thread
  (``-1``: the worker's OpenMP team is then the process's only one).

Time is from "go" to the last process done (model loading excluded, warm-up
excluded; the 4-models load time is reported apart); each setup's time is
also given over the in-process time of the same round (the median of those
ratios), and the CPU seconds all its processes used meanwhile (what a busy
machine's other tenants cannot take away). Model processes use
torch's default thread count (the machine's cores); served clients use
``--client-threads`` (1: they only sample and copy rows, and on a busy
machine a second OpenMP thread makes every small tensor operation wait). Memory is the peak RSS
(``VmHWM``) summed over the processes of a setup. Then, against the served
model, the round trip of one batch of 1, 16 and 64 rows the server already
holds in its output cache (so no model work: the transport and both
sides' bookkeeping), through the client's shared-memory slab and in the
answer's body (``shared_memory=False``), against the same batch from an
in-process output cache, in turns.

With ``--random-weights CONFIG_DIR`` the model processes (the server and the
in-process one) build that architecture with seeded random weights on
``--device`` in ``--dtype`` instead of loading SmolLM2, and the shared prompt
is ``--prompt-tokens`` seeded random token ids (the GPU leg: a 1B shape on
CUDA behind a long prompt). Each worker first samples a few warm-up steps from
another prompt, so captured steps and first-use costs stay out of the timing.

    python benchmarks/bench_serve.py [--particles 16] [--steps 16] [--runs 3]
        [--baseline-tree PATH] [--setups ...] [--plot benchmarks/serve.png]
    python benchmarks/bench_serve.py --random-weights benchmarks/gpu/configs/llama3_2_1b \
        --device cuda --dtype bfloat16 --prompt-tokens 1024 --steps 32 --setups in-process served
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a fox who learns to read. Once upon a time, in a quiet forest,"
NUM_PROCESSES = 4
sys.path.insert(0, str(REPO))  # this checkout's genlm_backend, also when another is installed


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int | str = "self") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


# ---------------------------------------------------------------- worker processes


def worker(args: argparse.Namespace) -> None:
    """One process: load (or connect), say "ready", wait for "go", sample, print a JSON result."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.url:
        from genlm_backend.serve import RemoteLM

        llm = RemoteLM(args.url)
    else:
        llm = local_lm(args)
    prompt = shared_prompt(llm, args)
    if args.in_worker:
        llm.engine.compute_in_loop = False
    if args.loop_threads:  # before this thread's first parallel torch work, and the first step
        torch.set_num_threads(args.loop_threads)
    llm.next_token_logprobs_sync(prompt)  # warm-up (the prompt's keys/values are then cached)
    if args.random_weights:  # first-use costs (captured steps) out of the timing
        warm_prompt = [(token + 1) % llm.vocab_size for token in prompt[:64]]
        asyncio.run(llm.batch_sample([warm_prompt] * args.particles, 4, [], seed=args.seed))
    load_s = time.perf_counter() - started
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.perf_counter()
    samples = asyncio.run(
        llm.batch_sample([prompt] * args.particles, args.steps, [], seed=args.seed)
    )
    run_s = time.perf_counter() - started
    assert all(len(sample) == args.steps for sample in samples)
    result = {"load_s": load_s, "run_s": run_s, "rss_mb": peak_rss_mb()}
    result["samples_digest"] = hash(tuple(map(tuple, samples)))
    print("result " + json.dumps(result), flush=True)
    llm.close()
    # Exit once every worker has its result (the driver then closes stdin): a process with
    # torch loaded takes a core for about half a second to exit, which would slow the
    # steps of the workers still running.
    sys.stdin.read()


def local_lm(args: argparse.Namespace):
    """The model of this process: SmolLM2 on the hf backend, or ``--random-weights`` on ``--device``."""
    if not args.random_weights:
        from genlm_backend import load_model_by_name

        return load_model_by_name(backend="hf")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_long_prompt import load_model

    from genlm_backend.llm.hf import AsyncTransformer

    model = load_model(args)  # seeded: every process builds the same weights
    vocab = [b"<%d>" % i for i in range(model.config.get_text_config().vocab_size)]
    return AsyncTransformer(model, None, byte_vocab=vocab)


def shared_prompt(llm, args: argparse.Namespace) -> list[int]:
    """The particles' shared prompt: 25 tokens of ``PROMPT``, or seeded random ids."""
    if not args.random_weights:
        return llm.tokenizer.encode(PROMPT)[:25]
    import random

    draw = random.Random(0)
    return [draw.randrange(min(llm.vocab_size, 32000)) for _ in range(args.prompt_tokens)]


def serve_model(args: argparse.Namespace) -> None:
    """``genlm-backend serve`` for a ``--random-weights`` model (the CLI loads named models only)."""
    from genlm_backend.serve.server import main_log, serve

    lm = local_lm(args)
    try:
        serve(lm, port=0, log=main_log("genlm-backend serve"))
    finally:
        lm.close()


def model_argv(args: argparse.Namespace) -> list[str]:
    """The options a model process needs to build the same model as this one."""
    if not args.random_weights:
        return []
    argv = ["--random-weights", str(args.random_weights.resolve()), "--device", args.device]
    return argv + ["--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens)]


def start(argv: list[str], tree: Path = REPO) -> subprocess.Popen:
    """``python ARGV`` running the code of checkout ``tree``."""
    return subprocess.Popen(
        [sys.executable, *argv],
        cwd=tree,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_environ(tree),
    )


def _environ(tree: Path) -> dict[str, str]:
    """This environment with ``tree`` first on ``PYTHONPATH`` (what was there stays after it)."""
    import os

    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def wait_line(process: subprocess.Popen, prefix: str) -> str:
    for line in process.stdout:  # type: ignore[union-attr]
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"process {process.args} ended before {prefix!r}")


def run_group(
    workers: list[list[str]],
    tree: Path = REPO,
    server_pid: int | None = None,
    when_ready: Callable[[], None] = lambda: None,
) -> tuple[float, float, list[dict]]:
    """Start workers, wait until all are ready, call ``when_ready``, say go.

    Returns wall seconds, CPU seconds of the workers and the server between
    "go" and each one's result, and the workers' results.
    """
    processes = [start(argv, tree) for argv in workers]
    for process in processes:
        wait_line(process, "ready")
    when_ready()
    pids = [process.pid for process in processes] + ([server_pid] if server_pid else [])
    cpu_before = sum(map(cpu_s, pids))
    started = time.perf_counter()
    for process in processes:
        process.stdin.write("go\n")  # type: ignore[union-attr]
        process.stdin.flush()  # type: ignore[union-attr]
    results = [json.loads(wait_line(process, "result ")) for process in processes]
    wall_s = time.perf_counter() - started
    cpu = sum(map(cpu_s, pids)) - cpu_before  # workers still alive: they wait on stdin to close
    for process in processes:
        process.stdin.close()  # type: ignore[union-attr]
        process.wait(timeout=60)
    return wall_s, cpu, results


def worker_argv(
    particles: int,
    steps: int,
    seed: int,
    url: str | None = None,
    threads: int | None = None,
    tree: Path = REPO,
    model: Sequence[str] = (),
) -> list[str]:
    script = str(tree / "benchmarks" / "bench_serve.py")
    argv = [script, "--role", "worker", "--particles", str(particles), "--steps", str(steps)]
    argv += ["--seed", str(seed)] + (["--url", url] if url else [])
    return argv + (["--threads", str(threads)] if threads else []) + list(model)


# ---------------------------------------------------------------- round trip


def round_trips(urls: list[str], args: argparse.Namespace) -> dict[int, tuple[float, ...]]:
    """rows -> ms per batch: served through shared memory, the same client's runner alone,
    served in answer bodies, in-process.

    One batch of rows held in an output cache: the server's for the served
    clients (theirs is off; each its own server, ``urls``), the model's own
    in-process. "Runner alone" validates the contexts and makes the
    shared-memory client's round trip itself, without its batcher (the
    difference is what the client's batching costs). All in this process,
    with ``--client-threads`` torch threads (no model work runs).
    """
    import torch

    from genlm_backend.serve import RemoteLM

    torch.set_num_threads(args.client_threads)
    shared = RemoteLM(urls[0], output_cache_bytes=0)
    bodies = RemoteLM(urls[1], output_cache_bytes=0, shared_memory=False)
    local = local_lm(args)
    prompt = shared_prompt(local, args)
    figures = {}
    for rows in (1, 16, 64):
        contexts = [prompt + [token] for token in range(rows)]
        for lm in (local, shared, bodies):
            lm.batch_next_token_logprobs_sync(contexts)  # now in the output caches
        calls = [
            functools.partial(shared.batch_next_token_logprobs, contexts),
            functools.partial(_runner_alone, shared, contexts),
            functools.partial(bodies.batch_next_token_logprobs, contexts),
            functools.partial(local.batch_next_token_logprobs, contexts),
        ]
        times = asyncio.run(interleaved(calls, args.repeats))
        figures[rows] = tuple(1e3 * statistics.median(t) for t in times)
    if shared.runner.slab_name is None:
        raise RuntimeError(f"no shared memory: {shared.runner.shared_memory_refusal}")
    for lm in (shared, bodies, local):
        lm.close()
    return figures


async def _runner_alone(lm, contexts):
    """``lm``'s rows of ``contexts`` from its runner: validated, then one round trip, no batcher."""
    return lm.runner.run(lm.requests(contexts, None, "token_ids_list"))


async def interleaved(calls, repeats: int) -> list[list[float]]:
    """Seconds per call of each of ``calls`` (coroutine functions), in turns on one event loop,
    each turn in a fresh order (seeded; warm-up excluded).

    A call finds the caches as the calls before it left them: in a fixed order,
    a served call of 64 rows right after the in-process and answer-body calls
    (12.6 MB of other rows each) took up to 1 ms longer than the same call
    right after one on its own rows. A shuffled order gives every call each
    predecessor alike.
    """
    order = random.Random(0)
    times: list[list[float]] = [[] for _ in calls]
    for repeat in range(3 + repeats):
        turn = list(zip(calls, times))
        order.shuffle(turn)
        for call, call_times in turn:
            started = time.perf_counter()
            await call()
            if repeat >= 3:
                call_times.append(time.perf_counter() - started)
    return times


# ---------------------------------------------------------------- driver

SETUPS = {
    "in-process": "in-process, 1 process",
    "in-process-worker": "in-process, steps in a worker thread",
    "in-process-worker-1": "in-process, steps in a worker, the loop's thread on 1 torch thread",
    "served": f"served, {NUM_PROCESSES} clients",
    "served-before": f"served, {NUM_PROCESSES} clients, before",
    "4-models": f"{NUM_PROCESSES} processes, a model each",
    "4-models-before": f"{NUM_PROCESSES} processes, a model each, before",
}


def start_server(tree: Path = REPO, model: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    if model:
        argv = [str(tree / "benchmarks" / "bench_serve.py"), "--role", "server", *model]
    else:
        argv = ["-m", "genlm_backend", "serve", "--backend", "hf", "--port", "0"]
    server = start(argv, tree)
    return server, wait_line(server, "genlm-backend serve: listening on ")


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


def server_counts(url: str) -> Counter:
    """The server's counts so far: batches, contexts computed, waits its step gather gave up."""
    import urllib3

    from genlm_backend.llm.remote import protocol

    stats = protocol.unpack(urllib3.request("GET", url + "/v1/stats").data)
    lm, server = stats["lm"], stats["server"]
    return Counter(
        batches=lm["num_batches"],
        contexts=lm["num_contexts_computed"],
        given_up=server.get("num_waits_given_up", 0),
    )


def describe_batches(counts: Counter) -> str:
    """ "count (mean size)", and the step gather's given-up waits if any."""
    text = f"{counts['batches']} ({counts['contexts'] / max(1, counts['batches']):.1f})"
    return text + (f", {counts['given_up']} given up" if counts["given_up"] else "")


def measure_setup(setup: str, args: argparse.Namespace) -> dict:
    """One run of ``setup`` in fresh processes: wall seconds, summed peak RSS, load seconds."""
    p, s = args.particles, args.steps
    extra_rss, batches = 0.0, None
    model = model_argv(args)
    if setup in ("served", "served-before"):
        tree = REPO if setup == "served" else args.baseline_tree
        server, url = start_server(tree, model)
        try:
            workers = [
                worker_argv(p, s, i, url, args.client_threads, tree, model)
                for i in range(NUM_PROCESSES)
            ]
            before: list[Counter] = []  # the timed run's batches: not loads and warm-ups
            wall, cpu, results = run_group(
                workers, tree, server.pid, lambda: before.append(server_counts(url))
            )
            extra_rss = peak_rss_mb(server.pid)
            batches = describe_batches(server_counts(url) - before[0])
        finally:
            stop_server(server)
    elif setup.startswith("in-process"):
        argv = worker_argv(NUM_PROCESSES * p, s, 0, model=model)
        if setup != "in-process":
            argv += ["--in-worker"] + (["--loop-threads", "1"] if setup.endswith("-1") else [])
        wall, cpu, results = run_group([argv])
    else:
        tree = REPO if setup == "4-models" else args.baseline_tree
        workers = [worker_argv(p, s, i, tree=tree, model=model) for i in range(NUM_PROCESSES)]
        wall, cpu, results = run_group(workers, tree)
    return {
        "server_batches": batches,
        "wall_s": wall,
        "cpu_s": cpu,
        "rss_mb": extra_rss + sum(r["rss_mb"] for r in results),
        "load_s": max(r["load_s"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("driver", "worker", "server"), default="driver")
    parser.add_argument("--particles", type=int, default=16, help="per client process")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of a worker")
    parser.add_argument(
        "--client-threads",
        type=int,
        default=1,
        help="torch threads of each served client (default 1: a client only samples)",
    )
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs of each setup")
    parser.add_argument("--repeats", type=int, default=20, help="round trips per row count")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="a checkout of an earlier version: adds its served setup (e.g. from `git archive`)",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=list(SETUPS),
        default=[setup for setup in SETUPS if not setup.startswith("in-process-")],
        help="which setups to run (the `-before` ones need --baseline-tree; the "
        "`in-process-worker` ones only when named)",
    )
    parser.add_argument(
        "--in-worker", action="store_true", help="a worker's steps in a worker thread"
    )
    parser.add_argument(
        "--loop-threads", type=int, default=None, help="with --in-worker: the loop's torch threads"
    )
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--random-weights", type=Path, default=None, help="config folder: random weights"
    )
    parser.add_argument("--device", default="cpu", help="of the model processes")
    parser.add_argument("--dtype", default="float32", help="with --random-weights")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="with --random-weights")
    args = parser.parse_args()
    args.model = None  # bench_long_prompt.load_model's argument
    if args.role != "driver":
        (worker if args.role == "worker" else serve_model)(args)
        return
    if args.baseline_tree is not None:  # its processes run with the checkout as their cwd
        args.baseline_tree = args.baseline_tree.resolve()
    if args.random_weights and args.baseline_tree:
        earlier = (args.baseline_tree / "benchmarks" / "bench_serve.py").read_text()
        if "--random-weights" not in earlier:
            parser.error("that --baseline-tree's bench_serve.py has no --random-weights")
    setups = [s for s in args.setups if not s.endswith("-before") or args.baseline_tree is not None]
    setups = setups if args.runs > 0 else []  # --runs 0: the round trips only
    runs: dict[str, list[dict]] = {setup: [] for setup in setups}
    for run in range(args.runs):
        for setup in setups:
            runs[setup].append(measure_setup(setup, args))
            print(f"run {run + 1}: {setup}: {runs[setup][-1]['wall_s']:.2f} s", file=sys.stderr)
    # A server per served client: two clients taking turns on one server would each
    # wait for the other (the server's step gather expects a client it answered back).
    servers = [start_server(model=model_argv(args)), start_server(model=model_argv(args))]
    try:
        trips = round_trips([url for _, url in servers], args)
    finally:
        for server, _ in servers:
            stop_server(server)
    report(runs, trips, args)


def report(runs: dict[str, list[dict]], trips: dict, args: argparse.Namespace) -> None:
    p, s = args.particles, args.steps
    total = NUM_PROCESSES * p * s
    if runs:
        rows = report_runs(runs, total, args)
    print(f"\nround trip of a batch held in an output cache, median of {args.repeats}, in turns")
    print(
        "| rows | served, shared memory (ms) | its runner alone (ms) | served, answer body (ms) "
        "| in-process (ms) | shared memory / in-process |"
    )
    print("|---|---|---|---|---|---|")
    for count, (shared, alone, body, local) in trips.items():
        print(
            f"| {count} | {shared:.2f} | {alone:.2f} | {body:.2f} | {local:.2f} "
            f"| {shared / local:.2f}x |"
        )
    if args.plot and runs:
        plot(rows, trips, total, args.plot)


def model_name(args: argparse.Namespace) -> str:
    if not args.random_weights:
        return "SmolLM2-135M fp32, CPU, a 25-token prompt"
    return (
        f"{args.random_weights.name} shape (random weights) {args.dtype}, {args.device}, "
        f"a {args.prompt_tokens}-token prompt"
    )


def report_runs(runs: dict[str, list[dict]], total: int, args: argparse.Namespace) -> list:
    """Print the setups' table; its rows for the plot.

    "vs in-process" is the median, over runs, of each run's time over the
    in-process time of the same round of the interleaving; CPU seconds are
    those of every process of the setup (server included) from "go" to the end.
    """
    p, s = args.particles, args.steps
    print(
        f"\n{NUM_PROCESSES} x {p} particles x {s} steps ({total} tokens sampled); "
        f"{model_name(args)}; median of {args.runs} interleaved runs"
    )
    print(
        "| setup | seconds (median) | tokens/s | vs in-process (paired runs) | all runs (s) "
        "| CPU s, all processes | peak RSS, all processes (MB) | load + warm-up (s) "
        "| server batches of the run (mean size) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = runs.get("in-process")
    rows = []
    for setup, results in runs.items():
        wall = statistics.median(r["wall_s"] for r in results)
        ratio = (
            statistics.median(r["wall_s"] / b["wall_s"] for r, b in zip(results, base))
            if base
            else float("nan")
        )
        cpu = statistics.median(r["cpu_s"] for r in results)
        rss = statistics.median(r["rss_mb"] for r in results)
        load_s = statistics.median(r["load_s"] for r in results)
        all_runs = ", ".join(f"{r['wall_s']:.2f}" for r in results)
        batches = sorted({r["server_batches"] or "-" for r in results})
        print(
            f"| {SETUPS[setup]} | {wall:.2f} | {total / wall:.0f} | {ratio:.2f}x | {all_runs} "
            f"| {cpu:.1f} | {rss:.0f} | {load_s:.1f} | {', '.join(batches)} |"
        )
        rows.append((SETUPS[setup], wall, rss, load_s))
    return rows


def plot(rows, trips, total: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.8))
    names = [name.replace(", ", "\n") for name, *_ in rows]
    colors = ["#777", "#2a7", "#9cd", "#c63"][: len(rows)]
    left.bar(names, [total / wall for _, wall, _, _ in rows], color=colors)
    left.set_ylabel("tokens sampled / s")
    middle.bar(names, [rss for _, _, rss, _ in rows], color=colors)
    middle.set_ylabel("peak RSS, all processes (MB)")
    counts = list(trips)
    right.plot(counts, [trips[c][0] for c in counts], "o-", label="served, shared memory")
    right.plot(counts, [trips[c][2] for c in counts], "o-", label="served, answer body")
    right.plot(counts, [trips[c][3] for c in counts], "o-", label="in-process")
    right.set_xlabel("rows per batch (held in an output cache)")
    right.set_ylabel("ms per batch")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
