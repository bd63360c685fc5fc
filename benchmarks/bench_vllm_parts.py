"""The loops and the clock of ``bench_vllm_long_prompt.py``: particles drawing from their rows,
vLLM's own engine loop, time per step inside vLLM's engine and above it, and the table."""

from __future__ import annotations

import asyncio
import collections
import itertools
import statistics
import time

_request_numbers = itertools.count()

BREAKDOWN = ("wall_ms", "engine_step_ms", "model_ms")


class Clock:
    """Seconds spent in wrapped methods, by name (calls from any thread)."""

    def __init__(self):
        self.seconds: collections.Counter[str] = collections.Counter()

    @classmethod
    def around_engine(cls, engine, runner=None) -> Clock:
        """Times ``engine.step`` (vLLM's engine step), the model inside it (the in-process
        executor's ``execute_model`` and ``sample_tokens``) and ``runner.run`` if given."""
        clock = cls()
        clock.wrap(engine, "step", "engine_step")
        core = getattr(engine.engine_core, "engine_core", None)
        executor = getattr(core, "model_executor", None)
        if executor is not None:
            clock.wrap(executor, "execute_model", "model")
            clock.wrap(executor, "sample_tokens", "model")
        if runner is not None:
            clock.wrap(runner, "run", "runner_run")
        return clock

    def wrap(self, owner, name: str, key: str) -> None:
        method, seconds = getattr(owner, name), self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[key] += time.perf_counter() - start

        setattr(owner, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def per_step(self, before: dict[str, float], wall_s: float, steps: int) -> dict:
        """Milliseconds a step since ``before``: all, vLLM's engine step, the model in it,
        and the host work above the engine step (split at the runner when one is timed)."""
        spent = {key: self.seconds[key] - before.get(key, 0.0) for key in self.seconds}

        def ms(seconds: float) -> float:
            return round(1000 * seconds / steps, 1)

        result = {"wall_ms": ms(wall_s), "engine_step_ms": ms(spent["engine_step"])}
        result["model_ms"] = ms(spent.get("model", float("nan")))
        if spent.get("runner_run"):
            result["runner_beyond_engine_ms"] = ms(spent["runner_run"] - spent["engine_step"])
            result["above_runner_ms"] = ms(wall_s - spent["runner_run"])
        else:
            result["above_engine_ms"] = ms(wall_s - spent["engine_step"])
        return result


async def ours_steps(llm, prompt, firsts, steps: int, draw: str) -> tuple[float, list[list[int]]]:
    """``steps`` steps of particles ``prompt + [first]``, each awaiting its row and drawing its
    next token from it (``argmax``: torch's on the row, or numpy's); seconds, and the tokens."""
    contexts = [[*prompt, first] for first in firsts]
    tokens: list[list[int]] = [[] for _ in firsts]

    async def particle(index: int) -> None:
        row = await llm.next_token_logprobs(contexts[index])
        token = int(row.argmax()) if draw == "torch" else int(row.numpy().argmax())
        tokens[index].append(token)
        contexts[index].append(token)

    start = time.perf_counter()
    for _ in range(steps):
        await asyncio.gather(*(particle(index) for index in range(len(firsts))))
    return time.perf_counter() - start, tokens


def vllm_engine_steps(engine, prompt, firsts, steps: int) -> tuple[float, list[list[int]]]:
    """vLLM's own greedy decode of ``prompt + [first]`` for each first token, ``steps`` tokens
    each, no log-probabilities: ``add_request`` then ``step`` until done (``LLM.generate``'s
    loop); seconds, and the tokens."""
    from vllm import SamplingParams
    from vllm.inputs.engine import tokens_input

    params = SamplingParams(max_tokens=steps, temperature=0.0, detokenize=False, ignore_eos=True)
    request_ids = [f"bench-loop-{next(_request_numbers)}" for _ in firsts]
    start = time.perf_counter()
    for request_id, first in zip(request_ids, firsts):
        engine.add_request(request_id, tokens_input([*prompt, first]), params)
    tokens = {}
    while len(tokens) < len(request_ids):
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
    return time.perf_counter() - start, [tokens[request_id] for request_id in request_ids]


def print_rounds(workload: str, rounds: list[dict]) -> None:
    """A markdown table of one workload: each variant's steps and ratio to ``vllm`` per round,
    the median of those ratios, and the median breakdown of a step."""
    print(
        "\n| workload | variant | prefill (s) | steps (s), per round | x vLLM loop, per round "
        "| median ratio | ms a step | vLLM engine step | of which model | host above the engine "
        "| same tokens as vLLM | rows/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    variants = list(dict.fromkeys(variant for pair in rounds for variant in pair))
    for variant in variants:
        runs = [pair.get(variant, {"error": "no run"}) for pair in rounds]
        errors = [run["error"] for run in runs if "error" in run]
        if errors:
            print(f"| {workload} | {variant} | error: {errors[0].strip().splitlines()[-1][:100]} |")
            continue
        references = [pair.get("vllm", {}) for pair in rounds]
        ratios = [
            run["steps_s"] / ref["steps_s"]
            for run, ref in zip(runs, references)
            if "steps_s" in ref
        ]
        same = [
            sum(a == b for a, b in zip(run["tokens"], ref["tokens"]))
            for run, ref in zip(runs, references)
            if "tokens" in ref
        ]
        median = {
            key: round(statistics.median(run[key] for run in runs), 2)
            for key in runs[0]
            if _is_number([run.get(key) for run in runs])
        }
        host = (
            f"{median['above_engine_ms']}"
            if "above_engine_ms" in median
            else f"{median['runner_beyond_engine_ms']} + {median['above_runner_ms']}"
        )
        prefill = f"{median['prefill_s']:.2f}" if "prefill_s" in median else ""
        steps_s = ", ".join(f"{run['steps_s']:.2f}" for run in runs)
        per_round = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        print(
            f"| {workload} | {variant} | {prefill} | {steps_s} "
            f"| {per_round} | **{statistics.median(ratios):.2f}x** "
            f"| {median['wall_ms']} | {median['engine_step_ms']} | {median['model_ms']} | {host} "
            f"| {min(same) if same else ''}/{len(runs[0]['tokens'])} "
            f"| {median.get('rows_per_step', '')} |",
            flush=True,
        )


def _is_number(values) -> bool:
    return all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values)
