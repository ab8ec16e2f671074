"""The built-in backends ``local``, ``memory`` and ``peer`` pass the conformance kit, like any
plugin (``peer``'s round trips need several ranks: tests/test_peer.py).

Both declare ``supports_rename = True`` and have local paths, so they use the rename and
stock-loadable classes.
"""

from __future__ import annotations

import pytest

from tierstore.plugin.host import build_plugin_host
from tierstore_conformance import RenameBackendTests, StockLoadableRoundTripTests


def _backend(name: str, root):
    """Build a registered backend the way the core does (factory called with root and path)."""
    reg = build_plugin_host().lookup("backend", name)
    return reg.factory(root=str(root), path=str(root))


class _BuiltinBackend(RenameBackendTests):
    backend_name: str

    @pytest.fixture(params=["missing root", "existing root"])
    def backend(self, request, tmp_path):
        root = tmp_path / "tier"
        if request.param == "existing root":
            root.mkdir()
        backend = _backend(self.backend_name, root)
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, tmp_path):
        """A root under a regular file: no directory can be made there."""
        blocker = tmp_path / "a-file"
        blocker.write_bytes(b"not a directory")
        backend = _backend(self.backend_name, blocker / "tier")
        yield backend
        backend.close()


class TestLocalBackend(_BuiltinBackend):
    backend_name = "local"


class TestMemoryBackend(_BuiltinBackend):
    backend_name = "memory"


class TestPeerBackend(_BuiltinBackend):
    backend_name = "peer"


class TestLocalRoundTrip(StockLoadableRoundTripTests):
    @pytest.fixture
    def store_config(self, tmp_path):
        return {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}


class TestMemoryRoundTrip(StockLoadableRoundTripTests):
    @pytest.fixture
    def store_config(self, tmp_path):
        return {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "shm")}]}
