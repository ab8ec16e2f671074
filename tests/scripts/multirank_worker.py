"""Run under ``torchrun --nproc-per-node=2`` (gloo, CPU) by tests/test_multirank.py.

Every rank opens a store whose one ``local`` tier lives in the shared directory given as argv[1],
saves a state dict mixing a DTensor sharded over a 2-rank mesh, a ShardedTensor, a replicated
tensor, per-rank tensors of many dtypes and non-tensor (BYTE_IO) items, then loads it back into
zeroed tensors of the same layout (through tierstore and through stock DCP) and checks every byte.

Prints one line per problem and exits 1 when there is any; prints "RANK <r> OK" otherwise.
"""

from __future__ import annotations

import os
import random
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

import tierstore

from worker_common import check_equal, run_worker

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

WORLD = 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool,
          torch.complex64]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)

problems: list[str] = []


def fail(msg: str) -> None:
    problems.append(msg)


def random_tensor(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(shape, generator=gen),
                             torch.randn(shape, generator=gen)).to(dtype)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen)
        if dtype in (torch.float32,):
            flat = t.view(-1)
            flat[:4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def same_bytes(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    check_equal(problems, actual, expected, name)  # dtype, shape and every byte


def build(rank: int, mesh, zero: bool) -> tuple[dict, dict]:
    """(state dict to save or load into, the expected full values of its DTensors/ShardedTensor).

    Every random value comes from fixed seeds, so the zeroed copy knows what to expect."""
    gen = torch.Generator().manual_seed(1234)
    full = {f"dt_{str(d).split('.')[-1]}": random_tensor((8, 6), d, gen) for d in DTYPES}
    # One logical tensor of 256 MiB, 128 MiB per rank.
    full["dt_big"] = random_tensor((4096, 16384), torch.float32, gen)
    replicated = random_tensor((5, 3), torch.float32, gen)
    st_full = random_tensor((8, 4), torch.float32, gen)
    rgen = torch.Generator().manual_seed(100 + rank)
    per_rank = {f"rank{rank}_{str(d).split('.')[-1]}": random_tensor((7,), d, rgen)
                for d in DTYPES}
    # Zero-size tensors, non-contiguous views (saved as their projection only) and many small
    # tensors (10,000 across the two ranks).
    per_rank[f"rank{rank}_empty"] = torch.empty(0, 3)
    per_rank[f"rank{rank}_transposed"] = random_tensor((64, 48), torch.float32, rgen).t()
    per_rank[f"rank{rank}_strided"] = random_tensor((100, 100), torch.bfloat16, rgen)[::3, 1::2]
    for i in range(5000):
        per_rank[f"rank{rank}_small{i}"] = random_tensor((4,), torch.float32, rgen)
    py_rng = random.Random(42)
    extra = {"step": 17, "rng": py_rng.getstate(), "note": "shared"}
    mine = {"rank": rank, "rng": random.Random(rank).getstate()}

    sd: dict = {}
    for name, t in full.items():
        src = torch.zeros_like(t) if zero else t
        if "float8" not in name:
            sd[name] = distribute_tensor(src, mesh, [Shard(0)])  # scatters from rank 0 (gloo)
        else:
            # gloo cannot scatter float8 ("Invalid scalar type"): each rank builds its own row
            # block and declares the layout.
            local = src.chunk(WORLD, dim=0)[rank].clone()
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    sd["replicated"] = torch.zeros_like(replicated) if zero else replicated.clone()
    for name, t in per_rank.items():
        sd[name] = torch.zeros_like(t) if zero else t.clone()
    sd["extra"] = {"step": 0, "rng": None, "note": ""} if zero else extra
    sd[f"extra_rank{rank}"] = {"rank": -1, "rng": None} if zero else mine
    st = sharded_tensor(st_full, rank, zero)
    if st is not None:
        sd["sharded"] = st
    expected = {"full": full, "replicated": replicated, "per_rank": per_rank, "extra": extra,
                "mine": mine, "st_full": st_full}
    return sd, expected


def sharded_tensor(full: torch.Tensor, rank: int, zero: bool):
    """A ShardedTensor with one row block per rank on CPU (ChunkShardingSpec over
    "rank:0/cpu", "rank:1/cpu")."""
    from torch.distributed._shard import sharded_tensor as st
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(WORLD)])
    tensor = st.zeros(spec, *full.shape)
    (shard,) = tensor.local_shards()
    if not zero:
        rows = full.shape[0] // WORLD
        shard.tensor.copy_(full[rank * rows:(rank + 1) * rows])
    return tensor


def check(sd: dict, expected: dict, rank: int, how: str) -> None:
    for name, full in expected["full"].items():
        dt = sd[name]
        if not isinstance(dt, DTensor):
            fail(f"{how}: {name} is no longer a DTensor ({type(dt).__name__})")
            continue
        same_bytes(f"{how}: {name} (local shard)", dt.to_local(),
                   full.chunk(WORLD, dim=0)[rank])
    same_bytes(f"{how}: dt_float32 (full_tensor)", sd["dt_float32"].full_tensor(),
               expected["full"]["dt_float32"])
    same_bytes(f"{how}: replicated", sd["replicated"], expected["replicated"])
    for name, t in expected["per_rank"].items():
        same_bytes(f"{how}: {name}", sd[name], t)
    if sd["extra"] != expected["extra"]:
        fail(f"{how}: extra is {sd['extra']!r:.200}, expected {expected['extra']!r:.200}")
    if sd[f"extra_rank{rank}"] != expected["mine"]:
        fail(f"{how}: extra_rank{rank} is {sd[f'extra_rank{rank}']!r:.200}")
    if "sharded" in sd:
        shards = sd["sharded"].local_shards()
        rows = expected["st_full"].shape[0] // WORLD
        if len(shards) != 1:
            fail(f"{how}: sharded has {len(shards)} local shards")
        else:
            same_bytes(f"{how}: sharded (local shard)", shards[0].tensor,
                       expected["st_full"][rank * rows:(rank + 1) * rows])


def main() -> int:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, dist.get_world_size()
    mesh = init_device_mesh("cpu", (WORLD,))
    store = tierstore.open({"tier": [{"name": "disk", "backend": "local", "path": root}]})
    pg = store.process_group

    sd, expected = build(rank, mesh, zero=False)
    # Two saves, so the second one also runs over what the first left in the shared root.
    for cid in ("step-1", "step-2"):
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=cid, process_group=pg)

    latest = store.latest()
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, latest)
    if latest != "step-2" or len(set(everyone)) != 1:
        fail(f"latest() per rank: {everyone}, expected 'step-2' on every rank")
    ids = [c.id for c in store.list()]
    if ids != ["step-2", "step-1"]:
        fail(f"list() ids: {ids}")

    if rank == 0:
        files = sorted(os.listdir(os.path.join(root, "step-2")))
        for prefix in ("__0_", "__1_"):
            if not any(f.startswith(prefix) and f.endswith(".distcp") for f in files):
                fail(f"no data file of rank {prefix[2]} in step-2: {files}")
        leftovers = [f for f in os.listdir(root) if f.startswith(".tierstore")]
        if leftovers:
            fail(f"hidden entries left after two clean saves: {leftovers}")

    for cid in ("step-1", "step-2"):
        target, _ = build(rank, mesh, zero=True)
        dcp.load(target, storage_reader=store.reader(), checkpoint_id=cid, process_group=pg)
        check(target, expected, rank, f"tierstore load {cid}")

    # Stock DCP, no tierstore: FileSystemReader on the checkpoint directory.
    target, _ = build(rank, mesh, zero=True)
    dcp.load(target, checkpoint_id=os.path.join(root, "step-2"))
    check(target, expected, rank, "stock dcp.load")

    report = store.verify("step-2")
    if not report.ok:
        fail(f"verify(step-2): {report}")

    dist.barrier()
    store.close()
    # Every rank reports; the test wants every problem of every rank in the output.
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "MISMATCH")
