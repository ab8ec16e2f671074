"""A commit on an object store asks the store itself whether every object is there: a
listing cached by the filesystem client (s3fs and gcsfs keep one) may predate objects that
another process (another rank of a node-local group, a resumed drain) has written since."""

from __future__ import annotations

from tierstore.format.checksum import checksum_of
from tierstore.format.manifest import FileEntry, Manifest
from tierstore_plugins.fsspec_backend import FsspecBackend
from tierstore_plugins.manifest_last import ManifestLastCommit


def _commit_after_another_client_wrote(url, options, other_fs):
    backend = FsspecBackend(url, url=url, options=options)
    protocol = ManifestLastCommit()
    first, second = b"a" * 100, b"b" * 200
    staging = protocol.begin(backend, "step-1", "token-1")
    backend.write_bytes(f"{staging}/__0_0.distcp", first)
    # A listing of the tier (store.list(), the scan that resumes drains) while the save runs.
    assert backend.list("") == ["step-1"]
    assert "__1_0.distcp" not in backend.list("step-1")
    # Another process writes its part of the same checkpoint.
    other_fs.pipe_file(f"{url.split('://', 1)[1]}/step-1/__1_0.distcp", second)
    manifest = Manifest("step-1", {
        "__0_0.distcp": FileEntry(len(first), checksum_of(first), 0),
        "__1_0.distcp": FileEntry(len(second), checksum_of(second), 1)}, world_size=2,
        ranks=[0, 1], save_token="token-1")
    protocol.commit(backend, "step-1", staging, manifest.to_json(), lambda phase: None)
    assert backend.size("step-1/__1_0.distcp") == len(second)
    assert backend.size("step-1/tierstore.json") is not None


def test_s3_commit_confirms_objects_written_after_a_cached_listing(seaweed, s3_bucket):
    _commit_after_another_client_wrote(s3_bucket, seaweed.storage_options(),
                                       seaweed.filesystem())


def test_gcs_commit_confirms_objects_written_after_a_cached_listing(fake_gcs, gcs_bucket):
    _commit_after_another_client_wrote(gcs_bucket, fake_gcs.storage_options(),
                                       fake_gcs.filesystem())
