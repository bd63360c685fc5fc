"""KVBlock.copy_in: grouped, sliced and broadcast copies equal the copies made one by one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.cache.kv_block import KVBlock, Segment

NUM_LAYERS, HEADS, DIM = 2, 2, 3


def numbered_block(rows: int, slots: int, offset: float) -> KVBlock:
    """A block whose every element is distinct (its index, plus ``offset``)."""
    count = NUM_LAYERS * 2 * rows * HEADS * slots * DIM
    stacked = torch.arange(count, dtype=torch.float32) + offset
    return KVBlock(stacked.reshape(NUM_LAYERS, 2, rows, HEADS, slots, DIM))


@st.composite
def copy_lists(draw):
    """Copies into a 6-row, 8-slot block from two source blocks; one source row may be read by
    several target rows (a prompt copied into every particle's row), and target rows need not
    be consecutive."""
    sources = [numbered_block(3, 8, 0.0), numbered_block(2, 8, 1e5)]
    targets = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6, unique=True))
    slot = draw(st.integers(0, 4))
    length = draw(st.integers(1, 8 - slot))
    start = draw(st.integers(0, 8 - length))
    copies = []
    for target in targets:
        which = draw(st.integers(0, 1))
        row = draw(st.integers(0, sources[which].num_rows - 1))
        copies.append((target, slot, Segment(sources[which], row, start, length)))
    return copies


@settings(max_examples=60, deadline=None)
@given(copy_lists())
def test_copy_in_equals_copies_one_by_one(copies):
    block = KVBlock(torch.full((NUM_LAYERS, 2, 6, HEADS, 8, DIM), -1.0))
    expected = block.stacked.clone()
    for target, slot, segment in copies:
        taken = segment.block.stacked[
            ..., segment.row, :, segment.start : segment.start + segment.length, :
        ]
        expected[..., target, :, slot : slot + segment.length, :] = taken
    block.copy_in(copies)
    assert torch.equal(block.stacked, expected)


def test_one_source_row_copied_into_every_row():
    """The broadcast copy: every target row gets the same source row, nothing else changes."""
    source = numbered_block(2, 5, 0.0)
    block = KVBlock(torch.full((NUM_LAYERS, 2, 4, HEADS, 6, DIM), -1.0))
    block.copy_in([(row, 1, Segment(source, 1, 0, 5)) for row in (0, 2, 3)])
    for row in (0, 2, 3):
        assert torch.equal(block.stacked[..., row, :, 1:6, :], source.stacked[..., 1, :, 0:5, :])
    assert (block.stacked[..., 1, :, :, :] == -1).all()
    assert (block.stacked[..., :, :, 0, :] == -1).all()
