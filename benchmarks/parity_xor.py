"""XOR parity over a set of ranks: gloo's reduce-scatter with ``ReduceOp.BXOR`` against moving
the chunks with an all-to-all and XORing them here, beside the raw all-to-all and a memory copy
of the same bytes, in one run.

Why
---
A parity set of ``n = k + 1`` ranks keeps, on each member, the XOR of one chunk of every other
member's files (tierstore/format/parity.py): ``1 / k`` of a checkpoint where a replica costs a
whole one. Two ways compute it over torch.distributed with no protocol of our own:

``reduce-scatter``  one ``reduce_scatter_tensor(op=BXOR)`` of int64 words: gloo moves and XORs
``all-to-all+xor``  ``all_to_all_single`` sends each member the chunks its parity covers, then
                    ``torch.bitwise_xor`` folds the ``k`` of them here

Both move about ``L`` bytes in and out of every rank (``L``: one member's files). The baselines:
``all-to-all``, the same exchange with no XOR (what the network part costs), and ``copy``, one
memory copy of ``L`` bytes (what a replica's receive into recycled pages is bounded by).

Run (under torchrun, one parity set of all the ranks; every "node" here shares 2 cores)::

    .venv/bin/python -m torch.distributed.run --nproc-per-node=4 benchmarks/parity_xor.py
    .venv/bin/python -m torch.distributed.run --nproc-per-node=4 benchmarks/parity_xor.py --mib 64

Rank 0 prints the medians of the slowest rank, and each method's result is checked against the
one-process reference before any figure is printed.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from tierstore.format.parity import common_length, encode_segments, reduce_scatter_xor

from harness import max_over_ranks, parser, rotated


def reduce_scatter(segments: torch.Tensor, n: int) -> torch.Tensor:
    """Parity by one reduce-scatter with XOR."""
    out = torch.empty(segments.numel() // n, dtype=torch.uint8)
    dist.reduce_scatter_tensor(out.view(torch.int64), segments.view(torch.int64),
                               op=dist.ReduceOp.BXOR)
    return out


def all_to_all_xor(segments: torch.Tensor, n: int) -> torch.Tensor:
    """Parity by an all-to-all of the segments, then XOR here."""
    got = torch.empty_like(segments)
    dist.all_to_all_single(got, segments)
    words = got.view(torch.int64).view(n, -1)
    out = words[0].clone()
    for r in range(1, n):
        out.bitwise_xor_(words[r])
    return out.view(torch.uint8)


def all_to_all(segments: torch.Tensor, n: int) -> torch.Tensor:
    """The exchange alone (no XOR)."""
    got = torch.empty_like(segments)
    dist.all_to_all_single(got, segments)
    return got


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--mib", type=int, default=32, help="each rank's files, MiB (32)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (5, after 1 warm-up)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    length = common_length([args.mib << 20], n)

    def data_of(member: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(member)
        return torch.randint(0, 256, (length,), dtype=torch.uint8, generator=gen)

    mine = data_of(rank)
    segments = encode_segments(mine, rank, n)
    expected = reduce_scatter_xor([encode_segments(data_of(j), j, n) for j in range(n)], n)[rank]
    for name, method in (("reduce-scatter", reduce_scatter), ("all-to-all+xor", all_to_all_xor)):
        if not torch.equal(method(segments, n), expected):
            raise SystemExit(f"{name} computed the wrong parity on rank {rank}")
    destination = torch.empty_like(mine)
    destination.copy_(mine)  # touched: a copy into pages already there, as recycling gives
    methods = {"reduce-scatter": lambda: reduce_scatter(segments, n),
               "all-to-all+xor": lambda: all_to_all_xor(segments, n),
               "all-to-all": lambda: all_to_all(segments, n),
               "copy": lambda: destination.copy_(mine)}
    times: dict[str, list[float]] = {m: [] for m in methods}
    for rnd in range(args.rounds + 1):
        for name in rotated(list(methods), rnd):
            dist.barrier()
            started = time.perf_counter()
            methods[name]()
            took = max_over_ranks([time.perf_counter() - started])[0]
            if rnd:  # round 0 warms up
                times[name].append(took)
    if rank == 0:
        copy = statistics.median(times["copy"])
        print(f"XOR parity over {n} ranks ({n - 1}+1), {args.mib} MiB per rank, parity "
              f"{length // (n - 1) / (1 << 20):.1f} MiB per rank; slowest rank, median of "
              f"{args.rounds} rounds")
        print(f"{'method':16} {'seconds':>8} {'GB/s of files':>14} {'x copy':>8}")
        for name, ts in times.items():
            s = statistics.median(ts)
            print(f"{name:16} {s:8.3f} {length / s / 1e9:14.2f} {s / copy:7.1f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
