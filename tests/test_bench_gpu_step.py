"""``benchmarks/bench_gpu_step.py`` at a tiny size on the CPU: every variant runs, G-fused's rows
are G's, and ours's particles draw their tokens from rows that are the plain forward's."""

from __future__ import annotations

import copy
import math
import re
import runpy
from pathlib import Path

import torch

from tests.conftest import build_tiny_llama
from tests.hf_reference import ATOL, reference

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_step.py"
WORKLOAD = "3x4@20"


def test_every_variant_runs_and_ours_draws_from_the_plain_forwards_rows(capsys):
    bench = runpy.run_path(str(SCRIPT))
    model = build_tiny_llama(512)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # peaked rows (logits' spread about 9): a draw follows its own row
        model.lm_head.weight.mul_(40)
    pristine = copy.deepcopy(model)
    args = bench["parse_args"](["--fused-eager", "--workloads", WORKLOAD])
    result = bench["measure"](model, args, WORKLOAD)
    printed = capsys.readouterr().out

    # Every figure measured, and printed as a row of the table.
    for name in (
        "R (limit)",
        "G (engine step)",
        "G-fused (our fused step)",
        "ours (each particle draws on the device)",
        "ours-runner",
        "ours, rows to the host (one copy a step)",
        "ours, batches in the loop's thread",
    ):
        assert re.search(rf"^\| {re.escape(name)} \| [\d.]+ \| [\d.]+x", printed, re.M), printed
    seconds = [result[key] for key in ("R", "G", "G_fused")]
    seconds += [result[key]["step_s"] for key in ("ours", "runner", "ours_to_host", "ours_in_loop")]
    assert all(math.isfinite(s) and s > 0 for s in seconds), seconds
    assert result["ours_to_host"]["copy_s"] > 0

    # G-fused computes G's rows: the same own past, the same steps.
    assert result["G_fused_difference"] <= ATOL

    # Each particle's tokens are Gumbel-max draws from the plain forward's rows: replay the
    # seeded noise over reference rows; a drawn token scores within the rows' tolerance of the best.
    prompt, own = result["prompt"], result["own"]
    particles, steps = len(own), len(own[0])
    for variant in ("ours", "ours_to_host", "ours_in_loop"):
        drawn = result[variant]["tokens"]
        assert [len(tokens) for tokens in drawn] == [steps] * particles
        generator = torch.Generator().manual_seed(bench["DRAW_SEED"])
        contexts = [prompt + [own[i][0]] for i in range(particles)]
        for step in range(steps):
            rows = torch.stack([reference(pristine, context) for context in contexts])
            noise = torch.empty_like(rows).exponential_(generator=generator)
            scores = rows - noise.log()
            tokens = [drawn[i][step] for i in range(particles)]
            chosen = scores[torch.arange(particles), tokens]
            assert (chosen >= scores.max(-1).values - 2 * ATOL).all(), (variant, step, tokens)
            contexts = [context + [token] for context, token in zip(contexts, tokens)]
