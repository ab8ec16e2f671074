"""torchrun worker (1 node x 2 ranks) for tests/test_attack_rank_messages.py: a rank that sends
the others a pickle does not run code on them.

    torchrun --nproc-per-node=2 attack_rank_messages_worker.py ROOT

Both ranks open a store of one local tier, a directory per rank (so that a load starts by
gathering what every rank holds), and save ``step-1``. Then rank 1 turns hostile: every
exchange of the store's own collectives it takes part in carries, in place of what tierstore
meant to send, the pickle of an object whose ``__reduce__`` creates ``ROOT/marker-<n>`` (through
``os.system``). It does so at the lowest level tierstore reaches: the bytes of a typed message
(``encode_message`` as the collectives module calls it) and the object torch would pickle (the
``torch.distributed`` functions the collectives module calls). Rank 0 then calls
``store.latest()`` and ``dcp.load`` through ``store.reader()``; each must raise an error that
names rank 1, printed as ``RANK 0 <call> REFUSED <class>: <message>`` (``TOOK`` when it did
not raise). Then rank 1 sends a well-formed message of the wrong shape, and rank 0's load must
raise naming rank 1 too (``RANK 0 shape REFUSED ...``). The test checks that no marker exists.
"""

from __future__ import annotations

import os
import shlex
import sys
import types
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tierstore
import tierstore.transport.collectives as collectives
from tierstore.transport.messages import encode_message
from worker_common import run_worker

warnings.filterwarnings("ignore")
problems: list[str] = []
CID = "step-1"


class Payload:
    """Unpickling it runs a shell command that creates ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.path)}",)


def turn_hostile(root: str) -> None:
    """From now on, whatever this rank sends through tierstore's collectives is a pickle of a
    :class:`Payload`, one marker per exchange."""
    import pickle

    count = iter(range(10_000))

    def payload() -> Payload:
        return Payload(os.path.join(root, f"marker-{next(count)}"))

    # Typed messages: their bytes, as the collectives module encodes them.
    collectives.encode_message = lambda obj: pickle.dumps(payload())

    # Pickling collectives: the object torch.distributed would pickle.
    def all_gather_object(out, obj, group=None):
        return dist.all_gather_object(out, payload(), group=group)

    def broadcast_object_list(box, group=None, group_src=None, **kwargs):
        if dist.get_rank(group) == group_src:
            box = [payload() for _ in box]
        return dist.broadcast_object_list(box, group=group, group_src=group_src, **kwargs)

    proxy = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist)
                                     if not n.startswith("__")})
    proxy.all_gather_object = all_gather_object
    proxy.broadcast_object_list = broadcast_object_list
    collectives.dist = proxy


def main() -> int:
    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = tierstore.open({"store": {"collective_timeout": 60},
                            "tier": [{"name": "disk", "backend": "local",
                                      "path": f"{root}/disk/{{rank}}"}]})
    pg = store.process_group
    sd = {f"r{rank}.w": torch.full((64,), float(rank)), "shared": torch.arange(8.0)}
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=CID, process_group=pg)
    store.wait()
    dist.barrier()
    if rank == 1:
        turn_hostile(root)
    calls = {"latest": store.latest,
             "load": lambda: dcp.load({k: torch.zeros_like(v) for k, v in sd.items()},
                                      storage_reader=store.reader(), checkpoint_id=CID,
                                      process_group=pg)}
    for name, call in calls.items():
        try:
            call()
            # Not a problem of the run: the test says what is wrong with it (markers first).
            print(f"RANK {rank} {name} TOOK rank 1's message", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported for the test to check
            message = " ".join(str(exc).split())
            print(f"RANK {rank} {name} REFUSED {type(exc).__name__}: {message}", flush=True)
    dist.barrier()
    if rank == 1:
        # Plain data, well formed, of the wrong shape: refused as such, naming the sender.
        collectives.encode_message = lambda obj: encode_message({"not": ["what", "was", 1]})
    try:
        calls["load"]()
        print(f"RANK {rank} shape TOOK rank 1's message", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported for the test to check
        message = " ".join(str(exc).split())
        print(f"RANK {rank} shape REFUSED {type(exc).__name__}: {message}", flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    run_worker(main, problems, "PROBLEM")
