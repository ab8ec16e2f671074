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
    rounds = _rounds(transfers, piece_bytes)
    # Two sets of send buffers, reused: round k+1's pieces are read from disk while round k
    # is on the wire (fresh tensors per piece cost a page fault per 4 KiB).
    send_pools: list[dict[int, torch.Tensor]] = [{}, {}]

    def read_round(k: int) -> list[tuple[_Piece, torch.Tensor]]:
        out = []
        for i, p in enumerate(q for q in rounds[k] if q.transfer.src == rank):
            t = p.transfer
            pool = send_pools[k % 2]
            buf = pool.get(i)
            if buf is None or buf.numel() < p.length:
                buf = pool[i] = torch.empty(piece_bytes, dtype=torch.uint8)
            view = buf[:p.length]
            f = sources.get(t)
            if f is None:
                f = sources[t] = open_source(t)
            f.seek(p.offset)
            if f.readinto(memoryview(view.numpy())) != p.length:
                raise OSError(f"{t.key}: short read at offset {p.offset}")
            out.append((p, view))
        return out

    helper = ThreadPoolExecutor(2, thread_name_prefix="tierstore-transfer")
    pending_sink: Future | None = None
    try:
        next_reads: Future | None = helper.submit(read_round, 0) if rounds else None
        for k, pieces in enumerate(rounds):
            outgoing = next_reads.result()
            next_reads = helper.submit(read_round, k + 1) if k + 1 < len(rounds) else None
            works, inbox = [], []
            for p, view in outgoing:
                works.append(dist.isend(view, group_dst=p.transfer.dst, group=group))
            for p in pieces:
                if p.transfer.dst == rank:
                    buf = torch.empty(p.length, dtype=torch.uint8)
                    works.append(dist.irecv(buf, group_src=p.transfer.src, group=group))
                    inbox.append((p, buf))
            for w in works:
                w.wait()
            if pending_sink is not None:
                pending_sink.result()
            if inbox:
                pending_sink = helper.submit(_deliver, sink, inbox)
                received += sum(p.length for p, _ in inbox)
        if pending_sink is not None:
            pending_sink.result()
    finally:
        helper.shutdown(wait=True)
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
