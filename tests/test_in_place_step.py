"""A particles' next step planned from the last one (``InPlaceStep``): the planner's plan, or none.

Every step's rows are held to the uncached forward (``tests.hf_reference``, 1e-4); each plan
made from the last step is held equal to the one the planner makes from the lookups.
"""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

from genlm_backend.cache import plan as planner
from genlm_backend.cache.kv_tree import INDEX_STRIDE
from genlm_backend.llm import runner as runner_module
from genlm_backend.llm.hf import AsyncTransformer
from tests.hf_reference import assert_matches_reference


class PlanSpy:
    """Counts the plans made from the last step, each checked against the planner's."""

    def __init__(self, monkeypatch, driver):
        self.made = self.declined = 0
        self.last_plan = None
        real = runner_module.InPlaceStep.next_plan

        def next_plan(step, contexts, parents, namespace, policy, kv_tree):
            plan = real(step, contexts, parents, namespace, policy, kv_tree)
            if plan is None:
                self.declined += 1
                return None
            self.made += 1
            lookups = driver.lookup(contexts, namespace, parents)
            assert plan == planner.plan_batch(lookups, policy), "the planner's plan"
            self.last_plan = plan
            return plan

        monkeypatch.setattr(runner_module.InPlaceStep, "next_plan", next_plan)


async def steps(llm, particles, rng, count, check_every=1):
    for step in range(count):
        particles[:] = [p + [rng.randrange(3000)] for p in particles]
        rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        if step % check_every == 0 or step == count - 1:
            for particle, row in zip(particles, rows):
                assert_matches_reference(llm, particle, row)


async def test_lock_step_particles_are_planned_from_their_last_step(tiny_llama, monkeypatch):
    """Past the trie's stride (an entry replaced by a fresh one over the same slots) and past
    a block's spare slots (a new block, planned afresh), every plan made from the last
    step is the planner's, and the rows stay exact."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    spy = PlanSpy(monkeypatch, llm.runner.driver)
    rng = random.Random(2)
    # Unequal prompts: each row's own part starts at its own slot.
    particles = [[rng.randrange(3000) for _ in range(n)] for n in (5, 9, 7, 9)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    await steps(llm, particles, rng, 2 * INDEX_STRIDE + 3, check_every=4)
    assert spy.made >= 2 * INDEX_STRIDE - 8, (spy.made, spy.declined)
    assert spy.declined >= 1, "a block out of spare slots is planned afresh"


async def test_behind_a_shared_prompt_levels_carry_over(tiny_llama, monkeypatch):
    """Particles behind a prompt read as a level: the next plan keeps the level."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    llm.runner.level_policy = planner.LevelPolicy(min_shared_tokens=8, min_unshared_tokens=8)
    spy = PlanSpy(monkeypatch, llm.runner.driver)
    rng = random.Random(4)
    prompt = [rng.randrange(3000) for _ in range(40)]
    await llm.next_token_logprobs(prompt)
    particles = [[*prompt, i] for i in range(6)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    await steps(llm, particles, rng, 6)
    assert spy.made >= 3
    (pass_plan,) = spy.last_plan.passes
    assert all(row.levels for row in pass_plan.rows), "the prompt is read as a level"


async def test_a_tree_changed_between_steps_is_looked_up_again(tiny_llama, monkeypatch):
    """A step's entries evicted, or grown by a batch of siblings, between two steps: the
    next step is looked up and planned afresh, and its rows stay exact."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    spy = PlanSpy(monkeypatch, llm.runner.driver)
    rng = random.Random(6)
    particles = [[rng.randrange(3000) for _ in range(6)] for _ in range(4)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    await steps(llm, particles, rng, 3)
    made = spy.made
    assert made >= 1

    block = weakref.ref(spy.last_plan.passes[0].extends)
    spy.last_plan = None
    llm.clear_kv_cache()  # every entry evicted: the step kept for planning holds no block
    gc.collect()
    assert block() is None
    await steps(llm, particles, rng, 1)
    assert spy.made == made and spy.declined >= 1

    await steps(llm, particles, rng, 3)
    made = spy.made
    assert made > 0
    # Siblings: the same contexts with another last token. They are the batch extending the
    # last step's contexts (planned from it) and grow the particles' entries in place, so
    # the particles' own next step cannot be.
    siblings = [[*p, 7] for p in particles]
    rows = await asyncio.gather(*(llm.next_token_logprobs(s) for s in siblings))
    for sibling, row in zip(siblings, rows):
        assert_matches_reference(llm, sibling, row)
    assert spy.made == made + 1
    made, declined = spy.made, spy.declined
    await steps(llm, particles, rng, 1)
    assert spy.made == made and spy.declined > declined

    # Resampling: one particle replaced by a copy of another.
    await steps(llm, particles, rng, 2)
    declined = spy.declined
    particles[1] = list(particles[0])
    await steps(llm, particles, rng, 1)
    assert spy.declined > declined
