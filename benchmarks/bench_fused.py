"""The fused decoder's forward alone against the transformers model's, at the default SMC shapes.

Workload: SmolLM2-135M-Instruct in float32 (the default model), two passes:

* ``decode``: 16 rows, one new token each, behind 25 to 56 cached tokens: 32
  one-token passes, as 16 particles drawing 32 tokens from a 25-token prompt do;
* ``prefill``: 16 rows of 32 new tokens, nothing cached.

Variants, each over the same attention (:class:`StaticAttend`: keys/values
written into a preallocated cache, torch's SDPA over the filled part):

* ``fused``: :class:`~genlm_backend.llm.hf.fused.FusedDecoder`, compiled;
* ``fused-eager``: the same, ``compiled=False``;
* ``fused-joined``: ``fused`` with the gate and up products as one ``[2 I, H]``
  product (``split_gate_up=False``, the GPU's default) instead of two;
* ``hf``: the transformers model's own forward, ``StaticAttend`` registered as its
  attention function (no cache object, no mask: the model's layers and nothing else).

Each variant is warmed up (compiled) first; a run times the 32 decode passes
and the prefill of each variant in turn, the order rotating between runs; the
figures are the medians of ``--runs`` paired runs (5), and the median of the
per-run ratios. Compile time is measured in two child processes sharing one
fresh ``TORCHINDUCTOR_CACHE_DIR``: cold (the first) and warm (the second).

Usage::

    python benchmarks/bench_fused.py               # timings, then cold and warm compile
    python benchmarks/bench_fused.py --runs 5 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROWS, PROMPT, STEPS, PREFILL = 16, 25, 32, 32


class StaticAttend:
    """The trivial attention all variants share: new keys/values written at slots
    ``[filled, filled + T)`` of a preallocated ``[L, B, Hkv, S, D]`` cache; SDPA over the
    filled part, causal when nothing was cached (prefill), unmasked for one new token."""

    def __init__(self, num_layers, batch, num_kv_heads, slots, head_dim, scale, dtype):
        shape = (num_layers, batch, num_kv_heads, slots, head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        self.scale, self.filled = scale, 0

    def __call__(self, layer: int, query, key, value) -> torch.Tensor:
        # query: [B, Hq, T, D]; key, value: [B, Hkv, T, D]
        num_new, start = query.shape[2], self.filled
        if num_new > 1 and start:
            raise ValueError("StaticAttend serves a prefill or one-token passes")
        self.keys[layer, :, :, start : start + num_new] = key
        self.values[layer, :, :, start : start + num_new] = value
        keys = self.keys[layer, :, :, : start + num_new]
        values = self.values[layer, :, :, : start + num_new]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, is_causal=num_new > 1, scale=self.scale, enable_gqa=True
        )
        return out.transpose(1, 2)  # [B, T, Hq, D]


def load_model():
    from transformers import AutoModelForCausalLM

    from genlm_backend.models import default_model_dir

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    return model.eval()


def forwards(model) -> dict:
    """``variant -> forward(input_ids, position_ids, attend) -> logits [B, V]``."""
    from genlm_backend.llm.hf.fused import FusedDecoder

    compiled = FusedDecoder.of(model)
    rotary = model.model.rotary_emb
    eager = FusedDecoder(compiled.weights, rotary, compiled=False)
    joined = FusedDecoder(compiled.weights, rotary, split_gate_up=False)
    return {
        "fused": compiled,
        "fused-eager": eager,
        "fused-joined": joined,
        "hf": hf_forward(model),
    }


def hf_forward(model):
    """The model's own forward with ``attend`` as its attention function and no mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    current: list = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        return current[0](module.layer_idx, query, key, value), None

    AttentionInterface.register("bench_fused", attention)
    AttentionMaskInterface.register("bench_fused", lambda *args, **kwargs: None)
    model.config._attn_implementation = "bench_fused"

    def forward(input_ids, position_ids, attend):
        current[:] = [attend]
        out = model(input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1)
        return out.logits[:, -1].float()

    return forward


def make_attend(model, slots: int) -> StaticAttend:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    num_layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    return StaticAttend(num_layers, ROWS, kv_heads, slots, head_dim, head_dim**-0.5, torch.float32)


@torch.inference_mode()
def time_decode(forward, model, prompt_ids) -> tuple[float, torch.Tensor]:
    """Seconds of 32 one-token passes of 16 rows behind 25 to 56 cached tokens (the prompt's
    pass is not timed); the last pass's logits."""
    attend = make_attend(model, PROMPT + STEPS)
    forward(prompt_ids, torch.arange(PROMPT).expand(ROWS, -1), attend)
    attend.filled = PROMPT
    tokens = prompt_ids[:, -1:]
    start = time.perf_counter()
    for step in range(STEPS):
        logits = forward(tokens, torch.full((ROWS, 1), PROMPT + step), attend)
        attend.filled += 1
        tokens = logits.argmax(-1, keepdim=True)
    return time.perf_counter() - start, logits


@torch.inference_mode()
def time_prefill(forward, model, prefill_ids) -> tuple[float, torch.Tensor]:
    attend = make_attend(model, PREFILL)
    start = time.perf_counter()
    logits = forward(prefill_ids, torch.arange(PREFILL).expand(ROWS, -1), attend)
    return time.perf_counter() - start, logits


def measure(runs: int) -> dict:
    model = load_model()
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt_ids = torch.randint(vocab, (ROWS, PROMPT), generator=generator)
    prefill_ids = torch.randint(vocab, (ROWS, PREFILL), generator=generator)
    variants = forwards(model)
    outputs = {}
    for name, forward in variants.items():  # warm-up: compiles, first-call allocations
        outputs[name] = (
            time_decode(forward, model, prompt_ids)[1],
            time_prefill(forward, model, prefill_ids)[1],
        )
    agreement = {
        name: max((out - ref).abs().max().item() for out, ref in zip(outputs[name], outputs["hf"]))
        for name in variants
    }
    seconds: dict = {(name, part): [] for name in variants for part in ("decode", "prefill")}
    for run in range(runs):
        shift = run % len(variants)
        order = list(variants)[shift:] + list(variants)[:shift]
        for name in order:
            seconds[name, "decode"].append(time_decode(variants[name], model, prompt_ids)[0])
            seconds[name, "prefill"].append(time_prefill(variants[name], model, prefill_ids)[0])
    result = {"max_abs_logit_difference_from_hf": agreement, "parts": {}}
    for part in ("decode", "prefill"):
        hf = seconds["hf", part]
        result["parts"][part] = {
            name: {
                "median_s": statistics.median(seconds[name, part]),
                "median_ratio_to_hf": statistics.median(
                    a / b for a, b in zip(seconds[name, part], hf)
                ),
            }
            for name in variants
        }
    return result


def compile_probe() -> dict:
    """Seconds of the compiled decoder's first prefill (compiling), first decode pass, and a
    second decode pass (compiled code only); the graphs dynamo compiled (3: no recompilation)."""
    from torch._dynamo.utils import counters

    from genlm_backend.llm.hf.fused import FusedDecoder

    model = load_model()
    decoder = FusedDecoder.of(model)
    ids = torch.zeros(ROWS, PREFILL, dtype=torch.int64)
    times = {}
    with torch.inference_mode():
        attend = make_attend(model, PREFILL + 2)
        for name, num_new in (("prefill", PREFILL), ("first_decode", 1), ("second_decode", 1)):
            start = time.perf_counter()
            positions = torch.arange(attend.filled, attend.filled + num_new).expand(ROWS, -1)
            decoder(ids[:, :num_new], positions, attend)
            attend.filled += num_new
            times[f"{name}_s"] = time.perf_counter() - start
    return times | {"graphs": counters["stats"]["unique_graphs"]}


def compile_times(threads: int) -> dict:
    with tempfile.TemporaryDirectory() as cache_dir:
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache_dir}
        command = [sys.executable, __file__, "--compile-probe", "--threads", str(threads)]
        times = {}
        for name in ("cold", "warm"):
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            probe = json.loads(done.stdout.strip().splitlines()[-1])
            times[name] = probe | {"process_s": time.perf_counter() - start}
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-compile-times", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.compile_probe:
        print(json.dumps(compile_probe()))
        return
    header = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    header |= {"threads": args.threads, "torch": torch.__version__, "runs": args.runs}
    print(json.dumps(header))
    result = measure(args.runs)
    print(json.dumps(result, indent=1))
    if not args.no_compile_times:
        print(json.dumps({"compile": compile_times(args.threads)}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
