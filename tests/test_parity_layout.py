"""A parity set's layout (tierstore/tiers/parity_sets.py): where every byte of each member's
files lies in the other members' parity chunks, made once with the set as plain data, in the
one order every rank of the set lists its transfers in."""

from __future__ import annotations

import dataclasses

import pytest

from tierstore.format.manifest import FileEntry
from tierstore.format.parity import common_length
from tierstore.tiers.parity_sets import ParityLayout, ParityPiece, ParitySet, read_members


def _set(files: dict[int, dict[str, int]]) -> ParitySet:
    """The set of ``files``' ranks, each member's files of the given sizes."""
    headers = {r: {"files": {rel: FileEntry(size, "xxh3_128:0") for rel, size in sizes.items()}}
               for r, sizes in files.items()}
    return ParitySet.of(sorted(files), headers)


def test_a_small_sets_layout_is_worked_out_by_hand():
    # 3 members, so 2 chunks of 16 bytes (the longest stream, 20 bytes, rounded up to whole
    # 8-byte words in each chunk); member j's chunk c is in the parity of the member at
    # position (j + c + 1) mod 3.
    layout = ParityLayout.of((0, 1, 2), 16, {0: {"a": 10, "b": 6}, 1: {"c": 20}, 2: {}})
    assert layout.pieces == (
        ParityPiece(member=0, holder=1, file="a", offset=0, size=10, at=0),
        ParityPiece(member=0, holder=1, file="b", offset=0, size=6, at=10),
        ParityPiece(member=1, holder=0, file="c", offset=16, size=4, at=0),
        ParityPiece(member=1, holder=2, file="c", offset=0, size=16, at=0),
    )


def test_the_set_makes_its_layout_once_from_its_headers_in_stream_order():
    found = _set({3: {"z": 5, "a": 300}, 7: {"m": 17}})
    assert found.layout == ParityLayout.of((3, 7), found.chunk, {3: {"a": 300, "z": 5},
                                                               7: {"m": 17}})
    assert list(found.layout.sizes[3]) == ["a", "z"]  # files in stream order, as sorted
    # A description read back carries the same layout: the lost member's rank, told the set
    # by a survivor, lists the same transfers as the survivors.
    assert read_members(found.to_json()).layout == found.layout


@pytest.mark.parametrize("files", [
    {0: {"x": 100, "y": 7}, 2: {"x": 1000}, 4: {"p": 3, "q": 5, "r": 999}, 6: {}},
    {1: {"only": 64}, 5: {}},
    {0: {"a": 0, "b": 1}, 1: {"a": 9}, 2: {"a": 8}, 3: {"b": 17}, 4: {"c": 33}},
])
def test_every_byte_of_every_member_is_in_exactly_one_other_members_chunk_once(files):
    found = _set(files)
    layout = found.layout
    n = len(layout.ranks)
    assert layout.chunk * (n - 1) == common_length(
        [sum(s.values()) for s in files.values()], n)
    for member in layout.ranks:
        covered = {rel: [0] * size for rel, size in layout.sizes[member].items()}
        for p in layout.pieces:
            if p.member != member:
                continue
            assert p.holder != member and p.size > 0
            assert 0 <= p.at and p.at + p.size <= layout.chunk
            for i in range(p.offset, p.offset + p.size):
                covered[p.file][i] += 1
        assert all(c == 1 for counts in covered.values() for c in counts), member


def test_pieces_are_listed_by_member_then_holder_then_stream_as_the_set_gives_them():
    found = _set({0: {"x": 100, "y": 7}, 2: {"x": 1000}, 4: {"p": 3, "q": 5, "r": 999}})
    listed = [(member, holder, piece) for member in found.ranks for holder in found.ranks
              if member != holder for piece in found.pieces(member, holder)]
    assert [(p.member, p.holder, (p.file, p.offset, p.size, p.at))
            for p in found.layout.pieces] == listed
    # A rebuild of one member takes its pieces from the survivors in set order.
    lost = 2
    assert [p.holder for p in found.layout.pieces if p.member == lost] == sorted(
        p.holder for p in found.layout.pieces if p.member == lost)


def test_the_layout_is_plain_data():
    layout = _set({0: {"a": 40}, 1: {"b": 24}}).layout
    assert dataclasses.is_dataclass(layout) and layout.__dataclass_params__.frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.chunk = 0
    values = [layout.ranks, layout.chunk, layout.sizes,
              *(dataclasses.astuple(p) for p in layout.pieces)]
    assert all(isinstance(v, (int, str, tuple, dict)) for v in values)


def test_a_rank_outside_the_set_or_a_members_own_chunk_is_refused():
    found = _set({0: {"a": 40}, 1: {"b": 24}})
    with pytest.raises(ValueError):
        found.pieces(0, 5)
    with pytest.raises(ValueError, match="holds no chunk of its own data"):
        found.pieces(1, 1)
