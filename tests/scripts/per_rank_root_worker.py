"""torchrun worker: opens a store whose tier path differs per rank ({rank}); prints the error.

Used by tests/test_multirank.py: this version commits with one rename by the coordinator, so a
per-rank tier must be refused at open, before anything is written, on every rank."""

import os
import sys

import torch.distributed as dist

import tierstore


def main() -> None:
    dist.init_process_group("gloo")
    root = sys.argv[1]
    try:
        tierstore.open({"tier": [{"name": "nvme", "backend": "local", "path": root + "/{rank}"}]})
    except tierstore.ConfigError as exc:
        print(f"RANK {os.environ['RANK']} CONFIGERROR {exc}", flush=True)
    else:
        print(f"RANK {os.environ['RANK']} OPENED", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
