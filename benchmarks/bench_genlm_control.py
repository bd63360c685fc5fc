"""genlm-control regex-constrained SMC on upstream genlm-backend 0.3.1 vs genlm_backend.

Workload (``genlm_control_driver.py``): genlm-control 0.4.1's ``AWRS`` sampler
over a ``PromptedLLM`` (SmolLM2-135M-Instruct fp32, default ``AsyncTransformer``
settings, 2 torch threads) and a ``BoolFSA`` regex, ``smc(n_particles=P,
ess_threshold=0.5, max_tokens=T)``. ``--workload`` picks the prompt and regex
(``genlm_control_workloads.py``): ``email`` (default), a short chat prompt asking
for an email address under an email regex; ``sql``, a text-to-SQL few-shot chat
prompt of about 1,500 tokens under a regex for a small SQL subset. Each timed
run starts from cleared model caches and caches the prompt's keys/values
(``cache_kv``) inside the timed span; a 2-particle warm-up run per process is not
timed. The same seeds drive both backends.

Each backend runs in its own virtualenv (one process per repeat, the two
backends interleaved, order alternating). Afterwards both score the same
contexts (every prefix of the particles upstream sampled) and the largest
absolute difference of their next-token log-probabilities is reported.

``--critic`` adds an LLM critic (``genlm_control_driver.py``): the model is then
also a potential, scoring every prefix of each particle at every step.

Usage (``genlm_control_env.sh`` creates both virtualenvs)::

    bash benchmarks/genlm_control_env.sh
    python benchmarks/bench_genlm_control.py \\
        --ours-python /work/venvs/smc/bin/python \\
        --upstream-python /work/venvs/upstream-smc/bin/python --repeats 3
    python benchmarks/bench_genlm_control.py --workload sql --particles 16 \\
        --max-tokens 32 ... --json benchmarks/results/genlm_control_sql.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "genlm_control_driver.py"
MAX_SCORED_CONTEXTS = 64


def default_model_dir() -> str:
    from genlm_backend.models import default_model_dir as model_dir

    return str(model_dir())


def driver_options(
    model_dir: str, workload: str, particles: int, max_tokens: int, critic: bool = False
) -> list[str]:
    """The driver's options of one workload shape (after its mode)."""
    return [
        "--model-dir",
        model_dir,
        "--workload",
        workload,
        "--particles",
        str(particles),
        "--max-tokens",
        str(max_tokens),
        *(["--critic"] if critic else []),
    ]


def drive(python: str, args: list[str]) -> dict:
    """Run the driver under ``python``; returns its JSON line.

    Raises:
        RuntimeError: the driver exited non-zero (its stderr tail is included).
    """
    done = subprocess.run([python, str(DRIVER), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{python} {DRIVER.name} {' '.join(args)} failed:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_repeats(
    pythons: dict[str, str], common: list[str], seeds: list[int], repeats: int
) -> dict:
    """One process per backend per repeat, interleaved with alternating order."""
    results = {name: [] for name in pythons}
    names = list(pythons)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            output = drive(pythons[name], ["time", *common, "--seeds", *map(str, seeds)])
            results[name].append(output)
            seconds = ", ".join(f"{run['seconds']:.2f}" for run in output["runs"])
            print(f"repeat {repeat}: {name} ({output['backend']}): {seconds} s", file=sys.stderr)
    return results


def contexts_to_score(upstream_runs: list[dict]) -> list[list[int]]:
    """Prompt plus every prefix of every distinct sampled particle (at most MAX_SCORED_CONTEXTS)."""
    prompt = upstream_runs[0]["prompt_ids"]
    contexts, seen = [], set()
    for output in upstream_runs:
        for run in output["runs"]:
            for particle in run["token_ids"]:
                for length in range(len(particle) + 1):
                    key = tuple(particle[:length])
                    if key not in seen:
                        seen.add(key)
                        contexts.append(prompt + list(key))
    return contexts[:MAX_SCORED_CONTEXTS]


def max_logprob_difference(pythons: dict[str, str], common: list[str], contexts) -> float:
    """Largest |ours - upstream| next-token log-probability over ``contexts``."""
    with tempfile.TemporaryDirectory() as folder:
        contexts_file = Path(folder) / "contexts.json"
        contexts_file.write_text(json.dumps(contexts))
        scores = {}
        for name, python in pythons.items():
            out = Path(folder) / f"{name}.npy"
            drive(
                python,
                ["score", *common, "--contexts", str(contexts_file), "--scores-out", str(out)],
            )
            scores[name] = np.load(out)
    return float(np.abs(scores["ours"] - scores["upstream"]).max())


def summarize(results: dict, seeds: list[int], workload: str) -> dict:
    summary = {"workload": workload, "prompt_tokens": len(results["ours"][0]["prompt_ids"])}
    for name, outputs in results.items():
        seconds = [run["seconds"] for output in outputs for run in output["runs"]]
        prefill = [run.get("prefill_seconds", 0.0) for output in outputs for run in output["runs"]]
        summary[name] = {
            "seconds": seconds,
            "median_s": statistics.median(seconds),
            "prefill_seconds": prefill,  # cache_kv(prompt), inside the timed span
        }
    same_samples = [
        ours["texts"] == upstream["texts"]
        for out_ours, out_up in zip(results["ours"], results["upstream"])
        for ours, upstream in zip(out_ours["runs"], out_up["runs"])
    ]
    summary["ratio_upstream_over_ours"] = (
        summary["upstream"]["median_s"] / summary["ours"]["median_s"]
    )
    paired = [
        up / ours for up, ours in zip(summary["upstream"]["seconds"], summary["ours"]["seconds"])
    ]
    summary["paired_ratios"] = paired  # same repeat, same seed: less exposed to load swings
    summary["median_paired_ratio"] = statistics.median(paired)
    summary["identical_particles_per_run"] = same_samples
    summary["seeds"] = seeds
    summary["example_particles"] = results["ours"][0]["runs"][0]["texts"]
    return summary


def markdown(summary: dict, particles: int, max_tokens: int) -> str:
    rows = [
        "| particles x max tokens | backend | seconds (median) | all runs (s) | upstream / ours |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("upstream", "genlm-backend 0.3.1"), ("ours", "genlm_backend")):
        runs = ", ".join(f"{s:.2f}" for s in summary[name]["seconds"])
        ratio = f"{summary['ratio_upstream_over_ours']:.1f}x" if name == "ours" else "1.00x"
        rows.append(
            f"| {particles}x{max_tokens} | {label} | {summary[name]['median_s']:.2f} | {runs} | {ratio} |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ours-python", required=True, help="python of a venv with genlm_backend and genlm-control"
    )
    parser.add_argument(
        "--upstream-python",
        required=True,
        help="python of a venv with genlm-backend 0.3.1 and genlm-control",
    )
    parser.add_argument(
        "--model-dir",
        help="SmolLM2-135M-Instruct folder (default: genlm_backend's converted default model)",
    )
    parser.add_argument(
        "--workload", choices=["email", "sql"], default="email", help="prompt and regex"
    )
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--critic", action="store_true", help="an LLM critic scores every particle at every step"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="timed SMC runs per process, one per seed"
    )
    parser.add_argument("--repeats", type=int, default=3, help="processes per backend, interleaved")
    parser.add_argument("--json", type=Path, help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or default_model_dir()
    pythons = {"upstream": args.upstream_python, "ours": args.ours_python}
    common = driver_options(model_dir, args.workload, args.particles, args.max_tokens, args.critic)
    results = timed_repeats(pythons, common, args.seeds, args.repeats)
    summary = summarize(results, args.seeds, args.workload)
    print(f"{args.workload}: prompt of {summary['prompt_tokens']} tokens", file=sys.stderr)
    if args.json:  # the timings survive a failure while scoring
        args.json.write_text(json.dumps(summary, indent=2))
    summary["max_abs_logprob_diff"] = max_logprob_difference(
        pythons, common, contexts_to_score(results["upstream"])
    )
    print(markdown(summary, args.particles, args.max_tokens))
    print(
        f"\nmax |logprob ours - upstream| over the scored contexts: {summary['max_abs_logprob_diff']:.1e}"
    )
    paired = ", ".join(f"{ratio:.1f}x" for ratio in summary["paired_ratios"])
    print(f"upstream / ours per repeat: {paired} (median {summary['median_paired_ratio']:.1f}x)")
    print(f"identical particles per run: {summary['identical_particles_per_run']}")
    for name in ("upstream", "ours"):
        prefill = ", ".join(f"{s:.2f}" for s in summary[name]["prefill_seconds"])
        print(f"{name}: cache_kv(prompt) inside the timed span: {prefill} s")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
