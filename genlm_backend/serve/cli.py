"""``genlm-backend serve``: its arguments and what it runs (registered by :mod:`genlm_backend.cli`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from genlm_backend.llm.remote.protocol import DEFAULT_PORT, TOKEN_ENV, ServeLimits

DESCRIPTION = f"""\
Hold one model in this process and serve next-token log-probabilities to
every client process; requests of all clients are batched together.

Connect from Python with
    load_model_by_name("genlm://HOST:PORT")   (or genlm_backend.serve.RemoteLM)

Binds to 127.0.0.1 by default. Another address needs --allow-remote and a
shared token, taken from ${TOKEN_ENV} or --token-file (clients send it from
${TOKEN_ENV} or RemoteLM(token=...)). Prints "listening on http://HOST:PORT"
once it accepts connections. SIGINT/SIGTERM fail requests in flight with a
"server is shutting down" error and stop the server (exit status 0)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` options; ``--backend`` and ``--model`` are added by the caller."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (a shared token is then required)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"file holding the shared token (default: ${TOKEN_ENV} if set, else no token)",
    )
    parser.add_argument(
        "--llm-opts",
        type=_json_object,
        default={},
        metavar="JSON",
        help="options for the backend, as load_model_by_name's llm_opts, e.g. "
        """'{"kv_cache_bytes": 8589934592, "output_cache_bytes": 2147483648}' """,
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="reproducible rows: each row has the bits of its context computed alone, "
        "whatever other clients' traffic shares its batch (llm_opts' deterministic)",
    )
    defaults = ServeLimits()
    parser.add_argument(
        "--max-rows",
        type=int,
        default=defaults.max_rows,
        help="most contexts per request (default: %(default)s)",
    )
    parser.add_argument(
        "--max-context-length",
        type=int,
        default=None,
        help="most tokens per context (default: the model's own limit)",
    )
    parser.add_argument(
        "--adapter-dir",
        action="append",
        default=[],
        metavar="FOLDER",
        help="a folder clients may load LoRA adapters from (repeatable; default: none, "
        "so clients use only the adapters the server has)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        help="most bytes per request body (default: %(default)s)",
    )


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve it until SIGINT/SIGTERM, close it."""
    from genlm_backend.llm import load_model_by_name
    from genlm_backend.llm.loader import default_backend
    from genlm_backend.serve.server import check_binding, main_log, serve

    token = read_token(args.token_file)
    limits = ServeLimits(args.max_rows, args.max_context_length, args.max_body_bytes)
    check_binding(args.host, args.allow_remote, token)  # before loading a model for nothing
    log = main_log("genlm-backend serve")
    backend = args.backend or default_backend()
    log(f"loading {args.model or 'the default model'} on the {backend} backend")
    llm_opts = {**args.llm_opts, **({"deterministic": True} if args.deterministic else {})}
    lm = load_model_by_name(args.model, backend=backend, llm_opts=llm_opts)
    try:
        app = serve(
            lm,
            host=args.host,
            port=args.port,
            limits=limits,
            token=token,
            allow_remote=args.allow_remote,
            model_name=args.model or "",
            backend=backend,
            adapter_dirs=args.adapter_dir,
            log=log,
        )
    finally:
        lm.close()
    stats = app.stats
    log(
        f"stopped after {stats.num_requests} requests ({stats.num_rows_served} rows served, "
        f"{stats.num_failed_by_shutdown} failed by the shutdown)"
    )
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def read_token(token_file: Path | None) -> str | None:
    """The shared token from ``token_file`` (stripped), else ``$GENLM_SERVE_TOKEN``, else ``None``.

    Raises:
        ValueError: the file is empty.
        FileNotFoundError: no such file.
    """
    if token_file is None:
        return os.environ.get(TOKEN_ENV) or None
    token = token_file.read_text().strip()
    if not token:
        raise ValueError(f"--token-file {token_file} is empty")
    return token
