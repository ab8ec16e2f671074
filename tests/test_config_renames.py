"""Renamed config keys keep working, with a warning that names the new key."""

from __future__ import annotations

import pytest

import tierstore
from tierstore import ConfigError


def _config(tmp_path, **store):
    return {"store": store, "tier": [{"name": "disk", "backend": "local",
                                      "path": str(tmp_path / "disk")}]}


def test_drain_chunk_mib_still_works_and_says_copy_chunk_mib(tmp_path):
    with pytest.warns(DeprecationWarning, match="rename it to 'copy_chunk_mib'"):
        store = tierstore.open(_config(tmp_path, drain_chunk_mib=2))
    with store:
        assert store._ctx.config.copy_chunk_mib == 2


def test_both_names_at_once_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="both 'drain_chunk_mib' and 'copy_chunk_mib'"):
        tierstore.open(_config(tmp_path, drain_chunk_mib=2, copy_chunk_mib=4))
