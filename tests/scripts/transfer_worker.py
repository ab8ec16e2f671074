"""torchrun worker (3 ranks) for tierstore.transport.transfer.run_transfers (tests/test_transfer.py).

Every rank writes files of awkward sizes (empty, one byte, a page, many pieces) under
ROOT/<rank>/ and sends each to the two other ranks, in pieces of one page so that a transfer
takes many more rounds than are in flight at once and every reused buffer is reused. The three
kinds of ends run in turn: a read file into a new written file (reused read and receive
buffers), a mapped file into a buffer in memory, and a recycling backend's mapped ends (the
second time into recycled pages). Each rank checks every received file byte for byte against
its sender's file and that ``sink`` saw every piece once, in order. argv: ROOT.
"""

import os
import sys

import torch.distributed as dist

from tierstore.transport.ends import BufferTarget, FileSource, MappedFile, WrittenFile
from tierstore.transport.transfer import ROUNDS_IN_FLIGHT, Transfer, run_transfers
from tierstore_plugins.local import LocalBackend
from worker_common import run_worker

problems: list[str] = []
PIECE = 4096
SIZES = {"empty": 0, "one": 1, "page": PIECE, "odd": 5 * PIECE + 13,
         "long": (3 * ROUNDS_IN_FLIGHT + 5) * PIECE + 7}


def content(rank: int, name: str, generation: int) -> bytes:
    """Bytes that differ per rank, file and generation (a stale byte shows)."""
    seed = bytes(f"{rank}:{name}:{generation};", "ascii")
    size = SIZES[name]
    return (seed * (size // len(seed) + 1))[:size]


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = sys.argv[1]
    group = dist.new_group(backend="gloo")
    peers = [(rank + 1) % world, (rank + 2) % world]
    # One recycling backend per source, as a peer tier keeps a replica tier per source.
    backends = {src: LocalBackend(os.path.join(root, "recycling", f"{src}-held-by-{rank}"),
                                  fsync=False, recycle=True) for src in peers}

    def transfers() -> list[Transfer]:
        out = [Transfer(rank, dst, name, SIZES[name]) for dst in peers for name in SIZES]
        out += [Transfer(src, rank, name, SIZES[name]) for src in peers for name in SIZES]
        return out

    def run(kind: str, generation: int, open_source, open_target, read_back) -> None:
        for name in SIZES:
            path = os.path.join(root, kind, str(generation), str(rank), name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content(rank, name, generation))
        dist.barrier(group=group)
        seen: dict[tuple[int, str], int] = {}
        targets = {}

        def opened_target(t):
            targets[(t.src, t.key)] = end = open_target(kind, generation, t)
            return end

        def sink(t, target, offset, data):
            if seen.get((t.src, t.key), 0) != offset:
                problems.append(f"{kind}: {t.key} from {t.src}: piece at {offset}, expected "
                                f"{seen.get((t.src, t.key), 0)}")
            seen[(t.src, t.key)] = offset + data.numel()
            if offset + data.numel() >= t.size:
                target.close()

        def source(t):
            return open_source(os.path.join(root, kind, str(generation), str(rank), t.key),
                               t.size)

        got = run_transfers(group, rank, transfers(), source, opened_target, sink, PIECE)
        if got != 2 * sum(SIZES.values()):
            problems.append(f"{kind}: received {got} bytes, expected {2 * sum(SIZES.values())}")
        for src in peers:
            for name in SIZES:
                want = content(src, name, generation)
                have = read_back(kind, generation, src, name, targets[(src, name)])
                if have != want:
                    problems.append(f"{kind} generation {generation}: {name} from rank {src} "
                                    f"differs ({len(have)} bytes, {len(want)} expected)")
        dist.barrier(group=group)

    def written_target(kind, generation, t):
        path = os.path.join(root, kind, str(generation), f"from-{t.src}-at-{rank}", t.key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return WrittenFile(path, t.size)

    def read_file(kind, generation, src, name, end):
        with open(os.path.join(root, kind, str(generation), f"from-{src}-at-{rank}", name),
                  "rb") as f:
            return f.read()

    run("read-to-written", 0, lambda path, size: FileSource(open(path, "rb", buffering=0)),
        written_target, read_file)
    run("mapped-to-buffer", 0, MappedFile, lambda kind, generation, t: BufferTarget(t.size),
        lambda kind, generation, src, name, end: bytes(end.data))

    def recycled_target(kind, generation, t):
        return backends[t.src].receiving_end(f"g{generation}/{t.key}", t.size)

    def recycled_read(kind, generation, src, name, end):
        return backends[src].read_bytes(f"g{generation}/{name}")

    for generation in (0, 1):  # the second receives into the first one's recycled pages
        run("recycling", generation, lambda path, size: MappedFile(path, size),
            recycled_target, recycled_read)
        for src, backend in backends.items():
            if generation == 0:
                backend.discard("g0")
                binned = sorted(int(n.rsplit("-", 1)[1]) for n in os.listdir(backend.recycler.bin))
                if binned != sorted(SIZES.values()):
                    problems.append(f"generation 0 from {src} was not recycled whole: "
                                    f"{os.listdir(backend.recycler.bin)}")
            elif os.listdir(backend.recycler.bin):
                problems.append(f"generation 1 from {src} left recycled files unused: "
                                f"{os.listdir(backend.recycler.bin)}")
    for backend in backends.values():
        backend.close()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "TRANSFER")
