"""Codec ``zstd``: Zstandard compression in DCP's own ``stream.zstd`` format.

Each item is one zstd frame, recorded in the metadata with the descriptor ``stream.zstd/1``:
stock DCP readers (``dcp.load(checkpoint_id=<dir>)``) decompress it with their built-in
extension, so a zstd checkpoint on a filesystem tier still loads without tierstore. Unlike the
stock extension, the level is configurable: ``codecs = [{ name = "zstd", level = 9 }]``.
"""

from __future__ import annotations

import functools
from typing import IO, Any

import zstandard

from tierstore.plugin import Codec, hookimpl, Option


def _level(value: int) -> str | None:
    lo, hi = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL
    return None if lo <= value <= hi and value != 0 else f"must be in {lo}..{hi}, not 0"


@functools.cache
def _leveled_zstandard() -> type:
    """:class:`LeveledZStandard`, defined on first use: its base, DCP's extension, takes
    seconds to import, which registering the plugin (every store does) should not cost."""
    from torch.distributed.checkpoint._extension import ZStandard

    class LeveledZStandard(ZStandard):
        """DCP's ``stream.zstd`` extension, compressing at a chosen level (same frames, same
        descriptor, so any reader of the format decodes it)."""

        def __init__(self, level: int = 3, threads: int = 0):
            super().__init__()
            self.level = level
            self.threads = threads

        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            compressor = zstandard.ZstdCompressor(level=self.level, threads=self.threads)
            return compressor.stream_writer(output, closefd=False)

    LeveledZStandard.__qualname__ = "LeveledZStandard"  # pickled by reference, as a global
    return LeveledZStandard


def __getattr__(name: str) -> Any:
    if name == "LeveledZStandard":
        return _leveled_zstandard()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ZstdCodec(Codec):
    """Compresses every item of a checkpoint with Zstandard."""

    options = (
        Option("level", int, default=3, check=_level,
               description="compression level: 1 (fast) to 22 (small), negative for faster"),
        Option("threads", int, default=0,
               description="compression threads per item (0: compress in the writing thread)"),
    )

    def __init__(self, level: int = 3, threads: int = 0):
        self.level = level
        self.threads = threads

    def extension(self) -> Any:  # a LeveledZStandard
        return _leveled_zstandard()(self.level, self.threads)


@hookimpl
def tierstore_register_codecs(register):
    register("zstd", ZstdCodec)
