"""Lazy staging of DTensors changed before the copy took them (tests/test_lazy_staging.py).

    python lazy_dtensor_worker.py ROOT PORT MODE

A 1-rank gloo job: eight 32 MiB DTensors (sharded on a 1-device mesh, as FSDP2 keeps its
parameters) saved with lazy staging (MODE "lazy") or lazy staging under a budget of a quarter
("budget"), then changed in place right after ``async_save`` returns, before the copy is done.
An in-place op on a DTensor bumps the DTensor's version counter, not its local tensor's: the save
must fail with the StagingError that names the tensor, and nothing be committed. Prints
``DETECTED <message>``; fails by an exception otherwise.
"""

import os
import sys
import threading
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh  # noqa: E402

import tierstore  # noqa: E402


def main() -> None:
    root, port, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    sd = {f"w{i}": distribute_tensor(torch.full((8 << 20,), float(i)), mesh, [Shard(0)])
          for i in range(8)}
    staging = {"name": "cpu", "lazy": True}
    if mode == "budget":
        staging["max_staging_bytes"] = 8 * (32 << 20) // 4
    config = {"store": {"staging": staging},
              "tier": [{"name": "ram", "backend": "local", "path": f"{root}/ram"}]}
    with tierstore.open(config) as store:
        gate = threading.Event()  # the copy starts only once the change is made
        store._stager._worker.submit(lambda: gate.wait(60))
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1",
                              process_group=store.process_group)
        with torch.no_grad():
            sd["w7"].add_(100)  # the optimizer step, too early
        gate.set()
        try:
            resp.upload_completion.result()
        except tierstore.StagingError as exc:
            assert store.latest() is None, store.latest()
            print("DETECTED", exc, flush=True)
        else:
            raise AssertionError("a DTensor changed before its lazy copy was saved silently")
    print("STORE CLOSED", flush=True)
    dist.destroy_process_group()
    print("PROCESS GROUP DESTROYED", flush=True)


if __name__ == "__main__":
    main()
