"""Files moved between ranks by tierstore.transport.transfer.run_transfers (peer replicas and restores):
3 ranks under torchrun, every pair at once, transfers many rounds long, every kind of end
(tests/scripts/transfer_worker.py checks the bytes on each rank)."""

from __future__ import annotations

import pytest
from helpers import run_torchrun


@pytest.mark.timeout(200)
def test_every_file_arrives_byte_for_byte_at_every_peer(tmp_path):
    run_torchrun("transfer_worker.py", tmp_path, nproc=3)  # exits 0, every rank OK
