"""torchrun worker, 4 ranks, one parity set (tests/test_parity.py): encode every rank's files
into XOR parity with one ``reduce_scatter_tensor`` (``ReduceOp.BXOR`` on int64 words) over gloo,
then rebuild rank 2's files after it is "lost" (its process puts in zeros) with another, and
compare both with the one-process reference of tierstore/format/parity.py, bit for bit. Every
rank builds every member's files from the same seeds, so each can check the reference."""

import sys

import torch
import torch.distributed as dist

from tierstore.format.parity import (common_length, decode_segments, encode_segments, pack,
                                     reassemble, reduce_scatter_xor, unpack)
from worker_common import run_worker

problems: list[str] = []
LOST = 2


def files_of(member: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + member)
    sizes = [int(s) for s in torch.randint(1, 300_000, (3,), generator=gen)]
    return [torch.randint(0, 256, (s,), dtype=torch.uint8, generator=gen) for s in sizes]


def xor_scatter(segments: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(segments.numel() // n, dtype=torch.uint8)
    dist.reduce_scatter_tensor(out.view(torch.int64), segments.view(torch.int64),
                               op=dist.ReduceOp.BXOR)
    return out


def main() -> int:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    files = [files_of(j) for j in range(n)]
    length = common_length([sum(f.numel() for f in fs) for fs in files], n)
    data = [pack(fs, length) for fs in files]
    reference = reduce_scatter_xor([encode_segments(d, j, n) for j, d in enumerate(data)], n)

    parity = xor_scatter(encode_segments(data[rank], rank, n), n)
    if torch.equal(parity, reference[rank]):
        print(f"RANK {rank} PARITY OK", flush=True)
    else:
        problems.append("the parity chunk differs from the reference")

    mine = None if rank == LOST else data[rank]
    got = xor_scatter(decode_segments(mine, None if rank == LOST else parity, rank, LOST, n,
                                      length), n)
    chunks = [torch.empty_like(got) for _ in range(n)]
    dist.all_gather(chunks, got)
    rebuilt = unpack(reassemble({r: c for r, c in enumerate(chunks) if r != LOST}, LOST, n),
                     [f.numel() for f in files[LOST]])
    if all(torch.equal(a, b) for a, b in zip(rebuilt, files[LOST])) and \
            torch.equal(chunks[LOST], reference[LOST]):
        print(f"RANK {rank} REBUILT OK", flush=True)
    else:
        problems.append("the rebuilt files of the lost rank differ")
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
