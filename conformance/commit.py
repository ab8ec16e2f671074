"""``CommitProtocolTests``: what a commit protocol (how a checkpoint becomes visible on a backend,
all at once or not at all) must do, checked through the protocol's own methods and the
backend's primitives only.

:class:`tierstore_conformance.BackendTests` checks a backend with its default protocol through
the core's ``Tier``; this kit checks any protocol over any backend it is meant for, one method
of the contract (:class:`tierstore.plugin.CommitProtocol`) at a time. Readers look only at
``<id>/`` with a manifest (``tierstore.json``), so "visible" means that manifest is there.
"""

from __future__ import annotations

import uuid

import pytest

from tierstore.plugin import MANIFEST_NAME, METADATA_NAME, Backend, CommitProtocol, Manifest, Phase

from ._helpers import assert_options_declared
from .backend import BackendTests

__all__ = ["CommitProtocolTests"]

_stage_save = BackendTests.stage_save
_dcp_files = BackendTests.dcp_files
_write = BackendTests.write


def _token() -> str:
    return uuid.uuid4().hex[:16]


class CommitProtocolTests:
    """Conformance tests for a :class:`tierstore.plugin.CommitProtocol` over a backend.

    Subclass it in a class named ``Test...`` and provide two fixtures::

        class TestMyCommit(CommitProtocolTests):
            @pytest.fixture
            def backend(self, tmp_path):          # a fresh, empty root per test
                b = MyBackend(root=str(tmp_path / "tier"))
                yield b
                b.close()

            @pytest.fixture
            def protocol(self):
                return MyCommit()

    The backend must be one the protocol is meant for (``atomic`` needs ``supports_rename``).
    Deletes are checked the way the core makes them: moved aside with ``trash_name`` on a
    backend with rename, marked with ``begin_delete`` on one without.
    """

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def backend(self) -> Backend:
        """A backend on a fresh, empty root. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'backend' fixture: a constructed "
                    f"tierstore.plugin.Backend on a fresh, empty root (see CommitProtocolTests)")

    @pytest.fixture
    def protocol(self) -> CommitProtocol:
        """The commit protocol under test. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'protocol' fixture: a constructed "
                    f"tierstore.plugin.CommitProtocol (see CommitProtocolTests)")

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def commit(backend: Backend, protocol: CommitProtocol, checkpoint_id: str,
               files: dict[str, bytes]) -> bytes:
        """A whole save: ``begin``, write ``files``, ``commit``. Returns the manifest bytes."""
        staging, manifest = _stage_save(backend, protocol, checkpoint_id, files)
        protocol.commit(backend, checkpoint_id, staging, manifest, lambda phase: None)
        return manifest

    @staticmethod
    def leftovers(backend: Backend, protocol: CommitProtocol, protect=()) -> list[str]:
        """What gc would collect from the root now (as the core asks for it)."""
        return sorted(protocol.find_leftovers(backend, backend.list(""), set(protect)))

    @staticmethod
    def assert_committed(backend: Backend, checkpoint_id: str, files: dict[str, bytes],
                         manifest: bytes) -> None:
        """``<id>/`` holds exactly ``files`` and the manifest, with their bytes."""
        assert sorted(backend.list(checkpoint_id)) == sorted([*files, MANIFEST_NAME])
        assert backend.read_bytes(f"{checkpoint_id}/{MANIFEST_NAME}") == manifest
        for rel, data in files.items():
            assert backend.read_bytes(f"{checkpoint_id}/{rel}") == data, f"{checkpoint_id}/{rel}"

    # -- tests ---------------------------------------------------------------------------------
    def test_options_are_declared_with_descriptions(self, protocol):
        """``options`` is a tuple of Option, each described, defaults passing their checks."""
        assert isinstance(protocol, CommitProtocol), \
            f"{type(protocol).__name__} does not subclass CommitProtocol"
        assert_options_declared(type(protocol))

    def test_begin_returns_a_directory_the_files_go_into(self, backend, protocol):
        """begin() returns a relative directory on the backend where files can be written."""
        staging = protocol.begin(backend, "step-1", _token())
        assert isinstance(staging, str) and staging, f"begin() returned {staging!r}"
        assert not staging.startswith("/") and ".." not in staging.split("/"), \
            f"begin() returned {staging!r}, not a path relative to the root"
        with backend.open_write(f"{staging}/__0_0.distcp") as f:
            f.write(b"data")
        assert backend.read_bytes(f"{staging}/__0_0.distcp") == b"data"

    def test_commit_publishes_files_and_manifest(self, backend, protocol):
        """commit() makes <id>/ hold the files and the manifest, announcing Phase.PUBLISH once,
        before the manifest is visible, and leaves nothing for gc."""
        files = _dcp_files()
        staging, manifest = _stage_save(backend, protocol, "step-1", files)
        announced = []

        def announce(phase: str) -> None:
            announced.append((phase, backend.size(f"step-1/{MANIFEST_NAME}")))

        protocol.commit(backend, "step-1", staging, manifest, announce)
        assert announced == [(Phase.PUBLISH, None)], \
            f"announce calls (phase, manifest size at <id>): {announced}; expected one " \
            f"Phase.PUBLISH before the manifest is visible"
        self.assert_committed(backend, "step-1", files, manifest)
        assert backend.list("") == ["step-1"]
        assert self.leftovers(backend, protocol) == []

    def test_nothing_is_visible_before_commit(self, backend, protocol):
        """A staged save has no manifest at <id>; one staged elsewhere puts nothing at <id>."""
        staging, _ = _stage_save(backend, protocol, "step-2", _dcp_files())
        assert backend.size(f"step-2/{MANIFEST_NAME}") is None
        if staging != "step-2":
            assert backend.list("step-2") == [], \
                f"staging in {staging!r}, yet <id>/ holds {backend.list('step-2')}"

    def test_abort_removes_what_the_save_wrote(self, backend, protocol):
        """abort() leaves the root as it was: committed checkpoints intact, nothing for gc."""
        files = _dcp_files(1)
        manifest = self.commit(backend, protocol, "step-1", files)
        staging, _ = _stage_save(backend, protocol, "step-2", _dcp_files(2))
        protocol.abort(backend, "step-2", staging)
        assert backend.list("") == ["step-1"]
        assert backend.size(f"step-2/{MANIFEST_NAME}") is None
        self.assert_committed(backend, "step-1", files, manifest)
        assert self.leftovers(backend, protocol) == []

    @pytest.mark.parametrize("before", ["checkpoint", "files without manifest", "empty dir"])
    def test_commit_replaces_what_is_at_the_id(self, backend, protocol, before):
        """Committing over an existing checkpoint, an incomplete copy or an empty directory
        leaves only the new files and manifest."""
        if before == "checkpoint":
            self.commit(backend, protocol, "step-5", _dcp_files(1))
        elif before == "files without manifest":
            _write(backend, f"step-5/{METADATA_NAME}", b"stale")
            _write(backend, "step-5/__9_0.distcp", b"stale")
        else:
            backend.makedirs("step-5")
        files = {METADATA_NAME: b"new metadata", "__0_0.distcp": b"new data"}
        manifest = self.commit(backend, protocol, "step-5", files)
        self.assert_committed(backend, "step-5", files, manifest)
        assert backend.list("") == ["step-5"]
        assert self.leftovers(backend, protocol) == []

    def test_update_manifest_replaces_it(self, backend, protocol):
        """update_manifest() (pin / unpin) puts the new manifest in place, files untouched,
        no temporary files left anywhere."""
        files = _dcp_files()
        old = Manifest.from_json(self.commit(backend, protocol, "step-3", files))
        for pinned in (True, False):
            old.pinned = pinned
            new = old.to_json()
            protocol.update_manifest(backend, "step-3", new, _token())
            self.assert_committed(backend, "step-3", files, new)
            assert Manifest.from_json(backend.read_bytes(f"step-3/{MANIFEST_NAME}")).pinned is pinned
        assert backend.list("") == ["step-3"]
        assert self.leftovers(backend, protocol) == []

    def test_interrupted_saves_are_leftovers_unless_protected(self, backend, protocol):
        """What two saves cut short before commit left is found by find_leftovers, except the
        entries of protected (in-flight) tokens; removing it keeps committed checkpoints."""
        files = _dcp_files(1)
        manifest = self.commit(backend, protocol, "step-1", files)
        first, second = _token(), _token()
        _stage_save(backend, protocol, "step-2", _dcp_files(2), first)
        _stage_save(backend, protocol, "step-3", _dcp_files(3), second)
        everything = self.leftovers(backend, protocol)
        assert "step-1" not in everything, "find_leftovers named a committed checkpoint"
        assert sorted(set(backend.list("")) - {"step-1"}) == everything, \
            f"root {backend.list('')}: find_leftovers found only {everything}"
        of_first = self.leftovers(backend, protocol, {second})
        of_second = self.leftovers(backend, protocol, {first})
        assert of_first and of_second and not set(of_first) & set(of_second), \
            f"protecting one token must spare exactly its entries: {of_first} / {of_second}"
        assert sorted(of_first + of_second) == everything
        assert self.leftovers(backend, protocol, {first, second}) == []
        for name in everything:
            if protocol.is_leftover(name):
                assert protocol.token_of(name) in (first, second), \
                    f"token_of({name!r}) = {protocol.token_of(name)!r}, not its save's token"
            backend.delete(name)
        assert backend.list("") == ["step-1"]
        self.assert_committed(backend, "step-1", files, manifest)

    def test_checkpoints_and_foreign_entries_are_never_leftovers(self, backend, protocol):
        """Committed checkpoints (whatever their id) and what a user put in the root (their own
        DCP checkpoint without a manifest, a file) are never leftovers."""
        ids = ["step-100", "0", "run_7.final", "a-b-c"]
        for i, checkpoint_id in enumerate(ids):
            self.commit(backend, protocol, checkpoint_id, _dcp_files(i))
        _write(backend, f"my-own-dcp/{METADATA_NAME}", b"user metadata")
        _write(backend, "my-own-dcp/__0_0.distcp", b"user data")
        _write(backend, "notes.txt", b"hello")
        assert self.leftovers(backend, protocol) == []
        for name in [*ids, "my-own-dcp", "notes.txt"]:
            assert not protocol.is_leftover(name), f"is_leftover({name!r}) is True"

    def test_interrupted_delete_is_a_leftover(self, backend, protocol):
        """A delete cut short (the core's way: moved aside to trash_name() where the backend
        renames and the protocol ``moves_aside_to_delete``, else begin_delete() then the
        manifest removed) leaves what find_leftovers collects."""
        files = _dcp_files(2)
        manifest = self.commit(backend, protocol, "step-2", files)
        self.commit(backend, protocol, "step-1", _dcp_files(1))
        if backend.supports_rename and protocol.moves_aside_to_delete:
            aside = protocol.trash_name("step-1", _token())
            assert isinstance(aside, str) and "/" not in aside and aside != "step-1", aside
            backend.rename("step-1", aside)
            assert protocol.is_leftover(aside), f"is_leftover(trash_name(...) = {aside!r}) is False"
            expected = [aside]
        else:
            protocol.begin_delete(backend, "step-1")
            backend.delete(f"step-1/{MANIFEST_NAME}")
            expected = ["step-1"]
        assert self.leftovers(backend, protocol) == expected
        backend.delete(expected[0])
        assert backend.list("") == ["step-2"]
        self.assert_committed(backend, "step-2", files, manifest)
