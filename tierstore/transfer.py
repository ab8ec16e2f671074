"""Moving files between ranks over torch.distributed (gloo), for peer replicas and restores.

Every rank of a group calls :func:`run_transfers` with the transfers it takes part in (which
file goes from which rank to which); the two ranks of a pair must list that pair's transfers
alike, in the same order. Files travel
as uint8 tensors in pieces of at most ``piece_bytes``: in round ``k`` every pair of ranks moves
its ``k``-th piece, all sends and receives of the round posted at once (non-blocking, so no
order of ranks can deadlock) and waited for before the next round. What a rank receives goes to
``sink`` (in a thread of its own, so writing piece ``k`` overlaps receiving piece ``k+1``).
"""

from __future__ import annotations

import pickle
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Transfer", "run_transfers", "exchange_objects"]


@dataclass(frozen=True)
class Transfer:
    """One file to move: from rank ``src`` to rank ``dst``, ``size`` bytes, named ``key``."""

    src: int
    dst: int
    key: str
    size: int


@dataclass(frozen=True)
class _Piece:
    transfer: Transfer
    offset: int
    length: int


def _rounds(transfers: list[Transfer], piece_bytes: int) -> list[list[_Piece]]:
    """Round ``k`` holds the ``k``-th piece of every (src, dst) pair's sequence of pieces."""
    per_pair: dict[tuple[int, int], list[_Piece]] = {}
    for t in transfers:
        pieces = per_pair.setdefault((t.src, t.dst), [])
        for offset in range(0, t.size, piece_bytes):
            pieces.append(_Piece(t, offset, min(piece_bytes, t.size - offset)))
    depth = max((len(p) for p in per_pair.values()), default=0)
    return [[p[k] for p in per_pair.values() if k < len(p)] for k in range(depth)]


def run_transfers(group: Any, rank: int, transfers: list[Transfer],
                  open_source: Callable[[Transfer], IO[bytes]],
                  sink: Callable[[Transfer, int, torch.Tensor], None],
                  piece_bytes: int = 64 << 20) -> int:
    """Collective on ``group``: move every transfer; return the bytes this rank received.

    ``open_source(t)`` opens ``t``'s file on its sending rank; ``sink(t, offset, data)`` gets
    each received piece, in order, on the receiving rank (``data`` is empty for an empty file).
    Ranks are ranks of ``group``."""
    received = 0
    sources: dict[Transfer, IO[bytes]] = {}
    for t in transfers:
        if t.dst == rank and t.size == 0:
            sink(t, 0, torch.empty(0, dtype=torch.uint8))
    writer = ThreadPoolExecutor(1, thread_name_prefix="tierstore-transfer-sink")
    pending_sink: Future | None = None
    try:
        for pieces in _rounds(transfers, piece_bytes):
            works, inbox = [], []
            for p in pieces:
                t = p.transfer
                if t.src == rank:
                    f = sources.get(t)
                    if f is None:
                        f = sources[t] = open_source(t)
                    buf = torch.empty(p.length, dtype=torch.uint8)
                    f.seek(p.offset)
                    if f.readinto(memoryview(buf.numpy())) != p.length:
                        raise OSError(f"{t.key}: short read at offset {p.offset}")
                    works.append(dist.isend(buf, group_dst=t.dst, group=group))
                elif t.dst == rank:
                    buf = torch.empty(p.length, dtype=torch.uint8)
                    works.append(dist.irecv(buf, group_src=t.src, group=group))
                    inbox.append((p, buf))
            for w in works:
                w.wait()
            if pending_sink is not None:
                pending_sink.result()
            if inbox:
                pending_sink = writer.submit(_deliver, sink, inbox)
                received += sum(p.length for p, _ in inbox)
        if pending_sink is not None:
            pending_sink.result()
    finally:
        writer.shutdown(wait=True)
        for f in sources.values():
            f.close()
    return received


def _deliver(sink: Callable[[Transfer, int, torch.Tensor], None],
             inbox: list[tuple[_Piece, torch.Tensor]]) -> None:
    for p, buf in inbox:
        sink(p.transfer, p.offset, buf)


def exchange_objects(group: Any, send_to: dict[int, Any], recv_from: list[int]) -> dict[int, Any]:
    """Point-to-point, pickled: send ``send_to[dst]`` to each ``dst`` and receive one object
    from each rank of ``recv_from`` (every sender must list this rank). Non-blocking both ways."""
    raws = {dst: torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            for dst, obj in send_to.items()}
    sizes = {src: torch.zeros(1, dtype=torch.int64) for src in recv_from}
    works = [dist.isend(torch.tensor([len(raw)], dtype=torch.int64), group_dst=dst, group=group)
             for dst, raw in raws.items()]
    works += [dist.irecv(sizes[src], group_src=src, group=group) for src in recv_from]
    for w in works:
        w.wait()
    bufs = {src: torch.empty(int(sizes[src].item()), dtype=torch.uint8) for src in recv_from}
    works = [dist.isend(raw, group_dst=dst, group=group) for dst, raw in raws.items()]
    works += [dist.irecv(bufs[src], group_src=src, group=group) for src in recv_from]
    for w in works:
        w.wait()
    return {src: pickle.loads(bufs[src].numpy().tobytes()) for src in recv_from}
