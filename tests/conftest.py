"""Shared fixtures: tier roots in pytest's tmp_path and a helper to open a store on them."""

from __future__ import annotations

import os
import warnings

import pytest

import tierstore

# DCP warns on every single-process save/load; the tests do that on purpose.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def local_config(tmp_path):
    """A one-tier config (`local` backend) rooted in a fresh directory."""
    return {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}


@pytest.fixture
def store(local_config):
    """An open store with one `local` tier; closed after the test."""
    with tierstore.open(local_config) as s:
        yield s
