"""A rank cannot run code on another through the store's own exchanges: what ranks send each
other is plain data (``tierstore.transport.messages``), never a pickle, and a message that is
not what the exchange expects is refused with an error that names the rank that sent it."""

from __future__ import annotations

import re

import pytest

from helpers import run_torchrun

WORKER = "attack_rank_messages_worker.py"


@pytest.mark.timeout(300)
def test_a_rank_sending_a_pickle_runs_nothing_on_the_others(tmp_path):
    out = run_torchrun(WORKER, str(tmp_path), timeout=240)
    markers = sorted(p.name for p in tmp_path.glob("marker-*"))
    assert markers == [], f"rank 1's pickle ran on another rank ({markers}):\n{out}"
    refused = dict(re.findall(r"^RANK 0 (\w+) REFUSED (.*)$", out, re.M))
    assert set(refused) == {"latest", "load", "shape"}, out
    for call, message in refused.items():
        assert message.startswith("MessageError: rank 1 sent a"), f"{call}: {message}"
        assert "every rank of a job must run the same tierstore" in message, f"{call}: {message}"
