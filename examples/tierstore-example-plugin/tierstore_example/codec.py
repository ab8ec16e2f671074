"""Codec ``example-zlib``: compresses every item of a checkpoint with zlib, through the DCP
extension in :mod:`tierstore_example.stream`.

tierstore registers the extension class with its reader when a tier uses the codec. The codec
imports it (and with it DCP) only when asked for it: plugins are imported whenever a store
opens, ``tierstore ls`` included, and a plugin that imports torch at its top makes every such
command wait seconds for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierstore.plugin import Codec, Option

if TYPE_CHECKING:
    from .stream import ZlibStream

__all__ = ["ZlibCodec"]


def _level(value: int) -> str | None:
    return None if 0 <= value <= 9 else "must be 0 (store) to 9 (smallest)"


class ZlibCodec(Codec):
    """Compresses every item of a checkpoint with zlib."""

    options = (Option("level", int, default=6, check=_level,
                      description="zlib level: 0 (store) to 9 (smallest), 6 by default"),)

    def __init__(self, level: int = 6):
        self.level = level

    def extension(self) -> ZlibStream:
        """A fresh extension at this codec's level (DCP is imported here, on first use)."""
        from .stream import ZlibStream

        return ZlibStream(self.level)
