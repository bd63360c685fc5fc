"""Does a seeded genlm-control SMC run repeat? The same run in fresh processes, compared bit for bit.

Runs ``genlm_control_driver.py time`` (genlm-control's ``AWRS`` SMC under a
regex, 2 torch threads) once per process, ``--repeats`` processes per setup,
each with its own Python hash seed (Python's default), and reports for each
setup how many distinct outcomes its runs gave. An outcome is everything the
run sampled: each particle's tokens, each log weight and the log marginal
likelihood, compared as exact float bits. Setups:

* ``default``: ``AsyncTransformer(model, tokenizer)``;
* ``deterministic``: ``AsyncTransformer(..., deterministic=True)``;
* ``deterministic+beside``: the same, with a second workload on the model
  alongside (``--beside``, a different seed in each process), so that each
  run's batches and cache differ;
* ``default+beside``: the default mode with that second workload.

Prints a JSON summary; ``--json`` also writes it. Usage::

    python benchmarks/repeat_genlm_control.py --python /work/venvs/clients/bin/python \\
        --workload sql --particles 32 --max-tokens 24 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_genlm_control import default_model_dir, drive, driver_options

SETUPS = {
    "default": [],
    "deterministic": ["--deterministic"],
    "deterministic+beside": ["--deterministic", "--beside"],
    "default+beside": ["--beside"],
}


def outcome(run: dict) -> tuple:
    """What a run sampled, with floats as their exact bits."""
    return (
        tuple(tuple(ids) for ids in run["token_ids"]),
        tuple(float.hex(w) for w in run["log_weights"]),
        float.hex(run["log_ml"]),
    )


def one_run(args, setup: str, repeat: int) -> dict:
    flags = list(SETUPS[setup])
    if "--beside" in flags:
        flags.insert(flags.index("--beside") + 1, str(1 + repeat))
    options = driver_options(args.model_dir, args.workload, args.particles, args.max_tokens)
    return drive(args.python, ["time", *options, "--seeds", str(args.seed), *flags])["runs"][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--python", default=sys.executable, help="an interpreter with genlm-control"
    )
    parser.add_argument("--model-dir", help="default: the packaged SmolLM2-135M-Instruct")
    parser.add_argument("--workload", choices=["email", "sql"], default="sql")
    parser.add_argument("--particles", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=list(SETUPS))
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    if args.model_dir is None:
        args.model_dir = default_model_dir()
    summary: dict = {}
    by_mode: dict[str, set] = {}
    for setup in args.setups:
        runs = []
        for repeat in range(args.repeats):
            run = one_run(args, setup, repeat)
            runs.append(run)
            print(
                f"{setup} #{repeat}: log_ml {run['log_ml']!r}, {run['seconds']:.1f} s,"
                f" {run['other_rows']} rows beside",
                file=sys.stderr,
                flush=True,
            )
        outcomes = [outcome(run) for run in runs]
        by_mode.setdefault(setup.split("+")[0], set()).update(outcomes)
        summary[setup] = {
            "runs": len(runs),
            "distinct_outcomes": len(set(outcomes)),
            "distinct_samples": len({o[0] for o in outcomes}),
            "log_ml": [run["log_ml"] for run in runs],
            "seconds": [round(run["seconds"], 2) for run in runs],
            "rows_beside": [run["other_rows"] for run in runs],
        }
    # one mode's runs alone and beside the second workload, taken together
    summary["distinct_outcomes_by_mode"] = {mode: len(seen) for mode, seen in by_mode.items()}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
