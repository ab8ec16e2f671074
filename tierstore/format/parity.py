"""XOR parity over a set of ranks' checkpoint files: which bytes each member puts into each
member's parity chunk, and how a lost member's bytes are put back together.

A parity set has ``n = k + 1`` members (ranks, by position ``0 .. n-1``). Member ``j``'s data
``D_j`` is its files' bytes one after another (:func:`pack`), zero-padded to the set's common
length ``L`` (:func:`common_length`: the longest member's, rounded up to whole 8-byte words in
each of ``k`` chunks). ``D_j`` is cut into ``k`` chunks of ``L / k`` bytes, and member ``r`` keeps
one parity chunk::

    P_r = XOR over j != r of chunk c(j, r) of D_j,      c(j, r) = (r - j - 1) mod n

As ``r`` runs over the members other than ``j``, ``c(j, r)`` runs over ``0 .. k-1``: every chunk
of ``D_j`` is in exactly one other member's parity chunk. Parity costs each member ``L / k``
bytes (``1 / k`` of a checkpoint, where a replica costs a whole one), and a lost member ``x`` is
rebuilt from the others::

    chunk c(x, r) of D_x = P_r XOR (XOR over j not in {r, x} of chunk c(j, r) of D_j)

Both are one reduce-scatter with XOR over the set (gloo's ``ReduceOp.BXOR`` on int64 words):
each member's input is ``n`` segments of ``L / k`` bytes (:func:`encode_segments`,
:func:`decode_segments`; the lost member's replacement puts in zeros), and segment ``r`` of the
XOR of all inputs lands on member ``r`` (:func:`reduce_scatter_xor` computes the same in one
process: the reference the collective is checked against). :func:`reassemble` puts ``D_x`` back
together from the chunks the survivors got, :func:`unpack` cuts it into files.

Plain functions on uint8 tensors, no collectives: the replication strategy moves the segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a tensor is made: `tierstore ls` loads none
    import torch

__all__ = ["chunk_index", "common_length", "pack", "unpack", "encode_segments",
           "decode_segments", "reduce_scatter_xor", "reassemble"]

_WORD = 8  # bytes XORed at once (int64)


def chunk_index(holder: int, member: int, members: int) -> int:
    """Which chunk of ``member``'s data is in ``holder``'s parity chunk (positions in a set
    of ``members``; ``holder != member``)."""
    if holder == member:
        raise ValueError(f"member {member} holds no chunk of its own data in its parity")
    return (holder - member - 1) % members


def common_length(sizes: Sequence[int], members: int) -> int:
    """The length every member's data is padded to: the longest, rounded up so that each of
    the ``members - 1`` chunks is whole 8-byte words."""
    if members < 2:
        raise ValueError(f"a parity set needs at least 2 members, not {members}")
    unit = _WORD * (members - 1)
    longest = max(sizes, default=0)
    return -(-longest // unit) * unit


def pack(files: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """``files`` (uint8 tensors) one after another, zero-padded to ``length`` bytes."""
    import torch

    out = torch.zeros(length, dtype=torch.uint8)
    at = 0
    for data in files:
        n = data.numel()
        if at + n > length:
            raise ValueError(f"files of {at + n} bytes or more do not fit in {length}")
        out[at:at + n] = data
        at += n
    return out


def unpack(data: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """The files of ``sizes`` bytes that :func:`pack` put one after another in ``data``
    (views)."""
    if sum(sizes) > data.numel():
        raise ValueError(f"files of {sum(sizes)} bytes are not in {data.numel()} bytes")
    out, at = [], 0
    for n in sizes:
        out.append(data[at:at + n])
        at += n
    return out


def _chunks(data: torch.Tensor, members: int) -> list[torch.Tensor]:
    k = members - 1
    if data.numel() % (_WORD * k):
        raise ValueError(f"{data.numel()} bytes are not {k} chunks of whole 8-byte words: "
                         f"pad them to common_length()")
    return list(data.view(k, -1))


def encode_segments(data: torch.Tensor, position: int, members: int) -> torch.Tensor:
    """Member ``position``'s input to the encoding reduce-scatter: segment ``r`` is the chunk
    of its ``data`` (padded to the common length) in member ``r``'s parity; its own segment is
    zeros."""
    import torch

    chunks = _chunks(data, members)
    out = torch.zeros(members, chunks[0].numel(), dtype=torch.uint8)
    for r in range(members):
        if r != position:
            out[r] = chunks[chunk_index(r, position, members)]
    return out.view(-1)


def decode_segments(data: torch.Tensor | None, parity: torch.Tensor | None, position: int,
                    lost: int, members: int, length: int) -> torch.Tensor:
    """Member ``position``'s input to the reduce-scatter that rebuilds member ``lost``: a
    survivor gives what it gave to the encoding (the chunk of its ``data`` in each other
    member's parity) with its own ``parity`` in its own segment; the lost member's replacement
    (``position == lost``) gives zeros. Segment ``r`` of the XOR is then chunk
    ``chunk_index(r, lost)`` of the lost data, and on the replacement its parity chunk,
    rebuilt."""
    import torch

    chunk = length // (members - 1)
    if position == lost:
        return torch.zeros(members * chunk, dtype=torch.uint8)
    if data is None or parity is None or parity.numel() != chunk:
        raise ValueError("a surviving member gives its data and its parity chunk")
    chunks = _chunks(data, members)
    out = torch.zeros(members, chunk, dtype=torch.uint8)
    for r in range(members):
        out[r] = parity if r == position else chunks[chunk_index(r, position, members)]
    return out.view(-1)


def reduce_scatter_xor(inputs: Sequence[torch.Tensor], members: int) -> list[torch.Tensor]:
    """What a reduce-scatter with XOR over the set gives each member: segment ``r`` of the XOR
    of every member's input (the reference the collective is checked against)."""
    import torch

    total = torch.zeros_like(inputs[0]).view(torch.int64)
    for one in inputs:
        total.bitwise_xor_(one.view(torch.int64))
    return [s.view(torch.uint8) for s in total.view(members, -1)]


def reassemble(got: dict[int, torch.Tensor], lost: int, members: int) -> torch.Tensor:
    """The lost member's padded data from the chunk each survivor ``r`` got (``got[r]``:
    chunk ``chunk_index(r, lost)`` of it)."""
    import torch

    missing = sorted(set(range(members)) - {lost} - set(got))
    if missing:
        raise ValueError(f"the chunks of members {missing} are missing")
    k = members - 1
    chunk = next(iter(got.values())).numel()
    out = torch.empty(k, chunk, dtype=torch.uint8)
    for r, data in got.items():
        if r != lost:
            out[chunk_index(r, lost, members)] = data
    return out.view(-1)
