"""The built-in plugins pass the conformance kit, like any plugin: backends ``local``, ``memory``
and ``peer`` (``peer``'s round trips need several ranks: tests/test_peer.py), codec ``zstd``,
stagers ``cpu`` / ``pinned`` / ``shm``, replication strategies ``clique`` and ``ring``, commit
protocols ``atomic`` and ``manifest-last``, and the stats observer behind ``store.stats()``.

The backends declare ``supports_rename = True`` and have local paths, so they use the rename and
stock-loadable classes.
"""

from __future__ import annotations

import sys
import uuid

import fsspec
import pytest

# Detailed assertion messages from the kit's own asserts (possible only before its import).
if "tierstore_conformance" not in sys.modules:
    pytest.register_assert_rewrite("tierstore_conformance")

from tierstore.plugin.host import build_plugin_host
from tierstore_conformance import (CodecTests, CommitProtocolTests, ObserverTests,
                                   RenameBackendTests, ReplicationStrategyTests, StagerTests,
                                   StockLoadableRoundTripTests)


def _backend(name: str, root):
    """Build a registered backend the way the core does (factory called with root and path)."""
    reg = build_plugin_host().lookup("backend", name)
    return reg.factory(root=str(root), path=str(root))


def _build(kind: str, name: str, **options):
    """Build a registered plugin of ``kind`` the way the core does (factory with options)."""
    reg = build_plugin_host().lookup(kind, name)
    assert reg is not None, f"no {kind} named {name!r}"
    return reg.factory(**options)


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


# -- codec -----------------------------------------------------------------------------------

class TestZstdCodec(CodecTests):
    """``zstd`` at its default and several levels, and with compression threads."""

    @pytest.fixture(params=[{}, {"level": 1}, {"level": 9}, {"level": -5}, {"threads": 2}],
                    ids=["default", "level 1", "level 9", "level -5", "2 threads"])
    def codec(self, request):
        return _build("codec", "zstd", **request.param)


# -- staging ---------------------------------------------------------------------------------

class _BuiltinStager(StagerTests):
    """A built-in stager, built through the plugin host."""

    staging: str

    @pytest.fixture
    def stager(self):
        return _build("staging", self.staging)


class TestCpuStager(_BuiltinStager):
    staging = "cpu"


class TestPinnedStager(_BuiltinStager):
    staging = "pinned"  # page-locked where CUDA is available, pageable (with a warning) elsewhere


class TestShmStager(_BuiltinStager):
    staging = "shm"


class TestLazyCpuStager(_BuiltinStager):
    """``cpu`` with ``lazy = true``: start() returns before the copy; stage() stays eager."""

    @pytest.fixture
    def stager(self):
        return _build("staging", "cpu", lazy=True)


# -- replication -----------------------------------------------------------------------------

class TestCliqueFactor2Jump1(ReplicationStrategyTests):
    """Pairs of neighbouring ranks."""

    @pytest.fixture
    def strategy(self):
        return _build("replication", "clique", factor=2, jump=1)

    @pytest.fixture
    def world_sizes(self):
        return [2, 4, 6, 8, 16]

    @pytest.fixture
    def bad_world_sizes(self):
        return [1, 3, 5, 7]


class TestCliqueFactor2Jump2(ReplicationStrategyTests):
    """Pairs two ranks apart (two GPUs per node: copies on the other node)."""

    @pytest.fixture
    def strategy(self):
        return _build("replication", "clique", factor=2, jump=2)

    @pytest.fixture
    def world_sizes(self):
        return [4, 8, 12]

    @pytest.fixture
    def bad_world_sizes(self):
        return [1, 2, 3, 6, 10]


class TestCliqueFactor3Jump4(ReplicationStrategyTests):
    """Triples four ranks apart."""

    @pytest.fixture
    def strategy(self):
        return _build("replication", "clique", factor=3, jump=4)

    @pytest.fixture
    def world_sizes(self):
        return [12, 24]

    @pytest.fixture
    def bad_world_sizes(self):
        return [4, 8, 16]


class TestRingOffset1(ReplicationStrategyTests):
    """Each copy on the next rank."""

    @pytest.fixture
    def strategy(self):
        return _build("replication", "ring")

    @pytest.fixture
    def world_sizes(self):
        return [2, 3, 4, 7, 8]

    @pytest.fixture
    def bad_world_sizes(self):
        return [1]


class TestRingOffset4(ReplicationStrategyTests):
    """Each copy four ranks further (refused where 4 wraps back to the rank itself)."""

    @pytest.fixture
    def strategy(self):
        return _build("replication", "ring", offset=4)

    @pytest.fixture
    def world_sizes(self):
        return [3, 5, 8, 12]

    @pytest.fixture
    def bad_world_sizes(self):
        return [1, 2, 4]


# -- commit protocols --------------------------------------------------------------------------

class _OverLocal(CommitProtocolTests):
    """A protocol over the built-in ``local`` backend."""

    @pytest.fixture
    def backend(self, tmp_path):
        backend = _backend("local", tmp_path / "tier")
        yield backend
        backend.close()


class TestAtomicCommitOverLocal(_OverLocal):
    """``atomic`` on its home backend."""

    @pytest.fixture
    def protocol(self):
        return _build("commit", "atomic")


class TestManifestLastCommitOverLocal(_OverLocal):
    """``manifest-last`` chosen by ``[store] commit`` for a local tier."""

    @pytest.fixture
    def protocol(self):
        return _build("commit", "manifest-last")


class TestManifestLastCommitOverFsspecMemory(CommitProtocolTests):
    """The protocol's home: a backend without rename (deletes are marked, not moved aside)."""

    @pytest.fixture
    def backend(self):
        name = f"commit-{uuid.uuid4().hex[:12]}"
        backend = build_plugin_host().lookup("backend", "fsspec").factory(
            root=f"memory://{name}/tier", url=f"memory://{name}/tier", options={})
        yield backend
        backend.close()
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)

    @pytest.fixture
    def protocol(self):
        return _build("commit", "manifest-last")


# -- observer ----------------------------------------------------------------------------------

class TestStatsObserver(ObserverTests):
    """The observer behind ``store.stats()``: a store builds its own; a second one passed in
    ``plugins=`` must count the same saves and loads."""

    @pytest.fixture
    def observer(self):
        from tierstore.engine.stats import TierStats
        return TierStats()

    def test_counts_the_saves_and_loads(self, observer, store_config):
        """Beyond the kit: the figures it keeps match what the store did."""
        self.save_and_load(store_config, [observer])
        figures = observer.figures["nvme"]
        assert (figures.saves, figures.loads, figures.failures) == (2, 2, 0), figures
        assert figures.bytes_saved > 2 * (4 << 20) and figures.bytes_loaded > 2 * (4 << 20)
