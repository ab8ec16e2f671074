"""XOR parity over a set of ranks' files (tierstore/format/parity.py): every member's data comes
back bitwise from the others and the parity, whichever member is lost, with each member keeping
1/k of a checkpoint; and gloo's reduce-scatter with XOR computes exactly the reference."""

from __future__ import annotations

import pytest
import torch

from helpers import run_torchrun
from tierstore.format.parity import (chunk_index, common_length, decode_segments,
                                     encode_segments, pack, reassemble, reduce_scatter_xor,
                                     unpack)


def _members(n: int, seed: int) -> list[list[torch.Tensor]]:
    """Each member's files: a few of uneven sizes (one empty), of random bytes."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for j in range(n):
        sizes = [int(s) for s in torch.randint(0, 50_000, (3,), generator=gen)] + [0, 7 + j]
        out.append([torch.randint(0, 256, (s,), dtype=torch.uint8, generator=gen)
                    for s in sizes])
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_any_one_lost_member_is_rebuilt_bitwise_from_the_others_and_the_parity(n):
    members = _members(n, seed=n)
    length = common_length([sum(f.numel() for f in files) for files in members], n)
    data = [pack(files, length) for files in members]
    parity = reduce_scatter_xor([encode_segments(d, j, n) for j, d in enumerate(data)], n)
    # Each member keeps 1/k of the common length, never its own bytes.
    assert all(p.numel() == length // (n - 1) for p in parity)
    for lost in range(n):
        inputs = [decode_segments(None if j == lost else data[j],
                                  None if j == lost else parity[j], j, lost, n, length)
                  for j in range(n)]
        got = reduce_scatter_xor(inputs, n)
        rebuilt = reassemble({r: got[r] for r in range(n) if r != lost}, lost, n)
        files = unpack(rebuilt, [f.numel() for f in members[lost]])
        assert all(torch.equal(a, b) for a, b in zip(files, members[lost])), lost
        # The replacement's segment is its parity chunk, rebuilt too.
        assert torch.equal(got[lost], parity[lost])


def test_every_chunk_of_a_member_is_in_exactly_one_other_members_parity():
    for n in range(2, 9):
        for j in range(n):
            assert sorted(chunk_index(r, j, n) for r in range(n) if r != j) == list(range(n - 1))
    with pytest.raises(ValueError, match="holds no chunk of its own data"):
        chunk_index(2, 2, 4)


def test_a_flipped_bit_in_one_parity_chunk_changes_only_the_chunk_it_rebuilds():
    """What a damaged parity chunk does (so a check after decoding finds it): the rebuilt data
    differs exactly in the chunk that parity chunk holds."""
    n = 4
    members = _members(n, seed=11)
    length = common_length([sum(f.numel() for f in files) for files in members], n)
    data = [pack(files, length) for files in members]
    parity = reduce_scatter_xor([encode_segments(d, j, n) for j, d in enumerate(data)], n)
    lost, damaged = 1, 3
    parity[damaged] = parity[damaged].clone()
    parity[damaged][5] ^= 0x10
    got = reduce_scatter_xor([decode_segments(None if j == lost else data[j],
                                              None if j == lost else parity[j], j, lost, n,
                                              length) for j in range(n)], n)
    rebuilt = reassemble({r: got[r] for r in range(n) if r != lost}, lost, n)
    chunk = length // (n - 1)
    bad = (rebuilt != data[lost]).nonzero().flatten().tolist()
    assert bad == [chunk_index(damaged, lost, n) * chunk + 5]


def test_inputs_that_do_not_fit_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="a parity set needs at least 2 members"):
        common_length([10], 1)
    with pytest.raises(ValueError, match="pad them to common_length"):
        encode_segments(torch.zeros(12, dtype=torch.uint8), 0, 3)
    with pytest.raises(ValueError, match="do not fit in 8"):
        pack([torch.zeros(9, dtype=torch.uint8)], 8)
    with pytest.raises(ValueError, match="the chunks of members \\[2\\] are missing"):
        reassemble({1: torch.zeros(8, dtype=torch.uint8)}, 0, 3)


@pytest.mark.timeout(300)
def test_gloo_reduce_scatter_with_xor_encodes_and_decodes_as_the_reference():
    """Under torchrun, 4 ranks: ``reduce_scatter_tensor`` with ``ReduceOp.BXOR`` over int64
    words gives every rank its parity chunk, then rebuilds rank 2's data after it is 'lost'
    (its process puts in zeros), bitwise as the reference computes it."""
    out = run_torchrun("parity_worker.py", nproc=4, timeout=240)
    for rank in range(4):
        assert f"RANK {rank} PARITY OK" in out, out[-4000:]
        assert f"RANK {rank} REBUILT OK" in out, out[-4000:]
