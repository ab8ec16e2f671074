"""torchrun worker: layouts a job cannot use are refused at open, on every rank, before anything
is written (tests/test_multirank.py). Prints one line per case and rank."""

import os
import sys

import torch.distributed as dist

import tierstore

# Whole lines in one write: the ranks share a pipe (see worker_common).
sys.stdout.reconfigure(line_buffering=True, write_through=False)


def attempt(label: str, config: dict) -> None:
    try:
        tierstore.open(config).close()
    except tierstore.ConfigError as exc:
        print(f"RANK {os.environ['RANK']} {label} CONFIGERROR {exc}", flush=True)
    else:
        print(f"RANK {os.environ['RANK']} {label} OPENED", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    root = sys.argv[1]
    # "shared = true" but every rank has its own directory.
    attempt("SHARED", {"tier": [{"name": "nvme", "backend": "local", "path": root + "/a/{rank}",
                                 "shared": True}]})
    # A node-local tier behind a shared one: no rank could fill the other ranks' directories.
    attempt("ORDER", {"tier": [{"name": "fast", "backend": "local", "path": root + "/b"},
                               {"name": "slow", "backend": "local", "path": root + "/c/{rank}"}]})
    # A directory per rank behind a shared one is fine the other way round.
    attempt("GOOD", {"tier": [{"name": "fast", "backend": "local", "path": root + "/d/{rank}"},
                              {"name": "slow", "backend": "local", "path": root + "/e"}]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
