"""The demo's character constraint: characters, not bytes, matched through token bytes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from genlm_backend.demo import CharacterConstraint, importance_sample
from genlm_backend.llm import MockAsyncLM
from genlm_backend.trie import AsyncTokenCharacterTrie

E_ACUTE = "é".encode()  # b"\xc3\xa9"
E_GRAVE = "è".encode()  # b"\xc3\xa8"
VOCAB = [
    b"a",
    E_ACUTE[:1],
    E_ACUTE[1:],
    E_ACUTE,
    E_ACUTE[1:] + b"a",
    b"b",
    E_GRAVE,
    b"a" + E_ACUTE[:1],
    b"",
]


def allowed_tokens(constraint: CharacterConstraint, pending: bytes) -> list[bytes]:
    mask = constraint.token_mask(pending)
    return [token for token, keep in zip(VOCAB, mask.tolist()) if keep]


def test_tokens_allowed_at_a_character_boundary():
    constraint = CharacterConstraint("aé", VOCAB)
    assert allowed_tokens(constraint, b"") == [b"a", E_ACUTE[:1], E_ACUTE, b"a" + E_ACUTE[:1]]


def test_tokens_allowed_inside_a_character():
    constraint = CharacterConstraint("aé", VOCAB)
    assert allowed_tokens(constraint, E_ACUTE[:1]) == [E_ACUTE[1:], E_ACUTE[1:] + b"a"]


def test_step_counts_completed_characters_and_keeps_the_pending_bytes():
    constraint = CharacterConstraint("aé", VOCAB)
    assert constraint.step(b"", b"a" + E_ACUTE + b"a" + E_ACUTE[:1]) == (E_ACUTE[:1], 3)
    assert constraint.step(E_ACUTE[:1], E_ACUTE[1:]) == (b"", 1)
    assert constraint.step(b"", E_GRAVE) is None
    assert constraint.step(b"", b"b") is None


def test_an_empty_allowed_set_is_an_error():
    with pytest.raises(ValueError, match="allowed character set is empty"):
        CharacterConstraint("", VOCAB)


@pytest.fixture
def mock_llm(gpt2_tokenizer):
    llm = MockAsyncLM(gpt2_tokenizer)
    yield llm
    llm.close()


def test_particles_write_the_requested_number_of_characters(mock_llm, capsys):
    trie = AsyncTokenCharacterTrie.from_vocab(mock_llm.byte_vocab)
    prompt = mock_llm.tokenizer.encode("Le café")

    async def sample():
        try:
            return await importance_sample(
                mock_llm,
                trie,
                prompt,
                num_particles=3,
                num_chars=5,
                allowed="éa",
                seed=0,
                progress=True,
            )
        finally:
            await trie.aclose()

    result = asyncio.run(sample())
    assert [len(p.text) for p in result.particles] == [5, 5, 5]
    assert all(set(p.text) <= {"é", "a"} for p in result.particles)
    # The complete tokens' bytes are a prefix of the text's bytes.
    for particle in result.particles:
        written = b"".join(mock_llm.byte_vocab[t] for t in particle.token_ids)
        assert particle.text.encode().startswith(written)
    assert torch.isfinite(torch.tensor([p.log_weight for p in result.particles])).all()
    assert (
        "characters written (all particles)" in capsys.readouterr().err
    )  # the bar says what it counts
