"""``BackendTests`` / ``RenameBackendTests``: what a persistence backend and its commit protocol
must do.

The tests use only the primitives of :class:`tierstore.plugin.Backend` and
:class:`tierstore.plugin.CommitProtocol`, plus a :class:`tierstore.tiers.tier.Tier` built over them (the
core's own view: which checkpoints are complete, what ``verify`` reports, what ``gc`` collects).
"Backdoor" checks read the real files without the backend: through ``local_path()`` by default,
or through :meth:`BackendTests.backdoor_read` where the author overrides it.

No test is ever skipped. Capabilities are opt-in test classes: :class:`BackendTests` checks what
every backend has; a backend that declares ``supports_rename = True`` is checked with
:class:`RenameBackendTests`, which adds the rename tests. A test in :class:`BackendTests` fails
when the class chosen does not match what the backend declares, so a backend cannot be
under-tested by picking the smaller class.
"""

from __future__ import annotations

import os
import random
import uuid
from typing import Callable

import pytest

from tierstore.format.checksum import checksum_of
from tierstore.config.validate import TierConfig
from tierstore.events import Phase
from tierstore.plugin.bases import Backend, CommitProtocol
from tierstore.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from tierstore.plugin.host import build_plugin_host
from tierstore.tiers.tier import Tier

__all__ = ["BackendTests", "RenameBackendTests"]

_MiB = 1 << 20


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class BackendTests:
    """Conformance tests for a :class:`tierstore.plugin.Backend` and its commit protocol.

    For a backend with ``supports_rename = False`` (an object store). A backend that declares
    ``supports_rename = True`` must use :class:`RenameBackendTests` instead (a test here fails
    otherwise). Subclass it in a class named ``Test...`` and provide two fixtures::

        class TestMyBackend(BackendTests):
            plugin_modules = ("my_company.tierstore_ext",)   # if not an installed entry point

            @pytest.fixture
            def backend(self, tmp_path):                 # a fresh, empty root per test
                b = MyBackend(root=str(tmp_path / "tier"))
                yield b
                b.close()

            @pytest.fixture
            def unreachable_backend(self, tmp_path):     # a root that cannot be written
                blocker = tmp_path / "a-file"
                blocker.write_bytes(b"")
                b = MyBackend(root=str(blocker / "tier"))
                yield b
                b.close()

    Required fixtures: ``backend`` (the backend under test on a fresh, empty root, a new one per
    test) and ``unreachable_backend`` (a backend whose root cannot be written: under a regular
    file, a bucket that does not exist, ...; ``check_reachable`` must say why).

    Optional fixture: ``commit_protocol`` (default: the protocol named by the backend's
    ``default_commit``, built through a fresh plugin host).

    Overridable helpers: :meth:`backdoor_read` (read a file without the backend; the default
    uses ``backend.local_path`` and fails, asking for an override, when that is None) and
    :meth:`reopen` (a second instance on the same root).
    """

    #: plugin modules to register beside built-ins and entry points when the default
    #: ``commit_protocol`` fixture looks up the backend's ``default_commit``
    plugin_modules: tuple[str, ...] = ()
    #: size of the "large" round-trip file: a few MiB, odd so no chunk size divides it
    large_file_size: int = 5 * _MiB + 3

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def backend(self) -> Backend:
        """The backend under test, on a fresh empty root. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'backend' fixture: a constructed "
                    f"tierstore.plugin.Backend on a fresh, empty root (see BackendTests)")

    @pytest.fixture
    def unreachable_backend(self) -> Backend:
        """A backend whose root cannot be written. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide an 'unreachable_backend' fixture: a "
                    f"constructed backend whose root cannot be written (e.g. a path under a "
                    f"regular file, a bucket that does not exist), so that check_reachable()'s "
                    f"refusal is checked (see BackendTests)")

    @pytest.fixture
    def commit_protocol(self, backend: Backend) -> CommitProtocol:
        """The backend's default commit protocol, looked up the way ``tierstore.open`` does."""
        host = build_plugin_host(self.plugin_modules, "BackendTests.plugin_modules")
        reg = host.lookup("commit", backend.default_commit)
        assert reg is not None, (
            f"{type(backend).__name__}.default_commit is {backend.default_commit!r}, which no "
            f"plugin registers; registered: {host.names('commit')}. Add the module that registers "
            f"it to plugin_modules, or override the 'commit_protocol' fixture")
        return reg.factory()

    @pytest.fixture
    def tier(self, backend: Backend, commit_protocol: CommitProtocol) -> Tier:
        """A tier named ``conformance`` over the backend, as the core builds one."""
        config = TierConfig(index=0, name="conformance", backend=type(backend).__name__, every=1,
                            keep=None, codecs=(), backend_options={})
        return Tier(config=config, backend=backend, commit=commit_protocol,
                    commit_name=type(commit_protocol).__name__)

    # -- helpers a subclass may override -------------------------------------------------------
    def backdoor_read(self, backend: Backend, path: str) -> bytes | None:
        """Bytes of ``path`` read without the backend, or None when it does not exist. The
        default reads ``backend.local_path(path)``; a backend without a local path must have
        this overridden (e.g. to read the object with the store's own client), else the
        backdoor tests fail saying so."""
        local = backend.local_path(path)
        if local is None:
            pytest.fail(f"{type(backend).__name__}.local_path({path!r}) is None, so the default "
                        f"backdoor_read cannot see its files: override "
                        f"{type(self).__name__}.backdoor_read(backend, path) to read them without "
                        f"the backend (return None when the file does not exist)")
        try:
            with open(local, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def reopen(self, backend: Backend) -> Backend:
        """A second backend instance on the same root (what a restarted process builds). The
        default calls ``type(backend)(root=backend.root)``; override it when options are needed."""
        return type(backend)(root=backend.root)

    # -- small tools ---------------------------------------------------------------------------
    @staticmethod
    def write(backend: Backend, path: str, data: bytes) -> None:
        """Create the parents of ``path`` and write ``data`` there through the backend."""
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        backend.makedirs(parent)
        with backend.open_write(path) as f:
            f.write(data)

    @staticmethod
    def read(backend: Backend, path: str) -> bytes:
        """Read all of ``path`` with ``readinto`` in small pieces (as the core's reader does)."""
        out = bytearray()
        buf = bytearray(64 << 10)
        view = memoryview(buf)
        with backend.open_read(path) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    return bytes(out)
                out += view[:n]

    @staticmethod
    def stage_save(backend: Backend, commit: CommitProtocol, checkpoint_id: str,
                   files: dict[str, bytes], token: str | None = None) -> tuple[str, bytes]:
        """Run a save up to (not including) the commit: ``begin`` and write ``files`` under the
        staging directory. Returns the staging directory and the manifest to commit."""
        token = token or uuid.uuid4().hex[:16]
        staging = commit.begin(backend, checkpoint_id, token)
        entries = {}
        for rel, data in files.items():
            with backend.open_write(f"{staging}/{rel}") as f:
                f.write(data)
            entries[rel] = FileEntry(len(data), checksum_of(data), 0)
        manifest = Manifest(checkpoint_id=checkpoint_id, files=entries, plugins={
            "backend": type(backend).__name__, "commit": type(commit).__name__})
        return staging, manifest.to_json()

    def commit_checkpoint(self, backend: Backend, commit: CommitProtocol, checkpoint_id: str,
                          files: dict[str, bytes]) -> bytes:
        """A whole save: ``begin``, write ``files``, ``commit``. Returns the manifest bytes."""
        staging, manifest = self.stage_save(backend, commit, checkpoint_id, files)
        commit.commit(backend, checkpoint_id, staging, manifest, lambda phase: None)
        return manifest

    @staticmethod
    def dcp_files(seed: int = 0) -> dict[str, bytes]:
        """Files shaped like a small DCP checkpoint: metadata and two data files."""
        return {METADATA_NAME: _random_bytes(300, seed),
                "__0_0.distcp": _random_bytes(70_000, seed + 1),
                "__0_1.distcp": _random_bytes(1234, seed + 2)}

    # == the test class matches the backend =====================================================
    def test_test_class_matches_declared_capabilities(self, backend):
        """The test class checks everything the backend declares: a backend that declares
        supports_rename = True is checked with RenameBackendTests (and only such a one)."""
        name, cls = type(backend).__name__, type(self).__name__
        declared = backend.supports_rename
        if isinstance(self, RenameBackendTests):
            assert declared is True, (
                f"{cls} subclasses RenameBackendTests but {name} declares supports_rename = "
                f"{declared!r}: subclass BackendTests instead, or implement rename() and declare "
                f"supports_rename = True")
        else:
            assert declared is False, (
                f"{name} declares supports_rename = {declared!r}: subclass RenameBackendTests "
                f"(not BackendTests) in {cls} to check it")

    # == backend primitives ====================================================================
    def test_check_reachable_on_fresh_root_is_none_and_writes_nothing(self, backend):
        """A fresh root can be used, and checking it leaves it empty."""
        assert backend.check_reachable() is None
        assert backend.list("") == []

    def test_unreachable_root_is_refused_with_a_sentence(self, unreachable_backend):
        """On a root that cannot be written, check_reachable says why (the ConfigError shows it)."""
        problem = unreachable_backend.check_reachable()
        assert isinstance(problem, str) and problem.strip(), \
            f"check_reachable() on an unwritable root returned {problem!r}, expected a sentence"

    def test_describe_names_the_location(self, backend):
        """describe() gives a non-empty text for messages."""
        text = backend.describe()
        assert isinstance(text, str) and text

    @pytest.mark.parametrize("size", [0, 1, 4096 + 7, "large"])
    def test_write_then_read_gives_the_same_bytes(self, backend, size):
        """Bytes written come back unchanged through readinto and read_bytes; size agrees."""
        n = self.large_file_size if size == "large" else size
        data = _random_bytes(n, seed=n)
        self.write(backend, "ckpt/data.bin", data)
        assert self.read(backend, "ckpt/data.bin") == data
        assert backend.read_bytes("ckpt/data.bin") == data
        assert backend.size("ckpt/data.bin") == n

    def test_write_accepts_bytes_bytearray_and_memoryview_in_pieces(self, backend):
        """The core writes memoryviews in many calls; the file is their concatenation."""
        parts = [_random_bytes(1000, 1), bytearray(_random_bytes(2000, 2)),
                 memoryview(_random_bytes(3000, 3))]
        backend.makedirs("d")
        with backend.open_write("d/f") as f:
            for part in parts:
                f.write(part)
        assert backend.read_bytes("d/f") == b"".join(bytes(p) for p in parts)

    def test_write_replaces_a_longer_file(self, backend):
        """open_write truncates: no tail of the old file survives."""
        self.write(backend, "d/f", b"x" * 10_000)
        self.write(backend, "d/f", b"short")
        assert backend.read_bytes("d/f") == b"short"
        assert backend.size("d/f") == 5

    def test_write_bytes_and_read_bytes(self, backend):
        """The derived whole-file helpers round-trip (manifests use them)."""
        backend.makedirs("d")
        backend.write_bytes("d/small.json", b'{"a": 1}\n')
        assert backend.read_bytes("d/small.json") == b'{"a": 1}\n'

    def test_size_is_none_for_missing_files_and_directories(self, backend):
        """size() is the file's length; None when missing or a directory (how the core tells)."""
        self.write(backend, "d/sub/f", b"abc")
        assert backend.size("d/sub/f") == 3
        assert backend.size("d/sub/missing") is None
        assert backend.size("missing/f") is None
        assert backend.size("d") is None, "size() of a directory must be None (it is not a file)"
        assert backend.size("d/sub") is None

    def test_empty_file_exists_with_size_zero(self, backend):
        """An empty file exists: size 0, listed, readable."""
        self.write(backend, "d/empty", b"")
        assert backend.size("d/empty") == 0
        assert backend.list("d") == ["empty"]
        assert backend.read_bytes("d/empty") == b""

    def test_list_gives_names_directly_under_a_directory(self, backend):
        """list() names files and directories one level down, not deeper ones."""
        for path in ("d/b", "d/a", "d/sub/x", "d/sub/deeper/y", "other/z"):
            self.write(backend, path, path.encode())
        assert sorted(backend.list("d")) == ["a", "b", "sub"]
        assert sorted(backend.list("d/sub")) == ["deeper", "x"]
        assert sorted(backend.list("")) == ["d", "other"]

    def test_list_of_a_missing_directory_is_empty(self, backend):
        """list() of a missing directory is [], not an error."""
        assert backend.list("missing") == []
        assert backend.list("missing/deeper") == []

    def test_makedirs_is_idempotent_and_makes_parents(self, backend):
        """makedirs twice is fine, and a file can then be written in the deepest directory."""
        backend.makedirs("a/b/c")
        backend.makedirs("a/b/c")
        with backend.open_write("a/b/c/f") as f:
            f.write(b"1")
        assert backend.read_bytes("a/b/c/f") == b"1"

    def test_delete_a_file(self, backend):
        """A deleted file is gone everywhere; its sibling stays."""
        self.write(backend, "d/f", b"gone")
        self.write(backend, "d/g", b"stays")
        backend.delete("d/f")
        assert backend.size("d/f") is None
        assert backend.list("d") == ["g"]
        with pytest.raises(FileNotFoundError):
            backend.open_read("d/f")
        assert backend.read_bytes("d/g") == b"stays"

    def test_delete_a_directory_tree_leaves_siblings_alone(self, backend):
        """delete() of a directory removes its whole tree, and nothing that only shares a prefix."""
        for path in ("ck/a", "ck/sub/b", "ck/sub/deeper/c"):
            self.write(backend, path, b"x")
        # Siblings sharing a prefix: a prefix-based delete on an object store must not take them.
        self.write(backend, "ck-2/a", b"keep")
        self.write(backend, "ckx", b"keep")
        backend.delete("ck")
        assert sorted(backend.list("")) == ["ck-2", "ckx"]
        assert backend.list("ck") == []
        assert backend.size("ck/sub/deeper/c") is None
        assert backend.read_bytes("ck-2/a") == b"keep"
        assert backend.read_bytes("ckx") == b"keep"

    def test_discard_removes_a_tree_and_the_next_files_read_back_as_written(self, backend):
        """discard() (an evicted checkpoint) removes the tree like delete(); whatever storage
        the backend reuses, files written afterwards hold exactly their own bytes."""
        self.write(backend, "old/a", b"o" * 70_000)
        self.write(backend, "old/b", b"p" * 10)
        self.write(backend, "other/a", b"keep")
        backend.discard("old")
        assert backend.list("old") == []
        assert backend.size("old/a") is None
        assert sorted(backend.list("")) == ["other"]
        self.write(backend, "new/a", b"n" * 5)
        self.write(backend, "new/b", b"m" * 90_000)
        assert backend.read_bytes("new/a") == b"n" * 5
        assert backend.read_bytes("new/b") == b"m" * 90_000
        assert backend.read_bytes("other/a") == b"keep"

    def test_delete_of_something_missing_is_not_an_error(self, backend):
        """Deleting what is not there is a no-op."""
        backend.delete("missing")
        backend.delete("missing/deeper/f")
        self.write(backend, "d/f", b"x")
        backend.delete("d/missing")
        assert backend.list("d") == ["f"]

    def test_open_read_of_a_missing_file_raises_file_not_found(self, backend):
        """A missing file (or missing parent) is FileNotFoundError, which the core relies on."""
        self.write(backend, "d/f", b"x")
        with pytest.raises(FileNotFoundError):
            backend.open_read("d/missing")
        with pytest.raises(FileNotFoundError):
            backend.open_read("missing/f")

    def test_opened_file_supports_readinto_and_seek(self, backend):
        """Read files are seekable and fill buffers with readinto; 0 at end of file."""
        data = _random_bytes(100_000, 5)
        self.write(backend, "d/f", data)
        with backend.open_read("d/f") as f:
            assert f.seekable()
            buf = bytearray(1000)
            assert f.readinto(buf) == 1000
            assert bytes(buf) == data[:1000]
            f.seek(50_000)
            assert f.tell() == 50_000
            view = memoryview(bytearray(100))
            assert f.readinto(view[10:60]) == 50
            assert bytes(view[10:60]) == data[50_000:50_050]
            f.seek(len(data) - 3)
            tail = bytearray(10)
            assert f.readinto(tail) == 3
            assert bytes(tail[:3]) == data[-3:]
            assert f.readinto(tail) == 0, "readinto at end of file must return 0"

    def test_inventory_names_every_file_with_its_size_or_is_not_offered(self, backend):
        """``inventory`` (optional): every file under a directory, by path relative to it,
        with its size, from one listing ({} when the directory is missing); None: not
        offered, and the core asks ``size`` file by file."""
        self.write(backend, "inv/a/f", b"x" * 10)
        self.write(backend, "inv/a/sub/g", b"")
        self.write(backend, "inv/b", b"yy")
        self.write(backend, "other/h", b"z")
        found = backend.inventory("inv")
        if found is None:
            return
        assert found == {"a/f": 10, "a/sub/g": 0, "b": 2}
        assert backend.inventory("missing") == {}

    def test_a_file_opened_with_its_size_reads_back_as_written(self, backend):
        """``open_read_sized`` (optional; default ``open_read``) reads a file whose size is
        known already: the same bytes, seekable."""
        data = _random_bytes(70_000, 6)
        self.write(backend, "d/sized", data)
        with backend.open_read_sized("d/sized", len(data)) as f:
            f.seek(60_000)
            tail = bytearray(20_000)
            assert f.readinto(tail) == 10_000
            assert bytes(tail[:10_000]) == data[60_000:]

    def test_sync_dir_on_an_existing_directory_succeeds(self, backend):
        """sync_dir (optional) never fails on an existing directory or the root."""
        self.write(backend, "d/f", b"x")
        backend.sync_dir("d")
        backend.sync_dir("")

    def test_backdoor_sees_the_bytes_written(self, backend):
        """The bytes really are where the backend says (read without the backend)."""
        data = _random_bytes(3000, 9)
        self.write(backend, "d/f", data)
        assert self.backdoor_read(backend, "d/f") == data
        backend.delete("d")
        assert self.backdoor_read(backend, "d/f") is None

    # -- instance lifetime ---------------------------------------------------------------------
    def test_files_outlive_the_instance_that_wrote_them(self, backend):
        """A new instance on the same root (a restarted process) sees the files. Every backend:
        even a tmpfs one outlives its process; ``durable`` is about power loss, not this."""
        data = _random_bytes(10_000, 4)
        self.write(backend, "d/f", data)
        backend.sync_dir("d")
        other = self.reopen(backend)
        try:
            assert other.list("d") == ["f"]
            assert other.read_bytes("d/f") == data
        finally:
            other.close()

    # == commit protocol =======================================================================
    def test_default_commit_protocol_is_registered(self, backend):
        """The backend's default_commit names a registered commit protocol."""
        host = build_plugin_host(self.plugin_modules, "BackendTests.plugin_modules")
        assert backend.default_commit in host.names("commit")

    def test_commit_publishes_the_checkpoint_with_its_manifest(self, backend, commit_protocol,
                                                               tier):
        """begin -> write -> commit makes <id>/ appear with its files and manifest, announcing
        Phase.PUBLISH just before, and leaves no leftovers."""
        files = self.dcp_files()
        staging, manifest = self.stage_save(backend, commit_protocol, "step-10", files)
        assert staging  # may be <id> itself (in-place protocols) or a hidden directory
        assert tier.complete_manifest("step-10") is None
        assert backend.size(f"step-10/{MANIFEST_NAME}") is None

        announced: list[tuple[str, bool]] = []

        def announce(phase: str) -> None:
            announced.append((phase, tier.complete_manifest("step-10") is not None))

        commit_protocol.commit(backend, "step-10", staging, manifest, announce)
        assert announced == [(Phase.PUBLISH, False)], \
            "commit must announce Phase.PUBLISH once, before the checkpoint becomes visible"
        assert list(tier.complete()) == ["step-10"]
        assert tier.complete_manifest("step-10") == Manifest.from_json(manifest)
        assert backend.read_bytes(f"step-10/{MANIFEST_NAME}") == manifest
        for rel, data in files.items():
            assert backend.read_bytes(f"step-10/{rel}") == data
        assert sorted(backend.list("step-10")) == sorted([*files, MANIFEST_NAME])
        assert tier.verify("step-10") == []
        assert tier.leftovers() == []
        assert [n for n in backend.list("") if commit_protocol.is_leftover(n)] == []

    def test_nothing_is_visible_before_commit(self, backend, commit_protocol, tier):
        """A staged but uncommitted save is not a checkpoint for any reader."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files(1))
        self.stage_save(backend, commit_protocol, "step-2", self.dcp_files(2))
        assert list(tier.complete()) == ["step-1"]
        assert tier.complete_manifest("step-2") is None
        assert backend.size(f"step-2/{MANIFEST_NAME}") is None

    def test_leftovers_of_an_interrupted_save_are_recognised(self, backend, commit_protocol,
                                                             tier):
        """What a save cut short before commit left is recognised (is_leftover / Tier.leftovers),
        spared while its token is in flight, and removing it leaves committed checkpoints intact."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files(1))
        token = uuid.uuid4().hex[:16]
        self.stage_save(backend, commit_protocol, "step-2", self.dcp_files(2), token)
        left = sorted(set(backend.list("")) - {"step-1"})
        assert left, "an interrupted save left nothing on the root: where did its files go?"
        for name in left:
            if name != "step-2":
                assert commit_protocol.is_leftover(name), \
                    f"{name!r} was left by an interrupted save but is_leftover() says False"
        assert not commit_protocol.is_leftover("step-1")

        # While the save is in flight its files are not collected...
        assert tier.leftovers(protect={token}) == [], "gc would collect the files of a save in flight"
        # ...once it is not, they are, and collecting them leaves the committed checkpoint.
        assert sorted(tier.leftovers()) == left
        for name in tier.leftovers():
            backend.delete(name)
        assert backend.list("") == ["step-1"]
        assert tier.verify("step-1") == []

    @pytest.mark.parametrize("checkpoint_id", ["step-100", "0", "run_7.final", "a-b-c"])
    def test_checkpoint_ids_are_never_leftovers(self, commit_protocol, checkpoint_id):
        """is_leftover never claims a valid checkpoint id (gc would delete a checkpoint)."""
        assert not commit_protocol.is_leftover(checkpoint_id)

    def test_abort_throws_away_the_staged_files(self, backend, commit_protocol, tier):
        """abort removes what the failed save wrote and nothing else."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files(1))
        staging, _ = self.stage_save(backend, commit_protocol, "step-2", self.dcp_files(2))
        commit_protocol.abort(backend, "step-2", staging)
        assert backend.list("") == ["step-1"]
        assert list(tier.complete()) == ["step-1"]

    def test_commit_replaces_an_existing_checkpoint(self, backend, commit_protocol, tier):
        """Committing an existing id (overwrite) leaves only the new files."""
        self.commit_checkpoint(backend, commit_protocol, "step-5", self.dcp_files(1))
        new_files = {METADATA_NAME: b"new metadata", "__0_0.distcp": b"new data"}
        manifest = self.commit_checkpoint(backend, commit_protocol, "step-5", new_files)
        assert tier.complete_manifest("step-5") == Manifest.from_json(manifest)
        assert sorted(backend.list("step-5")) == sorted([*new_files, MANIFEST_NAME])
        assert backend.read_bytes("step-5/__0_0.distcp") == b"new data"
        assert tier.verify("step-5") == []
        assert backend.list("") == ["step-5"]

    def test_commit_replaces_an_incomplete_checkpoint_directory(self, backend, commit_protocol,
                                                                tier):
        """A directory with DCP files but no manifest at <id> does not block a commit."""
        # What a delete or an overwrite cut short leaves: DCP files, no manifest.
        self.write(backend, f"step-5/{METADATA_NAME}", b"stale")
        self.write(backend, "step-5/__9_0.distcp", b"stale")
        files = self.dcp_files()
        self.commit_checkpoint(backend, commit_protocol, "step-5", files)
        assert sorted(backend.list("step-5")) == sorted([*files, MANIFEST_NAME])
        assert tier.verify("step-5") == []

    def test_commit_replaces_an_empty_checkpoint_directory(self, backend, commit_protocol, tier):
        """An empty directory at <id> does not block a commit."""
        # What a delete cut short between removing the last file and the directory leaves.
        backend.makedirs("step-5")
        files = self.dcp_files()
        self.commit_checkpoint(backend, commit_protocol, "step-5", files)
        assert sorted(backend.list("step-5")) == sorted([*files, MANIFEST_NAME])
        assert tier.verify("step-5") == []

    def test_update_manifest_replaces_it_in_place(self, backend, commit_protocol, tier):
        """Pin and unpin rewrite the manifest and leave no temporary files behind."""
        files = self.dcp_files()
        self.commit_checkpoint(backend, commit_protocol, "step-3", files)
        assert tier.set_pinned("step-3", True)
        assert tier.complete_manifest("step-3").pinned is True
        assert sorted(backend.list("step-3")) == sorted([*files, MANIFEST_NAME])
        assert tier.set_pinned("step-3", False)
        assert tier.complete_manifest("step-3").pinned is False
        assert tier.verify("step-3") == []
        assert backend.list("") == ["step-3"]

    def test_tier_delete_removes_the_checkpoint(self, backend, commit_protocol, tier):
        """Tier.delete removes one checkpoint entirely and leaves the others."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files(1))
        self.commit_checkpoint(backend, commit_protocol, "step-2", self.dcp_files(2))
        tier.delete("step-1")
        assert backend.list("") == ["step-2"]
        assert list(tier.complete()) == ["step-2"]

    # == checksums: what Tier.verify finds =====================================================
    def _corrupt(self, backend: Backend, path: str, change: Callable[[bytearray], bytes]) -> None:
        data = bytearray(backend.read_bytes(path))
        with backend.open_write(path) as f:
            f.write(change(data))

    def test_verify_reports_a_flipped_byte(self, backend, commit_protocol, tier):
        """One flipped byte is a checksum problem on exactly that file."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files())

        def flip(data: bytearray) -> bytes:
            data[len(data) // 2] ^= 0x01
            return bytes(data)

        self._corrupt(backend, "step-1/__0_0.distcp", flip)
        problems = tier.verify("step-1")
        assert [(p.file, p.what.split()[0]) for p in problems] == [("__0_0.distcp", "checksum")]
        assert problems[0].checkpoint_id == "step-1" and problems[0].tier == tier.name

    def test_verify_reports_a_truncated_file(self, backend, commit_protocol, tier):
        """A truncated file is a size problem, and the checkpoint stops counting as complete."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files())
        self._corrupt(backend, "step-1/__0_1.distcp", lambda data: bytes(data[:-1]))
        problems = tier.verify("step-1")
        assert [(p.file, p.what.split()[0]) for p in problems] == [("__0_1.distcp", "size")]
        assert tier.complete_manifest("step-1") is None, "a checkpoint whose files do not match its " \
            "manifest's sizes must not count as complete"
        assert tier.complete() == {}

    def test_verify_reports_a_missing_file(self, backend, commit_protocol, tier):
        """A deleted file is reported missing, and the checkpoint is not complete."""
        self.commit_checkpoint(backend, commit_protocol, "step-1", self.dcp_files())
        backend.delete(f"step-1/{METADATA_NAME}")
        problems = tier.verify("step-1")
        assert [(p.file, p.what) for p in problems] == [(METADATA_NAME, "missing")]
        assert tier.complete() == {}

    def test_backdoor_sees_the_committed_files(self, backend, commit_protocol):
        """After commit, the real files at <root>/<id>/ are the committed bytes."""
        files = self.dcp_files()
        manifest = self.commit_checkpoint(backend, commit_protocol, "step-1", files)
        assert self.backdoor_read(backend, f"step-1/{MANIFEST_NAME}") == manifest
        for rel, data in files.items():
            assert self.backdoor_read(backend, f"step-1/{rel}") == data
        local = backend.local_path("")
        if local is not None:
            assert sorted(os.listdir(local)) == ["step-1"]


class RenameBackendTests(BackendTests):
    """:class:`BackendTests` plus the rename tests, for a backend that declares
    ``supports_rename = True`` (a POSIX directory). Same fixtures and helpers as
    :class:`BackendTests`::

        class TestMyBackend(RenameBackendTests):
            @pytest.fixture
            def backend(self, tmp_path): ...

            @pytest.fixture
            def unreachable_backend(self, tmp_path): ...
    """

    # == rename ================================================================================
    def test_rename_moves_a_file(self, backend):
        """rename of a file: the source is gone, the destination has its bytes."""
        self.write(backend, "d/a", b"payload")
        backend.rename("d/a", "d/b")
        assert backend.list("d") == ["b"]
        assert backend.read_bytes("d/b") == b"payload"

    def test_rename_moves_a_directory_tree(self, backend):
        """rename of a directory moves everything under it (what the atomic commit does)."""
        self.write(backend, "staging/x", b"1")
        self.write(backend, "staging/sub/y", b"2")
        backend.rename("staging", "final")
        assert backend.list("") == ["final"]
        assert backend.read_bytes("final/x") == b"1"
        assert backend.read_bytes("final/sub/y") == b"2"

    def test_rename_with_replace_overwrites_a_file(self, backend):
        """rename(replace=True) puts a file over an existing one (manifest updates)."""
        self.write(backend, "d/new", b"new")
        self.write(backend, "d/old", b"old contents")
        backend.rename("d/new", "d/old", replace=True)
        assert backend.list("d") == ["old"]
        assert backend.read_bytes("d/old") == b"new"
