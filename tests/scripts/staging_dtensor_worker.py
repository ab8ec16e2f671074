"""One process on a one-rank gloo group: the staging buffers' walk of DTensors (as FSDP2 keeps
them, in an OrderedDict as ``model.state_dict()`` returns) copies every local shard bitwise on
every save, keeps the OrderedDict, and refuses a DTensor whose placement changed while its
local shape stayed (the buffer's spec would describe the checkpoint wrongly). Prints ``OK``."""

import collections
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

from tierstore_plugins.staging_buffers import StagingBuffers, describe_state_dict


def main() -> int:
    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0,
                                world_size=1)
        try:
            return check(init_device_mesh("cpu", (1,)))
        finally:
            dist.destroy_process_group()


def check(mesh) -> int:
    model = collections.OrderedDict(
        (f"w{i}", distribute_tensor(torch.randn(4, i + 1), mesh, [Shard(0)])) for i in range(5))
    sd = {"model": model,
          "optim": {"state": {k: {"step": torch.tensor(1.0),
                                  "exp_avg": distribute_tensor(torch.randn(4, i + 1), mesh,
                                                               [Shard(0)])}
                              for i, k in enumerate(model)}}}
    buffers = StagingBuffers(sd, describe_state_dict(sd), pin=False, share=False)
    for save in range(3):
        staged = buffers.stage(sd, non_blocking=False)
        assert staged is not None, f"save {save}: the same layout was refused"
        assert type(staged["model"]) is collections.OrderedDict, type(staged["model"])
        for key, value in model.items():
            assert staged["model"][key]._local_tensor.data_ptr() != value._local_tensor.data_ptr()
            assert torch.equal(staged["model"][key]._local_tensor, value._local_tensor), key
            assert staged["model"][key].placements == value.placements
            state = sd["optim"]["state"][key]
            mine = staged["optim"]["state"][key]
            assert torch.equal(mine["exp_avg"]._local_tensor, state["exp_avg"]._local_tensor)
            assert torch.equal(mine["step"], state["step"])
        with torch.no_grad():  # a training step between saves
            for value in model.values():
                value._local_tensor.add_(1)
            for state in sd["optim"]["state"].values():
                state["step"].add_(1)
    moved = dict(sd, model=collections.OrderedDict(model))
    moved["model"]["w2"] = DTensor.from_local(model["w2"]._local_tensor, mesh, [Replicate()])
    assert buffers.stage(moved, non_blocking=False) is None, "a changed placement was staged"
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
