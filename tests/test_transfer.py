"""Files moved between ranks by tierstore.transfer.run_transfers (peer replicas and restores):
3 ranks under torchrun, every pair at once, transfers many rounds long, every kind of end
(tests/scripts/transfer_worker.py checks the bytes on each rank)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_multirank import run_torchrun

WORKER = Path(__file__).resolve().parent / "scripts" / "transfer_worker.py"


@pytest.mark.timeout(200)
def test_every_file_arrives_byte_for_byte_at_every_peer(tmp_path):
    proc = run_torchrun(WORKER, str(tmp_path), nproc=3)
    output = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-20000:]}"
    assert proc.returncode == 0, output
    for rank in range(3):
        assert f"RANK {rank} OK" in proc.stdout, output
