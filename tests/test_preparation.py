"""The clients of remote tiers are made ready in the background once the job saves, so that
the first copy to an object store (every rank copies its own files there) does not import and
make them on the time to durable, while a restart that never touches the tier still makes
none (tests/test_restart_path.py)."""

from __future__ import annotations

import threading
import time

import pytest

from tierstore.engine.preparation import TierPreparation
from tierstore_plugins.fsspec_backend import FsspecBackend


class Backend:
    """What the preparation sees of a backend: where its bytes are, and its prepare."""

    def __init__(self, local: bool, fails: bool = False):
        self.local, self.fails = local, fails
        self.prepared_on: list[str] = []

    def local_path(self, path: str):
        return "/somewhere" if self.local else None

    def prepare(self) -> None:
        self.prepared_on.append(threading.current_thread().name)
        if self.fails:
            raise ConnectionError("no route to the endpoint")


class Tier:
    def __init__(self, name: str, backend: Backend):
        self.name, self.backend = name, backend


def _settled(preparation: TierPreparation, backends: list[Backend]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(b.prepared_on for b in backends):
        time.sleep(0.01)


def test_the_remote_tiers_are_prepared_once_in_the_background_and_the_local_ones_never():
    ram, s3, gcs = Backend(local=True), Backend(local=False, fails=True), Backend(local=False)
    preparation = TierPreparation([Tier("ram", ram), Tier("s3", s3), Tier("gcs", gcs)])
    assert [t.name for t in preparation.tiers] == ["s3", "gcs"]
    preparation.start()
    preparation.start()  # every save calls it: only the first prepares
    _settled(preparation, [s3, gcs])
    time.sleep(0.1)
    # A failure on one tier (the first copy meets it again, and says so) spares the next.
    assert s3.prepared_on == ["tierstore-prepare"] and gcs.prepared_on == ["tierstore-prepare"]
    assert ram.prepared_on == []


def test_preparing_an_s3_tier_makes_its_client_and_asks_the_server_nothing(seaweed, s3_bucket):
    backend = FsspecBackend(f"{s3_bucket}/ckpt", options=seaweed.storage_options())
    bucket = s3_bucket.split("://", 1)[1]
    before = seaweed.request_counts(bucket)
    backend.prepare()
    assert backend._made is not None  # the filesystems, made before any copy asks
    fs = backend._made[0]
    assert getattr(fs, "_s3", None) is not None  # and s3fs's client with its session
    assert seaweed.request_counts(bucket) == before
    backend.close()


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_tier_on_this_machine_has_nothing_to_prepare(tmp_path, where):
    url = f"file://{tmp_path}/tier" if where == "file" else "memory://prepared"
    backend = FsspecBackend(url)
    backend.prepare()  # (no client to make; nothing fails)
    backend.close()
