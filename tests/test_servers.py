"""The real-server fixtures work: fsspec round trips against SeaweedFS (S3) and
fake-gcs-server (GCS), restarts keep data, and the errors the clients raise are the ones the
backends' retry logic expects (see tests/servers.py)."""

from __future__ import annotations

import os
import time

import botocore.exceptions
import fsspec
import pytest
from servers import FakeGCS


def _round_trip(fs, bucket: str) -> None:
    path = f"{bucket}/dir/obj.bin"
    fs.pipe(path, b"hello tierstore")
    assert fs.cat(path) == b"hello tierstore"
    assert fs.cat_file(path, start=6, end=15) == b"tierstore"
    assert fs.ls(f"{bucket}/dir", detail=False) == [path]
    assert fs.info(path)["size"] == 15
    fs.rm(path)
    fs.invalidate_cache()
    assert not fs.exists(path)
    with pytest.raises(FileNotFoundError):
        fs.cat(path)


# ----------------------------------------------------------------------------- S3


def test_s3_round_trip(seaweed, s3_bucket):
    assert s3_bucket.startswith("s3://")
    _round_trip(seaweed.filesystem(), s3_bucket[len("s3://"):])


def test_s3_through_fsspec_url(seaweed, s3_bucket):
    fs, root = fsspec.core.url_to_fs(s3_bucket, **seaweed.storage_options())
    fs.pipe(f"{root}/a", b"1")
    with fsspec.open(f"{s3_bucket}/b", "wb", **seaweed.storage_options()) as f:
        f.write(b"22")
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/a", f"{root}/b"]
    assert fs.cat_ranges([f"{root}/a", f"{root}/b"], [0, 1], [1, 2]) == [b"1", b"2"]


def test_s3_multipart_upload(seaweed, s3_bucket, tmp_path):
    fs = seaweed.filesystem()
    data = os.urandom(11 * 2**20 + 123)
    local = tmp_path / "big.bin"
    local.write_bytes(data)
    bucket = s3_bucket[len("s3://"):]
    fs.put_file(str(local), f"{bucket}/put", chunksize=5 * 2**20)  # 3 parts
    fs.pipe_file(f"{bucket}/pipe", data, chunksize=5 * 2**20)
    assert fs.cat(f"{bucket}/put") == data
    assert fs.cat(f"{bucket}/pipe") == data


def test_s3_restart_keeps_data(seaweed, s3_bucket):
    fs = seaweed.filesystem()
    path = f"{s3_bucket[len('s3://'):]}/kept"
    fs.pipe(path, b"survives")
    old = (seaweed.pid, seaweed.port)
    seaweed.restart()
    assert seaweed.pid != old[0] and seaweed.port == old[1]
    assert seaweed.filesystem().cat(path) == b"survives"
    assert fs.cat(path) == b"survives"  # an existing client reconnects


@pytest.mark.parametrize("creds", [{"secret": "wrong-secret"}, {"key": "nobody"}])
def test_s3_bad_credentials_rejected(seaweed, s3_bucket, creds):
    bucket = s3_bucket[len("s3://"):]
    seaweed.filesystem().pipe(f"{bucket}/x", b"1")
    bad = seaweed.filesystem(**creds)
    t0 = time.monotonic()
    with pytest.raises(PermissionError):
        bad.cat(f"{bucket}/x")
    with pytest.raises(PermissionError):
        bad.pipe(f"{bucket}/y", b"1")
    assert time.monotonic() - t0 < 10  # no long retry loop


def test_s3_missing_bucket_and_object(seaweed, s3_bucket):
    fs = seaweed.filesystem()
    with pytest.raises(FileNotFoundError):
        fs.ls("no-such-bucket-tierstore")
    with pytest.raises(FileNotFoundError):
        fs.cat("no-such-bucket-tierstore/x")
    with pytest.raises(FileNotFoundError):  # -s3.autoCreateBucket=false: no implicit bucket
        fs.pipe("no-such-bucket-tierstore/x", b"1")
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{s3_bucket[len('s3://'):]}/missing")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{s3_bucket[len('s3://'):]}/missing")


def test_s3_server_down_raises_connection_error(seaweed, s3_bucket):
    bucket = s3_bucket[len("s3://"):]
    # One attempt in botocore and in s3fs, so this fails in well under a second.
    fs = seaweed.filesystem(config_kwargs={"retries": {"max_attempts": 1}})
    fs.retries = 1
    fs.pipe(f"{bucket}/x", b"1")
    seaweed.kill()
    try:
        with pytest.raises(botocore.exceptions.EndpointConnectionError) as info:
            fs.cat(f"{bucket}/x")
        # Not an OSError: s3fs passes botocore's connection errors through untranslated.
        assert not isinstance(info.value, OSError)
    finally:
        seaweed.restart()
    assert fs.cat(f"{bucket}/x") == b"1"


# ----------------------------------------------------------------------------- GCS


def test_gcs_round_trip(fake_gcs, gcs_bucket):
    assert gcs_bucket.startswith("gs://")
    _round_trip(fake_gcs.filesystem(), gcs_bucket[len("gs://"):])


def test_gcs_through_fsspec_url(fake_gcs, gcs_bucket):
    fs, root = fsspec.core.url_to_fs(gcs_bucket, **fake_gcs.storage_options())
    assert type(fs).__name__ == "GCSFileSystem"  # not the ZB/HNS ExtendedGcsFileSystem
    fs.pipe(f"{root}/a", b"1")
    with fsspec.open(f"{gcs_bucket}/b", "wb", **fake_gcs.storage_options()) as f:
        f.write(b"22")
    assert sorted(fs.ls(root, detail=False)) == [f"{root}/a", f"{root}/b"]
    assert fs.cat_ranges([f"{root}/a", f"{root}/b"], [0, 1], [1, 2]) == [b"1", b"2"]


def test_gcs_resumable_upload(fake_gcs, gcs_bucket, tmp_path):
    fs = fake_gcs.filesystem()
    data = os.urandom(11 * 2**20 + 123)
    local = tmp_path / "big.bin"
    local.write_bytes(data)
    bucket = gcs_bucket[len("gs://"):]
    fs.put_file(str(local), f"{bucket}/put", chunksize=4 * 2**20)
    fs.pipe_file(f"{bucket}/pipe", data, chunksize=4 * 2**20)
    assert fs.cat(f"{bucket}/put") == data
    assert fs.cat(f"{bucket}/pipe") == data


def test_gcs_restart_keeps_data(fake_gcs, gcs_bucket):
    path = f"{gcs_bucket[len('gs://'):]}/kept"
    fake_gcs.filesystem().pipe(path, b"survives")
    old = (fake_gcs.pid, fake_gcs.port)
    fake_gcs.restart()
    assert fake_gcs.pid != old[0] and fake_gcs.port == old[1]
    assert fake_gcs.filesystem().cat(path) == b"survives"


def test_gcs_missing_bucket_and_object(fake_gcs, gcs_bucket):
    fs = fake_gcs.filesystem()
    with pytest.raises(FileNotFoundError):
        fs.ls("no-such-bucket-tierstore")
    with pytest.raises(FileNotFoundError):
        fs.cat("no-such-bucket-tierstore/x")
    with pytest.raises(FileNotFoundError):
        fs.pipe("no-such-bucket-tierstore/x", b"1")
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{gcs_bucket[len('gs://'):]}/missing")


def test_gcs_emulator_env(fake_gcs):
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert os.environ["STORAGE_EMULATOR_HOST"] == fake_gcs.endpoint_url


def test_server_stop_leaves_nothing(tmp_path):
    server = FakeGCS(set_env=False, backend="memory")
    server.start()
    pid, directory = server.pid, server.dir
    os.kill(pid, 0)  # alive
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not directory.exists()
    assert server.pid is None
