"""The anchors' arena (dilocod.learner.arena) on real memory: pieces only for the sizes a plan
expects, once each, on page boundaries, until the region is full; a populated region is resident;
a shared region is one memory in two mappings; a piece named by a bad offset is refused."""

from __future__ import annotations

import os

import pytest

from dilocod.learner.arena import ALIGN, Arena, anchor_bytes, arena_size
from dilocod.wire.manifest import ModelEntry


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


def test_the_arena_holds_every_parameter_as_float32_with_room_to_align() -> None:
    model = (ModelEntry("a", "float32", (3, 5)), ModelEntry("b", "bfloat16", (7,)))
    assert anchor_bytes(model) == 4 * (15 + 7)  # anchors are float32 whatever the training dtype
    size = arena_size(10 * ALIGN + 1)
    assert size % ALIGN == 0 and size >= 11 * ALIGN + 10 * ALIGN


def test_pieces_are_cut_only_for_the_sizes_the_plan_expects() -> None:
    arena = Arena(arena_size(3 * ALIGN), shared=False)
    assert arena.take(100) is None  # before a plan: nothing
    arena.expect([100, 100, ALIGN + 1])
    first, second = arena.take(100), arena.take(100)
    assert first is not None and second is not None
    assert (first[0], second[0]) == (0, ALIGN)  # each on its own page
    assert arena.take(100) is None  # two expected, two cut: a third is made elsewhere
    third = arena.take(ALIGN + 1)
    assert third is not None and third[0] == 2 * ALIGN and len(third[1]) == ALIGN + 1
    assert arena.used == 200 + ALIGN + 1
    # The pieces are disjoint views of one region.
    first[1][:] = b"\x01" * 100
    second[1][:] = b"\x02" * 100
    assert bytes(arena.view(0, 100)) == b"\x01" * 100 and bytes(arena.view(ALIGN, 100)) == b"\x02" * 100


def test_a_full_arena_cuts_nothing_more() -> None:
    arena = Arena(2 * ALIGN, shared=False)
    arena.expect([ALIGN] * 3)
    assert arena.take(ALIGN) is not None and arena.take(ALIGN) is not None
    assert arena.take(ALIGN) is None  # expected, but no room left


def test_a_new_plan_replaces_what_is_expected() -> None:
    arena = Arena(arena_size(4 * ALIGN), shared=False)
    arena.expect([64])
    arena.expect([128])
    assert arena.take(64) is None and arena.take(128) is not None


def test_populate_makes_the_region_resident_and_leaves_it_zero() -> None:
    size = 64 << 20
    arena = Arena(size, shared=False)
    before = _rss_kib()
    seconds = arena.populate(threads=2)
    assert seconds >= 0.0 and arena.populate_s == seconds
    assert _rss_kib() - before >= 0.9 * size / 1024
    assert not any(arena.view(0, size))


def test_a_shared_arena_is_one_memory_in_two_mappings() -> None:
    owner = Arena(arena_size(2 * ALIGN), shared=True)
    assert owner.fd is not None
    other = Arena(owner.size, shared=True, fd=os.dup(owner.fd))
    assert other.fd is None  # the mapping is what it keeps
    other.expect([10])
    offset, piece = other.take(10) or (None, None)
    assert offset == 0 and piece is not None
    piece[:] = b"0123456789"
    assert bytes(owner.view(0, 10)) == b"0123456789"
    owner.close()
    assert owner.fd is None and bytes(owner.view(0, 10)) == b"0123456789"


def test_a_descriptor_of_another_size_is_refused() -> None:
    fd = os.memfd_create("other")
    os.ftruncate(fd, ALIGN)
    with pytest.raises(ValueError, match=f"holds {ALIGN} bytes, not {2 * ALIGN}"):
        Arena(2 * ALIGN, shared=True, fd=fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed either way


@pytest.mark.parametrize(
    ("offset", "size"),
    [(1, 10), (-ALIGN, 10), (ALIGN, 2 * ALIGN), (0, -1)],
    ids=["unaligned", "negative", "past", "size"],
)
def test_a_piece_named_by_a_bad_offset_is_refused(offset: int, size: int) -> None:
    arena = Arena(2 * ALIGN, shared=False)
    with pytest.raises(ValueError, match="no piece"):
        arena.view(offset, size)
