"""``keep`` means keep: at rest, a node holds at most ``keep`` checkpoints per tier, plus what its
peer tier's strategy promises (replicas or parity of those same checkpoints). Every node learns
of the coordinator's commit in the save itself (tierstore.engine.notices); before, a node other
than the coordinator's kept its part of the newest save pending until the next save, and with it
the checkpoint before (tests/scripts/keep_memory_worker.py: 4 simulated nodes x 1 rank)."""

from __future__ import annotations

import re

import pytest
from helpers import run_torchrun

#: what a node may hold at rest, in units of a rank's own data of one checkpoint: one
#: checkpoint of its own plus a third of one in parity (3+1), or one replica (clique 2), or
#: nothing more (RAM); the margin is the metadata, manifests and parity's headers
PROMISED = {"erasure": 1.4, "clique": 2.05, "ram": 1.05}


@pytest.mark.timeout(300)
def test_a_node_holds_what_keep_and_its_strategy_promise_after_the_saves(tmp_path):
    out = run_torchrun("keep_memory_worker.py", tmp_path, nproc=1, nnodes=4, timeout=240)
    found = re.findall(r"RANK (\d) (\w+) HOLDS (\d+) OWN (\d+) CHECKPOINTS (\S+)", out)
    assert len(found) == 4 * len(PROMISED), out
    for rank, store, holds, own, ids in found:
        assert ids == "step-2", f"node {rank} keeps {ids} on its {store} tier with keep = 1"
        ratio = int(holds) / int(own)
        assert ratio <= PROMISED[store], \
            f"node {rank} holds {ratio:.2f}x its own state on its {store} tier"
