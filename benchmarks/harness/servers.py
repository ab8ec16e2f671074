"""The object store a benchmark measures against: a SeaweedFS S3 server of its own on this
machine (``tierstore_simulate.servers``, the tests' server: ``weed server -s3`` in a temp dir, on
free ports, credentials enforced), and what the benchmarks ask of it besides the store's own
traffic: a free port, a prefix deleted, the server's request counters read."""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Callable, Iterator

from tierstore_simulate.servers import ACCESS_KEY, REGION, SECRET_KEY, SeaweedS3

__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "SeaweedS3", "counts_delta", "delete_prefix",
           "free_port", "seaweed"]


@contextmanager
def seaweed(*buckets: str, log: Callable[[str], None] | None = None,
            label: str = "") -> Iterator[SeaweedS3]:
    """A SeaweedFS S3 server started with ``buckets`` made (``log``: a line saying where and
    how fast it came up, ``label`` after the name), stopped at the end (SIGKILL by pid, its
    data dir removed) whatever happened, also when the benchmark killed it itself."""
    server = SeaweedS3()
    try:
        server.start()
        for bucket in buckets:
            server.make_bucket(bucket)
        if log is not None:
            log(f"SeaweedFS{label} up at {server.endpoint_url} in "
                f"{server.startup_seconds:.1f} s (pid {server.pid})")
        yield server
    finally:
        server.stop()


def delete_prefix(fs, path: str) -> None:
    """Delete every object under ``path`` (``bucket/prefix``) with s3fs ``fs``, if any, and
    forget what ``fs`` cached of it."""
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)


def counts_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What two readings of the server's request counters (``SeaweedS3.request_counts``) differ
    by, per request type, leaving out the types that did not move."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))
            if after.get(k, 0) != before.get(k, 0)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
