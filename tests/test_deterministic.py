"""``deterministic=True``: a row has the bits of its context computed alone from an empty cache.

Reference: the row of the same context computed by a fresh deterministic
runner over an empty tree, alone in its batch. Every comparison is
``torch.equal``: bitwise, no tolerance. The rows computed alone are in turn
compared with transformers' plain forward (``tests/hf_reference.py``: 1e-4 in
float32; in bfloat16 every such row, four rounding steps at its largest
logit), so an error the deterministic order makes alike alone and in a batch
fails too. Hypothesis generates batches and cache histories (shared prompts read as levels, particles stepping in
place, resampling, nested contexts, scoring, eviction under tiny budgets,
LoRA adapters mixed in one batch);
CI runs few examples, ``GENLM_EXACT_EXAMPLES=200`` more.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from genlm_backend import batching as batching_module
from genlm_backend.batching import BatchingConfig
from genlm_backend.cache.kv_tree import KVPrefixTree
from genlm_backend.llm import AsyncTransformer, MockAsyncLM
from genlm_backend.llm.hf import exact
from genlm_backend.llm.hf.exact import products as exact_products
from genlm_backend.llm.hf.exact import spans as exact_spans
from genlm_backend.llm.hf.runner import HFRunner
from tests import conftest
from tests.conftest import build_tiny_llama
from tests.graph_emulation import emulated_graphs
from tests.hf_reference import ATOL, bfloat16_tolerance, plain_logits, reference
from tests.triton_emulation import interpreted

EXAMPLES = int(os.environ.get("GENLM_EXACT_EXAMPLES", "5"))
NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
VOCAB = 2000  # token ids drawn below this (the tiny model's vocabulary is the tokenizer's)


class Alone:
    """Each context's row computed alone from an empty cache, memoized.

    A bfloat16 model's rows are also held to transformers' plain forward
    (:meth:`check_plain_forward`): every bitwise check against them is then
    a check against the plain forward too, so an error the deterministic order
    makes alike in every batch (which no bitwise check sees) fails.
    """

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}
        self._unchecked: set[tuple[int, ...]] = set()

    def __call__(self, context) -> torch.Tensor:
        context = tuple(context)
        if context not in self._rows:
            runner = HFRunner(
                self.model, KVPrefixTree(1 << 30), self.vocab_size, deterministic=True
            )
            self._rows[context] = runner.logprobs([context])[0]
            self._unchecked.add(context)
        return self._rows[context]

    def check_plain_forward(self) -> None:
        """The rows computed since the last call against the plain forward, within
        ``bfloat16_tolerance`` (one forward per context that is no other's prefix: its logits at
        each position are its prefixes' rows). Nothing to do for a float32 model (its rows are
        checked against the plain forward in ``test_exact_rows_agree_with_a_plain_forward``
        and ``test_products_in_pieces_give_the_rows_computed_alone``).

        A row that fails stays unchecked, so Hypothesis's replay of the example checks it again
        (and fails again) although the row is memoized.

        Raises:
            AssertionError: a row further than that from the plain forward.
        """
        unchecked = self._unchecked
        if next(self.model.parameters()).dtype != torch.bfloat16:
            unchecked.clear()
            return
        for context in sorted(unchecked, key=len, reverse=True):
            if context not in unchecked:
                continue  # a prefix of a context checked already
            logits = plain_logits(self.model, context)
            for length in range(len(context), 0, -1):
                prefix = context[:length]
                if prefix in unchecked:
                    expected = torch.log_softmax(logits[length - 1], dim=-1)[: self.vocab_size]
                    atol = bfloat16_tolerance(logits[length - 1])
                    torch.testing.assert_close(
                        self._rows[prefix], expected.to(self._rows[prefix].device), atol=atol,
                        rtol=0, msg=lambda m, n=length: f"context of {n} tokens: {m}",
                    )  # fmt: skip
                    unchecked.discard(prefix)


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer))
    return model, smollm2_tokenizer, Alone(model, len(smollm2_tokenizer))


@pytest.fixture(scope="module")
def tiny_bf16(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer)).to(torch.bfloat16)
    return model, smollm2_tokenizer, Alone(model, len(smollm2_tokenizer))


def test_exact_rows_agree_with_a_plain_forward(tiny):
    """Exact rows are the model's rows: within float32 rounding of transformers' own uncached forward."""
    model, _, alone = tiny
    rng = random.Random(6)
    for length in (1, 63, 64, 65, 200):
        context = [rng.randrange(VOCAB) for _ in range(length)]
        expected = reference(model, context)[: alone.vocab_size]
        torch.testing.assert_close(alone(context), expected, atol=1e-4, rtol=0)


def test_runners_of_one_model_share_its_padding_hooks(tiny):
    model, _, alone = tiny
    counts = []
    for _ in range(3):
        HFRunner(model, KVPrefixTree(1 << 20), alone.vocab_size, deterministic=True)
        counts.append(len(model.lm_head._forward_pre_hooks))
    assert counts[0] == counts[1] == counts[2]


def exact_llm(model, tokenizer, **opts) -> AsyncTransformer:
    opts.setdefault("output_cache_bytes", 0)  # every row computed, none served from the row cache
    return AsyncTransformer(model, tokenizer, deterministic=True, **opts)


def assert_rows_exact(rows, contexts, alone) -> None:
    for row, context in zip(rows, contexts):
        expected = alone(context)
        assert torch.equal(row, expected), (
            f"context of {len(context)} tokens: max difference {(row - expected).abs().max():.3g}"
        )


class PassCounter:
    """Counts the passes that read levels, the in-place steps, and the passes run (spying on ExactLayout.of)."""

    def __init__(self, monkeypatch):
        self.with_levels = self.in_place = self.passes = self.own_only = self.read_by_some = 0
        real = exact.ExactLayout.of.__func__

        def of(cls, plan, levels, num_groups, device):
            self.passes += 1
            self.with_levels += bool(levels)
            self.read_by_some += any(level.rows is not None for level in levels)
            self.in_place += plan.extends is not None
            layout = real(cls, plan, levels, num_groups, device)
            self.own_only += layout.own_only or any(part.own_only for *_, part in layout.chunks)
            return layout

        monkeypatch.setattr(exact.ExactLayout, "of", classmethod(of))


def test_smc_rows_are_the_rows_computed_alone(tiny, monkeypatch):
    """Particles behind a shared prompt: prompt read as a level, steps in place, resampling, nesting."""
    model, tokenizer, alone = tiny
    passes = PassCounter(monkeypatch)
    llm = exact_llm(model, tokenizer)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(300)]
    particles = [[*prompt, rng.randrange(VOCAB)] for _ in range(12)]

    async def run():
        for step in range(4):
            rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
            assert_rows_exact(rows, particles, alone)
            if step == 2:  # resample: copies of a few particles branch off
                particles[:] = [list(particles[rng.randrange(4)]) for _ in particles]
            for p in particles:
                p.append(rng.randrange(VOCAB))
        # nested: a context and its prefixes in one batch, read from one pass
        longest = [*particles[0], *(rng.randrange(VOCAB) for _ in range(5))]
        nested = [longest[:n] for n in range(len(longest) - 4, len(longest) + 1)]
        assert_rows_exact(await llm.batch_next_token_logprobs(nested), nested, alone)

    asyncio.run(run())
    assert passes.with_levels and passes.in_place, "the level and in-place paths were exercised"
    assert passes.own_only, "so was the merge of own blocks in place (the rows alone use it too)"


@pytest.mark.parametrize(
    "device, dtype, pieces",
    [
        ("emulated", torch.float32, False),
        ("emulated", torch.bfloat16, False),
        ("emulated", torch.bfloat16, True),  # CUDA's products, forced on the CPU
        pytest.param("cuda", torch.bfloat16, True, marks=NEEDS_CUDA),
    ],
)
def test_captured_steps_give_the_rows_computed_alone(device, dtype, pieces, monkeypatch):
    """One-token steps replayed as captured graphs (CUDA graphs, or emulated on the CPU): two
    prompts read as levels by some rows and not others, rows that read none, in-place steps,
    resampling, a bucket change; each row's bits are the row computed alone.

    Steps are captured on CUDA only. Emulated on the CPU, every pass takes the torch order
    CUDA falls back to (the CPU's span order plans its passes on the host, which a captured
    step cannot)."""
    if device == "emulated" and interpreted():
        pytest.skip("emulated graphs replay torch operations; interpreted Triton kernels are not")
    if device == "emulated":
        monkeypatch.setattr(exact, "span_exact_attention", exact.exact_attention)
    model = build_tiny_llama(VOCAB).to(
        device="cpu" if device == "emulated" else device, dtype=dtype
    )
    model.config._attn_implementation = "sdpa"
    exact.PaddedMatmuls.of(model).pieces = pieces
    alone = Alone(model, VOCAB)
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (300, 450)]
    with emulated_graphs() if device == "emulated" else contextlib.nullcontext():
        runner = HFRunner(model, KVPrefixTree(1 << 30), VOCAB, deterministic=True)
        for prompt in prompts:
            runner.logprobs([tuple(prompt)])
        particles = [[*rng.choice(prompts), rng.randrange(VOCAB)] for _ in range(9)]
        particles += [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(2)]  # no level
        for step in range(24):
            rows = runner.logprobs([tuple(p) for p in particles])
            assert_rows_exact(rows, particles, alone)
            if step in (3, 14):  # resample: copies branch off, rows move in the storage
                particles = [list(rng.choice(particles)) for _ in particles]
            if step == 8:  # fewer rows: another bucket
                particles = particles[:5]
            for p in particles:
                p.append(rng.randrange(VOCAB))
    alone.check_plain_forward()
    stats = runner.graphs.stats
    assert stats.unsupported is None
    assert stats.num_captures >= 2 and stats.num_replays >= 18, stats  # a graph per bucket


def test_blocks_no_part_writes_are_zeros_and_the_rest_are_written(tiny, monkeypatch):
    """Span buffers of layouts said to be covered start as NaN: a span left unwritten would poison its row.
    Rows reading the prompt as a level beside a row that reads none leave some blocks unwritten."""
    model, tokenizer, alone = tiny
    real = exact_spans._span_buffers
    kinds = set()

    def poisoned(like, shape, head_dim, layout):
        kinds.add((layout.covered, bool(layout.levels)))
        if layout.covered:
            nan = like.new_full(shape, torch.nan, dtype=torch.float32)
            return nan, nan.clone(), nan.new_full((*shape, head_dim), torch.nan)
        return real(like, shape, head_dim, layout)

    monkeypatch.setattr(exact_spans, "_span_buffers", poisoned)
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(400)]
    batch = [[*prompt, token] for token in range(8)]
    batch.append([rng.randrange(VOCAB) for _ in range(100)])
    llm = exact_llm(model, tokenizer)
    llm.next_token_logprobs_sync(prompt)
    for _ in range(2):
        assert_rows_exact(llm.batch_next_token_logprobs_sync(batch), batch, alone)
        for context in batch:
            context.append(rng.randrange(VOCAB))
    assert {(True, True), (False, True)} <= kinds  # covered and uncovered passes, both with levels


def test_rows_do_not_depend_on_their_batch(tiny):
    """One context alone, in batches of every size and order, behind its cached prefix or not."""
    model, tokenizer, alone = tiny
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(400)]
    target = [*prompt, *(rng.randrange(VOCAB) for _ in range(9))]
    others = [[*prompt[: rng.randrange(1, 400)], rng.randrange(VOCAB)] for _ in range(20)]
    for size in (1, 2, 3, 7, 15, 16, 21):
        for warm in (False, True):
            llm = exact_llm(model, tokenizer)
            if warm:
                llm.next_token_logprobs_sync(prompt)
            batch = [target, *others[: size - 1]]
            rng.shuffle(batch)
            rows = llm.batch_next_token_logprobs_sync(batch)
            assert_rows_exact(rows, batch, alone)


def test_scores_are_the_rows_computed_alone(tiny):
    model, tokenizer, alone = tiny
    rng = random.Random(2)
    llm = exact_llm(model, tokenizer)
    context = [rng.randrange(VOCAB) for _ in range(300)]
    continuations = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 70)]
    llm.next_token_logprobs_sync(context[:270])  # part of the context cached (a span and more)
    scores = llm.batch_continuation_logprobs_sync(context, continuations)
    for continuation, found in zip(continuations, scores):
        expected = torch.stack(
            [alone(context + continuation[:k])[token] for k, token in enumerate(continuation)]
        )
        assert torch.equal(found.cpu(), expected.cpu())


def test_eviction_under_a_tiny_budget_keeps_rows_exact(tiny):
    model, tokenizer, alone = tiny
    rng = random.Random(3)
    llm = exact_llm(model, tokenizer, kv_cache_bytes=200_000)
    prompt = [rng.randrange(VOCAB) for _ in range(300)]
    for _ in range(3):
        batch = [
            [*prompt, *(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 60)))]
            for _ in range(6)
        ]
        assert_rows_exact(llm.batch_next_token_logprobs_sync(batch), batch, alone)
    assert llm.kv_cache.bytes_held <= 200_000


@st.composite
def histories(draw):
    """Batches over a few prompts: new branches, steps and extensions of earlier contexts, and their prefixes.

    Prompts are short, or long enough (a 256-token span and more) to be read as levels."""
    lengths = st.one_of(st.integers(1, 120), st.integers(exact.SPAN_TOKENS + 4, 440))
    prompts = [
        [token % VOCAB for token in random.Random(seed).choices(range(VOCAB), k=length)]
        for length, seed in draw(
            st.lists(st.tuples(lengths, st.integers(0, 2**16)), min_size=1, max_size=3)
        )
    ]
    batches = []
    seen: list[list[int]] = [list(p) for p in prompts]
    for _ in range(draw(st.integers(1, 4))):
        batch = []
        for _ in range(draw(st.integers(1, 8))):
            base = draw(st.sampled_from(seen))
            kind = draw(st.sampled_from(["extend", "step", "prefix", "same"]))
            if kind == "step":  # a particle's next token: rows of one pass, behind shared levels
                context = [*base, draw(st.integers(0, VOCAB - 1))]
            elif kind == "extend":
                context = base + draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=70))
            elif kind == "prefix":
                context = base[: draw(st.integers(1, len(base)))]
            else:
                context = list(base)
            context = context[:500]
            batch.append(context)
            seen.append(context)
        batches.append(batch)
    budget = draw(st.sampled_from([100_000, 400_000, 1 << 30]))
    return batches, budget


_PROMPT = [random.Random(9).randrange(VOCAB) for _ in range(300)]
STEPS_BEHIND_A_LEVEL = (
    [[[*_PROMPT, 1], [*_PROMPT, 2]], [[*_PROMPT, 1, 5], [*_PROMPT, 2, 6], [*_PROMPT, 1, 7]]],
    1 << 30,
)
"""A history every run checks: particles stepping behind a prompt read as a level."""

_SECOND = [random.Random(10).randrange(VOCAB) for _ in range(280)]
_SHORT = [random.Random(11).randrange(VOCAB) for _ in range(200)]
SOME_READ_A_LEVEL = (
    [
        [_PROMPT, _SECOND, _SHORT],
        # each prompt read as a level by two rows of a pass; a row's 150 new positions
        # after 200 cached ones cross a span boundary within one run of positions
        [[*_PROMPT, 3], [*_PROMPT, 4], [*_SECOND, 5], [*_SECOND, 6], _SHORT + _PROMPT[:150]],
    ],
    1 << 30,
)
"""A history every run checks: a level read by some rows only, queries of a run in two spans."""


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories())
@example(history=STEPS_BEHIND_A_LEVEL)
@example(history=SOME_READ_A_LEVEL)
def test_any_history_gives_the_rows_computed_alone(tiny, history):
    check_history(tiny, history)


def test_the_explicit_history_reads_a_level(tiny, monkeypatch):
    passes = PassCounter(monkeypatch)
    check_history(tiny, STEPS_BEHIND_A_LEVEL)
    assert passes.with_levels >= 2, "both batches read the prompt as a level"


def test_the_explicit_history_reads_a_level_by_some_rows_and_a_run_in_two_spans(tiny, monkeypatch):
    passes = PassCounter(monkeypatch)
    plans = []
    real = exact_spans.SpanPlan._make.__func__

    def make(cls, *args):
        plans.append(real(cls, *args))
        return plans[-1]

    monkeypatch.setattr(exact_spans.SpanPlan, "_make", classmethod(make))
    # Unchunked: the history's batches are the passes (chunks would cut its long run at a span).
    check_history(tiny, SOME_READ_A_LEVEL, chunk_tokens=None)
    assert passes.read_by_some, "a level was read by some rows only"
    assert any(plan.in_blocks is not None for plan in plans), "a run's queries were in two spans"


@settings(
    max_examples=max(1, EXAMPLES // 2), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(history=histories())
@example(history=STEPS_BEHIND_A_LEVEL)
@example(history=SOME_READ_A_LEVEL)
def test_any_history_gives_the_rows_computed_alone_in_bfloat16(tiny_bf16, history):
    check_history(tiny_bf16, history)


ADAPTERS = (None, "left", "right")


@pytest.fixture(scope="module")
def adapted(smollm2_tokenizer, tmp_path_factory):
    """A factory of deterministic LMs holding two LoRA adapters of the tiny model, and each
    (context, adapter)'s row computed alone from an empty cache by another such LM."""
    peft = pytest.importorskip("peft", reason="LoRA needs peft (the test extra installs it)")
    vocab_size = len(smollm2_tokenizer)
    folder = tmp_path_factory.mktemp("exact-adapters")
    paths = {}
    for seed, name in enumerate(ADAPTERS[1:]):
        config = peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        )
        model = peft.get_peft_model(build_tiny_llama(vocab_size), config)
        generator = torch.Generator().manual_seed(20 + seed)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:  # peft may start B at zero: make it count
                    parameter.normal_(0.0, 0.5, generator=generator)
        model.save_pretrained(folder / name)
        paths[name] = str(folder / name)

    def new_llm(**opts) -> AsyncTransformer:
        llm = exact_llm(build_tiny_llama(vocab_size), smollm2_tokenizer, **opts)
        for name, path in paths.items():
            llm.add_new_lora(path, name)
        return llm

    reference = new_llm()
    rows: dict = {}

    def alone(context, adapter) -> torch.Tensor:
        key = (tuple(context), adapter)
        if key not in rows:
            reference.clear_cache()
            rows[key] = reference.next_token_logprobs_sync(list(context), adapter)
        return rows[key]

    probe = list(range(1, 40))
    assert not torch.equal(alone(probe, "left"), alone(probe, None))  # the adapters change rows
    assert not torch.equal(alone(probe, "left"), alone(probe, "right"))
    yield new_llm, alone
    reference.close()


@settings(
    max_examples=max(1, EXAMPLES // 3), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(history=histories(), data=st.data())
def test_any_history_under_adapters_gives_the_rows_computed_alone(adapted, history, data):
    """Batches mixing the base model and two LoRA adapters (each its own keys/values)."""
    new_llm, alone = adapted
    batches, budget = history
    named = [[(c, data.draw(st.sampled_from(ADAPTERS))) for c in batch] for batch in batches]
    llm = new_llm(kv_cache_bytes=budget)

    async def run():
        for batch in named:
            rows = await asyncio.gather(*(llm.next_token_logprobs(c, a) for c, a in batch))
            for row, (context, adapter) in zip(rows, batch):
                assert torch.equal(row, alone(context, adapter)), (len(context), adapter)

    asyncio.run(run())
    llm.close()


def check_history(tiny, history, **opts) -> None:
    model, tokenizer, alone = tiny
    batches, budget = history
    llm = exact_llm(model, tokenizer, kv_cache_bytes=budget, **opts)

    async def run():
        for batch in batches:
            rows = await asyncio.gather(*(llm.next_token_logprobs(c) for c in batch))
            assert_rows_exact(rows, batch, alone)

    asyncio.run(run())
    alone.check_plain_forward()


def test_smollm2_rows_batched_and_cached_are_the_rows_computed_alone(default_model_dir):
    """The real model in bfloat16: batched behind a cached prompt, against each row alone, and
    those against the plain forward. (In float32 the tiny models' tests take the same paths, and
    in bfloat16 they step in place too: the real model adds its shape.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    alone = Alone(model, len(tokenizer))
    rng = random.Random(4)
    prompt = [rng.randrange(VOCAB) for _ in range(270)]  # read as a level of one span
    batch = [[*prompt, *(rng.randrange(VOCAB) for _ in range(n))] for n in (1, 30)]
    llm = exact_llm(model, tokenizer)
    llm.next_token_logprobs_sync(prompt)
    assert_rows_exact(llm.batch_next_token_logprobs_sync(batch), batch, alone)
    alone.check_plain_forward()


def test_steps_go_when_the_loop_is_idle_never_on_the_clock(monkeypatch):
    """Calls arriving over several loop passes, with a clock that leaps a second per reading:
    a timeout would cut them into several steps; ``deterministic`` takes them in one."""
    clock = iter(range(10**6))
    monkeypatch.setattr(batching_module.time, "monotonic", lambda: float(next(clock)))

    async def arrivals(llm) -> int:
        async def call(delay: int):
            for _ in range(delay):
                await asyncio.sleep(0)
            return await llm.next_token_logprobs([1, 2, delay])

        await asyncio.gather(*(call(d) for d in range(8)))
        return llm.batcher_stats.num_batches

    byte_vocab = [bytes([i]) for i in range(256)]
    assert asyncio.run(arrivals(MockAsyncLM(byte_vocab=byte_vocab, deterministic=True))) == 1
    assert asyncio.run(arrivals(MockAsyncLM(byte_vocab=byte_vocab, timeout_s=0.02))) > 1


def test_timeout_none_needs_flush_on_idle():
    with pytest.raises(ValueError, match="flush_on_idle"):
        BatchingConfig(timeout_s=None, flush_on_idle=False)


def test_gpt2_rows_are_the_rows_computed_alone(tiny_gpt2):
    """GPT-2's projections are transformers' Conv1D (addmm), padded like nn.Linear."""
    model, tokenizer = tiny_gpt2
    alone = Alone(model, len(tokenizer))
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(300)]
    batch = [[*prompt, *(rng.randrange(VOCAB) for _ in range(n))] for n in (1, 4, 20)]
    llm = exact_llm(model, tokenizer)
    llm.next_token_logprobs_sync(prompt)
    assert_rows_exact(llm.batch_next_token_logprobs_sync(batch), batch, alone)


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
        pytest.param("cuda", torch.bfloat16, marks=NEEDS_CUDA),
    ],
)
@pytest.mark.parametrize("build", ["build_tiny_llama", "build_tiny_gpt2"])
def test_products_in_pieces_give_the_rows_computed_alone(device, build, dtype, monkeypatch):
    """Products in pieces of ``CUDA_ROWS`` rows (CUDA's way; forced on the CPU): rows batched
    behind a cached prompt, then stepped, against each row alone, and against a plain forward."""
    pieces = []
    real = exact_products.products_in_pieces

    def spy(product, rows):
        pieces.append(rows.shape[0])
        return real(product, rows)

    monkeypatch.setattr(exact_products, "products_in_pieces", spy)
    model = getattr(conftest, build)(VOCAB).to(device=device, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    padded = exact.PaddedMatmuls.of(model)
    assert padded.pieces == (device == "cuda")
    padded.pieces = True
    alone = Alone(model, VOCAB)
    rng = random.Random(6)
    prompt = [rng.randrange(VOCAB) for _ in range(300)]
    batch = [[*prompt, *(rng.randrange(VOCAB) for _ in range(n))] for n in (1, 2, 5, 9, 30, 70)]
    runner = HFRunner(model, KVPrefixTree(1 << 30), VOCAB, deterministic=True)
    runner.logprobs([tuple(prompt)])
    for _ in range(2):
        rows = runner.logprobs([tuple(context) for context in batch])
        assert_rows_exact(rows, batch, alone)
        if dtype == torch.float32:
            for row, context in zip(rows, batch):
                torch.testing.assert_close(
                    row, reference(model, context)[:VOCAB], atol=ATOL, rtol=0
                )
        for context in batch:
            context.append(rng.randrange(VOCAB))
    alone.check_plain_forward()  # bfloat16
    assert (
        max(pieces) > exact.CUDA_ROWS and min(pieces) < exact.CUDA_ROWS
    )  # several pieces, and padding


def test_exact_rows_are_promised_only_where_they_were_measured():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert exact.exact_rows_unsupported(cpu, torch.float32) is None
    assert exact.exact_rows_unsupported(cpu, torch.bfloat16) is None
    assert exact.exact_rows_unsupported(cuda, torch.bfloat16) is None
    assert "bfloat16 only" in exact.exact_rows_unsupported(cuda, torch.float32)
    assert "bfloat16 only" in exact.exact_rows_unsupported(cuda, torch.float16)
    assert "float32 and bfloat16" in exact.exact_rows_unsupported(cpu, torch.float16)
    assert "not on mps" in exact.exact_rows_unsupported(torch.device("mps"), torch.bfloat16)


def test_a_model_moved_to_another_device_gets_that_device_s_products(monkeypatch):
    model = build_tiny_llama(VOCAB)
    padded = exact.PaddedMatmuls.of(model)
    assert not padded.pieces
    padded.pieces = True  # forced, as the tests above do: kept while the model stays put
    assert exact.PaddedMatmuls.of(model).pieces
    monkeypatch.setattr(padded, "device", "cuda")  # as if it had been on CUDA, then moved here
    assert exact.PaddedMatmuls.of(model) is padded and not padded.pieces


def test_products_in_pieces_refuse_projections_they_cannot_compute():
    class QuantizedLinear(torch.nn.Linear):  # a subclass computes its own product
        pass

    model = build_tiny_llama(VOCAB)
    model.lm_head = QuantizedLinear(model.lm_head.in_features, VOCAB, bias=False)
    exact.PaddedMatmuls(pieces=False).attach(model)  # padded, the layer computes itself
    with pytest.raises(
        ValueError, match=r"plain nn\.Linear or Conv1D layers; this model has a QuantizedLinear"
    ):
        exact.PaddedMatmuls(pieces=True).attach(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=NEEDS_CUDA)])
def test_deterministic_on_cuda_is_refused_outside_bfloat16(device, dtype):
    model = build_tiny_llama(VOCAB).to(device=device, dtype=dtype)
    with pytest.raises(ValueError, match="bfloat16 only"):
        HFRunner(model, KVPrefixTree(1 << 20), VOCAB, deterministic=True)


def test_deterministic_is_refused_where_it_cannot_hold(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer))
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attention implementation 'eager'"):
        AsyncTransformer(model, smollm2_tokenizer, deterministic=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        AsyncTransformer(model, smollm2_tokenizer, deterministic="yes")
    half = build_tiny_llama(len(smollm2_tokenizer)).to(torch.float16)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        AsyncTransformer(half, smollm2_tokenizer, deterministic=True)
