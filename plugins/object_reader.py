"""Reading one object front to back at the client's limit: the reader both object-store
backends (``fsspec``, ``obstore``) hand a load.

A load reads a file front to back (checking it as it goes), and what it does with each piece
(hash it, copy it into a tensor) takes about as long as fetching it. So the reader keeps ranges
of ``CHUNK`` bytes in flight *ahead* of the position being read (as many as the backend's
``concurrency``, at most ``AHEAD_BYTES``), on the backend's own threads, and hands each one out
as it arrives: the fetches of the next pieces overlap the work on this one, and memory stays
bounded by ``AHEAD_BYTES`` per reader.
Pieces are handed out as the buffers the client returned, never joined into one (a 64 MiB
join is one more copy of every byte).
"""

from __future__ import annotations

import collections
import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol

from tierstore.plugin import RetryPolicy, foreground

__all__ = ["AHEAD_BYTES", "CHUNK", "LazyPool", "ObjectReader", "RangeSource"]

#: bytes of each ranged GET a sequential read asks for
CHUNK = 8 << 20
#: at most this many bytes fetched ahead of a sequential read
AHEAD_BYTES = 64 << 20


class RangeSource(Protocol):
    """What the reader needs of a backend."""

    #: ranged GETs one reader may keep in flight
    concurrency: int

    def read_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Any]:
        """Bytes ``[starts[i], ends[i])`` of object ``key`` (any buffer), retried."""

    def read_pool(self) -> Any:
        """The executor whose threads make the backend's concurrent requests."""


class LazyPool:
    """A backend's request threads, started on first use (a store that never reads from the
    tier starts none) and stopped by ``shutdown`` (the backend's ``close``)."""

    def __init__(self, threads: int, name: str):
        self._threads, self._name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._making = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        """The executor, made on the first call."""
        if self._pool is None:
            with self._making:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=self._threads,
                                                    thread_name_prefix=self._name)
        return self._pool

    def shutdown(self) -> None:
        """Stop the threads (requests queued and not started are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class ObjectReader(io.RawIOBase):
    """A seekable reader over one object of ``size`` bytes (a size the manifest vouches for:
    a shorter object fails a read, a longer one its checksum). Sequential reads are served
    from ranges fetched ahead; ``read_ranges`` fetches exactly the ranges asked, at once."""

    def __init__(self, backend: RangeSource, key: str, size: int):
        super().__init__()
        self._b, self._key, self._size = backend, key, size
        self._pos = 0
        # ranges fetched or being fetched, in order, contiguous from ``self._pos``'s range
        self._ahead: collections.deque[tuple[int, int, Future]] = collections.deque()
        self._next = 0  # where the next range to ask for starts

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        # Ranges behind the new position are dropped; a jump past the ones in flight starts
        # the read-ahead again there.
        while self._ahead and self._ahead[0][1] <= self._pos:
            self._ahead.popleft()[2].cancel()
        if self._ahead and self._ahead[0][0] > self._pos:
            self._drop_ahead()
        if not self._ahead:
            self._next = self._pos
        return self._pos

    def read_ranges(self, starts: list[int], ends: list[int]) -> list[Any]:
        """Bytes ``[starts[i], ends[i])`` of the object for each i, fetched concurrently, and
        nothing else (a load that needs some blocks of a file reads those)."""
        return self._b.read_ranges(self._key, starts, ends)

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        if self._pos >= self._size or not len(view):
            return 0
        self._fill_ahead()
        start, end, fut = self._ahead[0]
        data = memoryview(fut.result()).cast("B")
        if len(data) != end - start:
            raise OSError(f"object {self._key!r} is shorter than {self._size} bytes (bytes "
                          f"{start}-{end} came back as {len(data)})")
        offset = self._pos - start
        n = min(len(view), end - self._pos)
        view[:n] = data[offset:offset + n]
        self._pos += n
        if self._pos >= end:
            self._ahead.popleft()
            self._fill_ahead()
        return n

    def close(self) -> None:
        self._drop_ahead()
        super().close()

    def _fill_ahead(self) -> None:
        """Keep ranges from the current one on asked for (see the module docstring)."""
        pool, most = None, max(1, min(self._b.concurrency, AHEAD_BYTES // CHUNK))
        while len(self._ahead) < most and self._next < self._size:
            start, end = self._next, min(self._size, self._next + CHUNK)
            pool = pool or self._b.read_pool()
            self._ahead.append((start, end, pool.submit(_in_callers_mode(
                lambda s=start, e=end: self._b.read_ranges(self._key, [s], [e])[0]))))
            self._next = end

    def _drop_ahead(self) -> None:
        while self._ahead:
            self._ahead.popleft()[2].cancel()


def _in_callers_mode(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` to run on another thread as if on this one: inside ``foreground()`` when this
    thread is (a call that can do without the tier gives up as quickly there)."""
    if not RetryPolicy.in_foreground():
        return fn

    def in_foreground():
        with foreground():
            return fn()
    return in_foreground
