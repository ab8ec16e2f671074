"""A budgeted staging of a state dict with a ShardedTensor (FSDP1's sharded state dict), in a
1-rank gloo job (tests/test_lazy_staging.py).

    python budget_sharded_worker.py ROOT PORT

The budget lies between the plain tensors' bytes and the whole state's: the ShardedTensor is
copied whole, outside the waves, and the plain tensors go in waves. Saves twice (the state
changed in between), loads both back and compares them bit for bit. Prints ``SHARDED OK``.
"""

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed._shard.sharded_tensor import (Shard, ShardMetadata,  # noqa: E402
                                                     init_from_local_shards)

import tierstore  # noqa: E402


def sharded(values: torch.Tensor):
    meta = ShardMetadata([0], [values.numel()], "rank:0/cpu")
    return init_from_local_shards([Shard(values, meta)], [values.numel()])


def main() -> None:
    root, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    sd = {"st": sharded(torch.arange(1 << 20, dtype=torch.float32)),  # 4 MiB
          **{f"w{i}": torch.full((1 << 18,), float(i)) for i in range(4)}}  # 4 x 1 MiB
    staging = {"name": "cpu", "lazy": True, "max_staging_bytes": 6 << 20}
    config = {"store": {"staging": staging},
              "tier": [{"name": "ram", "backend": "local", "path": f"{root}/ram"}]}
    expected = {}
    with tierstore.open(config) as store:
        for step in range(2):
            resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}",
                                  process_group=store.process_group)
            resp.staging_completion.result()
            expected[step] = {"st": sd["st"].local_shards()[0].tensor.clone(),
                              **{k: v.clone() for k, v in sd.items() if k != "st"}}
            with torch.no_grad():
                sd["st"].local_shards()[0].tensor.add_(1)
                for k in expected[step]:
                    if k != "st":
                        sd[k].add_(1)
            resp.upload_completion.result()
        for step in range(2):
            out = {"st": sharded(torch.zeros(1 << 20)),
                   **{f"w{i}": torch.zeros(1 << 18) for i in range(4)}}
            dcp.load(out, storage_reader=store.reader(), checkpoint_id=f"step-{step}",
                     process_group=store.process_group)
            got = out["st"].local_shards()[0].tensor
            assert torch.equal(got, expected[step]["st"]), f"step-{step}: st differs"
            for i in range(4):
                assert torch.equal(out[f"w{i}"], expected[step][f"w{i}"]), f"step-{step}: w{i}"
    dist.destroy_process_group()
    print("SHARDED OK", flush=True)


if __name__ == "__main__":
    main()
