"""The ``fsspec`` backend (and its ``manifest-last`` commit protocol) passes the conformance kit
on four filesystems: ``memory://``, ``file://``, S3 (SeaweedFS) and GCS (fake-gcs-server).

It declares ``supports_rename = False``, so it is checked with ``BackendTests`` (not the rename
class), and with ``RoundTripTests`` through a store whose only tier is the fsspec one. A
``file://`` tier has a local path and no codecs, so stock ``dcp.load`` must read it too
(``StockLoadableRoundTripTests``).
"""

from __future__ import annotations

import sys
import uuid
import warnings

import fsspec
import pytest

# Detailed assertion messages from the kit's own asserts (possible only before its import).
if "tierstore_conformance" not in sys.modules:
    pytest.register_assert_rewrite("tierstore_conformance")

from tierstore_conformance import (
    BackendTests,
    RoundTripTests,
    StockLoadableRoundTripTests,
)

from tierstore.plugin.host import build_plugin_host


def _fsspec_backend(url: str, options: dict | None = None):
    """Build the registered ``fsspec`` backend the way the core does (root and url)."""
    reg = build_plugin_host().lookup("backend", "fsspec")
    return reg.factory(root=url, url=url, options=dict(options or {}))


def _read_or_none(fs, path: str) -> bytes | None:
    fs.invalidate_cache()
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None


class _FsspecBackendTests(BackendTests):
    """Shared parts: ``reopen`` passes the filesystem options along (the default passes only
    ``root``), and the backdoor reads objects with a client of its own."""

    #: filesystem options of the backend under test (set by the ``backend`` fixture)
    options: dict | None = None

    def reopen(self, backend):
        return _fsspec_backend(backend.url, self.options)

    def backdoor_fs_and_root(self, backend) -> tuple[object, str]:
        raise NotImplementedError

    def backdoor_read(self, backend, path):
        fs, root = self.backdoor_fs_and_root(backend)
        return _read_or_none(fs, f"{root}/{path}")


# ----------------------------------------------------------------------------- memory://

class TestFsspecMemoryBackend(_FsspecBackendTests):
    @pytest.fixture
    def backend(self):
        name = f"conformance-{uuid.uuid4().hex[:12]}"
        self.base = f"/{name}"
        backend = _fsspec_backend(f"memory://{name}/tier")
        yield backend
        backend.close()
        fs = fsspec.filesystem("memory")
        if fs.exists(self.base):
            fs.rm(self.base, recursive=True)

    @pytest.fixture
    def unreachable_backend(self):
        """A root under an object that is a file: memory:// refuses to write beneath it
        (FileExistsError), so check_reachable must say so."""
        name = f"conformance-{uuid.uuid4().hex[:12]}"
        fs = fsspec.filesystem("memory")
        fs.pipe_file(f"/{name}/a-file", b"not a directory")
        with pytest.raises(FileExistsError):  # really unwritable
            fs.pipe_file(f"/{name}/a-file/tier/probe", b"x")
        backend = _fsspec_backend(f"memory://{name}/a-file/tier")
        yield backend
        backend.close()
        fs.rm(f"/{name}", recursive=True)

    def backdoor_fs_and_root(self, backend):
        return fsspec.filesystem("memory"), f"{self.base}/tier"


class TestFsspecMemoryRoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self):
        name = f"roundtrip-{uuid.uuid4().hex[:12]}"
        yield {"tier": [{"name": "mem", "backend": "fsspec", "url": f"memory://{name}/tier"}]}
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


# ----------------------------------------------------------------------------- file://

class TestFsspecFileBackend(_FsspecBackendTests):
    # file:// has local_path(), so the kit's default backdoor (plain open()) applies.
    def backdoor_read(self, backend, path):
        return BackendTests.backdoor_read(self, backend, path)

    @pytest.fixture(params=["missing root", "existing root"])
    def backend(self, request, tmp_path):
        root = tmp_path / "tier"
        if request.param == "existing root":
            root.mkdir()
        backend = _fsspec_backend(f"file://{root}")
        assert backend.local_path("x") == f"{root}/x"
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, tmp_path):
        """A root under a regular file: no directory can be made there."""
        blocker = tmp_path / "a-file"
        blocker.write_bytes(b"not a directory")
        backend = _fsspec_backend(f"file://{blocker}/tier")
        yield backend
        backend.close()


class TestFsspecFileRoundTrip(StockLoadableRoundTripTests):
    @pytest.fixture
    def store_config(self, tmp_path):
        return {"tier": [{"name": "disk", "backend": "fsspec", "url": f"file://{tmp_path}/tier"}]}


# ----------------------------------------------------------------------------- S3 (SeaweedFS)

@pytest.fixture(scope="module")
def s3_module_bucket(seaweed):
    """One bucket for this module's S3 tests; each test gets a fresh, empty prefix in it (the
    kit needs a fresh root, not a fresh bucket, and a SeaweedFS bucket costs ~1.3 s to create
    and drop: a bucket per test would double the time of this module)."""
    if not seaweed.running():
        seaweed.restart()
    url = seaweed.make_bucket(f"t-conformance-fsspec-{uuid.uuid4().hex[:10]}")
    yield url
    if seaweed.running():
        try:
            seaweed.filesystem().rm(url[len("s3://"):], recursive=True)
        except Exception as e:  # noqa: BLE001 - cleanup only
            warnings.warn(f"could not delete test bucket {url}: {e!r}", stacklevel=1)


@pytest.fixture
def s3_root(seaweed, s3_module_bucket):
    """``s3://<module bucket>/<fresh prefix>``: no object under it yet."""
    if not seaweed.running():  # a test elsewhere killed it and did not bring it back
        seaweed.restart()
    url = f"{s3_module_bucket}/{uuid.uuid4().hex[:12]}"
    assert seaweed.filesystem().find(url[len("s3://"):]) == []
    return url


class TestFsspecS3Backend(_FsspecBackendTests):
    @pytest.fixture
    def backend(self, seaweed, s3_root):
        self.options = seaweed.storage_options()
        self.seaweed = seaweed
        backend = _fsspec_backend(f"{s3_root}/tier", self.options)
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, seaweed):
        """A bucket that does not exist (tierstore never creates buckets)."""
        backend = _fsspec_backend(f"s3://no-such-bucket-{uuid.uuid4().hex[:10]}/tier",
                                  seaweed.storage_options())
        yield backend
        backend.close()

    def backdoor_fs_and_root(self, backend):
        return self.seaweed.filesystem(), backend.url[len("s3://"):]


class TestFsspecS3RoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self, seaweed, s3_root):
        return {"tier": [{"name": "s3", "backend": "fsspec", "url": f"{s3_root}/run",
                          "options": seaweed.storage_options()}]}


# ----------------------------------------------------------------------------- GCS (fake-gcs-server)

class TestFsspecGCSBackend(_FsspecBackendTests):
    @pytest.fixture
    def backend(self, fake_gcs, gcs_bucket):
        self.options = fake_gcs.storage_options()
        self.fake_gcs = fake_gcs
        backend = _fsspec_backend(f"{gcs_bucket}/tier", self.options)
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, fake_gcs):
        """A bucket that does not exist."""
        backend = _fsspec_backend(f"gs://no-such-bucket-{uuid.uuid4().hex[:10]}/tier",
                                  fake_gcs.storage_options())
        yield backend
        backend.close()

    def backdoor_fs_and_root(self, backend):
        return self.fake_gcs.filesystem(), backend.url[len("gs://"):]


class TestFsspecGCSRoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self, fake_gcs, gcs_bucket):
        return {"tier": [{"name": "gcs", "backend": "fsspec", "url": f"{gcs_bucket}/run",
                          "options": fake_gcs.storage_options()}]}
