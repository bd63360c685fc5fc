"""A particles' next step planned from the last one (``InPlaceStep``): the planner's plan, or none.

Every step's rows are held to the uncached forward (``tests.hf_reference``, 1e-4); each plan
made from the last step is held equal to the one the planner makes from the lookups.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
        self.made = self.declined = self.permuted = 0
        self.last_plan = None
        real = runner_module.InPlaceStep.next_plan

        def next_plan(step, contexts, parents, namespace, policy, kv_tree):
            followed = real(step, contexts, parents, namespace, policy, kv_tree)
            if followed is None:
                self.declined += 1
                return None
            self.made += 1
            plan, entries, grown = followed
            (pass_plan,) = plan.passes
            order = [row.reads[0][0] for row in pass_plan.rows]  # the output each row gives
            assert sorted(order) == list(range(len(contexts)))
            assert list(grown) == [contexts[j] for j in order]
            self.permuted += order != sorted(order)
            # The planner's plan of the same contexts in the block's order, each row read
            # by the output of the batch's context it computes.
            lookups = driver.lookup(grown, namespace, [parents[j] for j in order])
            (expected,) = planner.plan_batch(lookups, policy).passes
            rows = tuple(row._replace(reads=((j, 0),)) for row, j in zip(expected.rows, order))
            expected = dataclasses.replace(expected, rows=rows)
            assert plan == planner.BatchPlan((expected,), len(contexts)), "the planner's plan"
            assert [row.found for row in pass_plan.rows] == entries
            self.last_plan = plan
            return followed

        monkeypatch.setattr(runner_module.InPlaceStep, "next_plan", next_plan)


async def steps(llm, particles, rng, count, check_every=1, shuffle=False):
    """``count`` steps of ``particles``, each a token longer; ``shuffle``: their requests
    come in another order each step (as a server gathers its clients')."""
    for step in range(count):
        particles[:] = [p + [rng.randrange(3000)] for p in particles]
        order = rng.sample(range(len(particles)), len(particles)) if shuffle else None
        if order is None:
            rows = await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
        else:
            shuffled = await asyncio.gather(*(llm.next_token_logprobs(particles[i]) for i in order))
            rows = [row for _, row in sorted(zip(order, shuffled), key=lambda pair: pair[0])]
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


async def test_a_new_blocks_next_step_is_planned_from_the_last_one(tiny_llama, monkeypatch):
    """A step that wrote its one-token rows into a new block (a block out of spare slots, a
    batch after resampling) leaves spare slots: the next step extends it in place, planned
    from that step, rather than being looked up and planned again."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    spy = PlanSpy(monkeypatch, llm.runner.driver)
    rng = random.Random(3)
    particles = [[rng.randrange(3000) for _ in range(n)] for n in (5, 8, 6)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    await steps(llm, particles, rng, 1)  # each row one token past its prompt: a new block
    assert (spy.made, spy.declined) == (0, 0), "the prompts' pass is no particles' step"
    await steps(llm, particles, rng, 1)
    assert (spy.made, spy.declined) == (1, 0)
    # Resampling: a copy of one particle replaces another, and their step needs a new block.
    particles[2] = list(particles[0])
    await steps(llm, particles, rng, 1)
    assert spy.declined == 1
    made = spy.made
    await steps(llm, particles, rng, 2)
    assert spy.made == made + 2, "the new block's next steps are planned from the last one"


async def test_particles_requested_in_another_order_each_step_are_planned_from_their_last_step(
    tiny_llama, monkeypatch
):
    """A server's batch holds its clients' particles in the order they came: each step, the
    same particles in another order still extend their block in place (each row giving
    its context's output), and the rows stay exact."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    spy = PlanSpy(monkeypatch, llm.runner.driver)
    rng = random.Random(12)
    particles = [[rng.randrange(3000) for _ in range(n)] for n in (6, 9, 7, 9, 12)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    await steps(llm, particles, rng, 10, shuffle=True)
    assert spy.made >= 7 and spy.permuted >= 6, (spy.made, spy.permuted, spy.declined)


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


def tree_state(tree) -> tuple:
    """The tree as plain values: each entry in LRU order (its block by first appearance, its
    row and span, its parent's place, its trie depth), each block's row ends, and the
    contexts kept by identity (their length and entry's place, ``None`` once the entry
    left the tree)."""
    blocks: dict[int, int] = {}
    entries = list(tree._lru.values())
    place = {id(entry): i for i, entry in enumerate(entries)}
    state = [
        (
            blocks.setdefault(id(e.block), len(blocks)),
            e.row,
            e.start,
            e.length,
            e.offset,
            place.get(id(e.parent)),
            e.node.depth,
            e.namespace,
        )
        for e in entries
    ]
    row_ends = sorted((blocks[id(b)], list(b.row_ends)) for b in tree._blocks.values())
    # A context whose entry left the tree is not found by it, whether the entry is collected
    # yet or not (that depends on when the cyclic collector last ran): both are None.
    latest = [
        (len(e.context), ns, place[id(e)]) if (e := ref()) is not None and id(e) in place else None
        for ns, ref in tree._latest.values()
    ]
    return state, row_ends, latest


async def test_a_step_planned_from_the_last_one_commits_as_its_placements_would(
    tiny_llama, monkeypatch
):
    """The tree after each step committed by growing the last step's entries
    (``grow_in_place``, no placements made) equals the tree of the same steps each looked
    up, planned and committed from its placements."""
    model, tokenizer = tiny_llama
    planned = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    looked_up = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    grown = []
    real_grow = type(planned.runner.kv_tree).grow_in_place

    def grow_in_place(tree, entries, contexts, namespace):
        grown.append(tree is planned.runner.kv_tree)
        return real_grow(tree, entries, contexts, namespace)

    monkeypatch.setattr(type(planned.runner.kv_tree), "grow_in_place", grow_in_place)
    made_placements = []
    real_placements = planner.PassPlan.placements

    def placements(plan):
        made_placements.append(plan)
        return real_placements(plan)

    monkeypatch.setattr(planner.PassPlan, "placements", placements)
    real_next_plan = runner_module.InPlaceStep.next_plan

    def next_plan(step, contexts, parents, namespace, policy, kv_tree):
        if kv_tree is looked_up.runner.kv_tree:
            return None  # every step of this one looked up and planned
        return real_next_plan(step, contexts, parents, namespace, policy, kv_tree)

    monkeypatch.setattr(runner_module.InPlaceStep, "next_plan", next_plan)
    rng = random.Random(8)
    # Contexts of 70 tokens: a block's spare slots (a quarter of its length) outlast the
    # trie's stride, so entries grown in place get their trie nodes.
    particles = [[rng.randrange(3000) for _ in range(70)] for _ in range(5)]
    for llm in (planned, looked_up):
        await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    for _ in range(2 * INDEX_STRIDE + 3):  # past the trie's stride and a block's spare slots
        particles = [[*p, rng.randrange(3000)] for p in particles]
        num_grown, num_placed = len(grown), len(made_placements)
        mine = await asyncio.gather(*(planned.next_token_logprobs(p) for p in particles))
        # A step committed by growing its entries makes no placements; any other makes them.
        assert (len(made_placements) == num_placed) == (len(grown) > num_grown)
        theirs = await asyncio.gather(*(looked_up.next_token_logprobs(p) for p in particles))
        assert tree_state(planned.runner.kv_tree) == tree_state(looked_up.runner.kv_tree)
        for row, other in zip(mine, theirs):
            assert (row - other).abs().max() <= 1e-5
    assert all(grown) and len(grown) >= 2 * INDEX_STRIDE - 8, "most steps grew their entries"


async def test_the_last_steps_particles_need_no_chunk_search(tiny_llama, monkeypatch):
    """A batch continuing the last in-place step, whose parents the tree holds, costs a token a
    context: ``advance`` chunks nothing and looks nothing up. Once the tree dropped them, the
    contexts' costs are looked up again (and their prefills chunked)."""
    model, tokenizer = tiny_llama
    llm = AsyncTransformer(model, tokenizer, output_cache_bytes=0)
    rng = random.Random(10)
    particles = [[rng.randrange(3000) for _ in range(40)] for _ in range(4)]
    await asyncio.gather(*(llm.next_token_logprobs(p) for p in particles))
    await steps(llm, particles, rng, 2)
    driver, tree = llm.runner.driver, llm.runner.kv_tree
    assert driver._in_place is not None
    parents = list(driver._in_place.contexts)
    contexts = [(*p, 5) for p in parents]
    looked_up = []
    real = type(tree).cached_length
    monkeypatch.setattr(
        type(tree), "cached_length", lambda t, *a: looked_up.append(a) or real(t, *a)
    )
    assert driver.advance(contexts, None, 8, parents) == 0
    assert not looked_up
    llm.clear_kv_cache()  # the parents' entries gone: each context's prefill is due again
    assert driver.advance(contexts, None, 8, parents) == 8
    assert looked_up
