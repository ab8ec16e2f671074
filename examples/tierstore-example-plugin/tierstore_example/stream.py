"""The DCP ``StreamTransformExtension`` behind codec ``example-zlib``: each item one zlib
stream, written and read in pieces, with the descriptor ``stream.zlib@tierstore-example/1``.

A module of its own because it imports DCP (seconds): the codec imports it only when a save or
a load asks for the extension, so that a store opened to list checkpoints (``tierstore ls``)
does not pay for it. Stock DCP reads such a checkpoint when given a registry that knows it::

    registry = ExtensionRegistry(); registry.register(ZlibStream)
    dcp.load(sd, storage_reader=FileSystemReader(path, _extension_registry=registry))
"""

from __future__ import annotations

import io
import zlib
from typing import IO

from torch.distributed.checkpoint._extension import StreamTransformExtension

__all__ = ["ZlibStream"]

_CHUNK = 1 << 20


class _Compressor(io.RawIOBase):
    """Compresses what is written to it into ``output``; ``close()`` ends the zlib stream and
    leaves ``output`` open."""

    def __init__(self, output: IO[bytes], level: int):
        super().__init__()
        self._output = output
        self._zlib = zlib.compressobj(level)

    def writable(self) -> bool:
        """Always writable."""
        return True

    def write(self, data) -> int:
        """Compress ``data`` (any bytes-like) and pass on what zlib emits."""
        view = memoryview(data).cast("B")
        out = self._zlib.compress(view)
        if out:
            self._output.write(out)
        return len(view)

    def close(self) -> None:
        """Write the end of the zlib stream (once)."""
        if not self.closed:
            self._output.write(self._zlib.flush())
        super().close()


class _Decompressor(io.RawIOBase):
    """Reads a zlib stream from ``source`` and gives back the original bytes, a MiB at most
    held at a time."""

    def __init__(self, source: IO[bytes]):
        super().__init__()
        self._source = source
        self._zlib = zlib.decompressobj()
        self._out = b""
        self._pos = 0

    def readable(self) -> bool:
        """Always readable."""
        return True

    def readinto(self, buffer) -> int:
        """Fill ``buffer`` with decompressed bytes; 0 at the end of the stream."""
        while self._pos == len(self._out):
            if self._zlib.eof:
                return 0
            compressed = self._zlib.unconsumed_tail or self._source.read(_CHUNK)
            if compressed:
                self._out, self._pos = self._zlib.decompress(compressed, _CHUNK), 0
                continue
            self._out, self._pos = self._zlib.flush(), 0  # input done: what zlib still holds
            if not self._out and not self._zlib.eof:
                raise EOFError("the zlib stream ends early: the item is truncated")
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._out) - self._pos)
        view[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n


class ZlibStream(StreamTransformExtension):
    """The DCP extension doing the work (the level only matters when writing)."""

    def __init__(self, level: int = 6):
        super().__init__()
        self.level = level

    @staticmethod
    def registry_name() -> str:
        """Name in DCP's ExtensionRegistry (``name@domain``)."""
        return "stream.zlib@tierstore-example"

    @staticmethod
    def from_descriptor(version: str) -> "ZlibStream":
        """The extension for a stored descriptor's version (only 1 exists)."""
        if version.partition(".")[0] != "1":
            raise ValueError(f"unknown version {version!r} of {ZlibStream.registry_name()}")
        return ZlibStream()

    def get_descriptor(self) -> str:
        """``stream.zlib@tierstore-example/1``, recorded with every item."""
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        """A stream compressing into ``output``."""
        return _Compressor(output, self.level)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:  # noqa: A002 - DCP's name
        """A stream decompressing ``input``."""
        return io.BufferedReader(_Decompressor(input), _CHUNK)  # type: ignore[return-value]
