"""Ends of a file transfer over torch.distributed: local files as uint8 tensors over the page
cache, a new file written piece by piece, and a buffer in memory.

Sending a file from a read buffer costs a copy into the buffer; on tmpfs (where node-local and
peer tiers usually live) the page cache *is* the file, so mapping it lets gloo read the file's
own pages. Pieces are mapped with ``MAP_POPULATE``: the page tables are filled in one system
call instead of one fault per 4 KiB page inside the transfer (about half the transfer's time on
tmpfs, measured). Receiving goes into mapped pages only where they exist already (a recycled
file, tierstore_plugins.recycle); a new file is written from reused buffers, because faulting
fresh tmpfs pages in inside gloo's receive is ten times slower than writing them.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where an end makes a tensor: `tierstore ls` loads none
    import torch

__all__ = ["TransferEnd", "DescriptorEnd", "MappedFile", "WrittenFile", "FileSource",
           "BufferTarget", "map_populated"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere pages fault in as touched


def map_populated(fd: int, length: int, *, writable: bool, offset: int = 0) -> torch.Tensor:
    """Bytes ``[offset, offset + length)`` of the open file ``fd`` (``length`` > 0, ``offset``
    a multiple of the page size) as a uint8 tensor over its pages, shared with the file, page
    tables filled at once; the mapping lives as long as the tensor (and its views)."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    region = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _POPULATE, prot=prot, offset=offset)
    import torch

    with warnings.catch_warnings():
        # A read-only mapping: torch warns that writes would fail; nothing writes to it.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(region, dtype=torch.uint8)


class TransferEnd:
    """One end of a file transfer between ranks (``tierstore.transport.transfer``): the file a
    piece is sent from or received into.

    The contract: an end with ``in_place = True`` hands out its own memory with :meth:`piece`
    (a mapped file, a buffer), so gloo sends from it or receives into it without a copy. An end
    with ``in_place = False`` is a stream: a sending end fills the transfer's reused buffers
    with :meth:`read_into`, a receiving end gets each arrived piece through :meth:`write_at`.
    :meth:`close` ends it (``fsync``: make what was written durable). Backends hand out their
    own ends through :meth:`tierstore.plugin.Backend.sending_end` and ``receiving_end``."""

    #: True: pieces are views of this end's own memory (:meth:`piece`); False: a stream
    in_place: bool = True

    def piece(self, offset: int, length: int) -> torch.Tensor:
        """In-place ends: bytes ``[offset, offset + length)`` as a uint8 tensor to send from or
        receive into."""
        raise NotImplementedError(f"{type(self).__name__} is not an in-place transfer end")

    def read_into(self, offset: int, view: memoryview) -> int:
        """Streaming sending ends: read ``len(view)`` bytes at ``offset`` into ``view``; return
        how many were read."""
        raise NotImplementedError(f"{type(self).__name__} cannot be read from")

    def write_at(self, offset: int, data: torch.Tensor) -> None:
        """Streaming receiving ends: write a received piece at ``offset``."""
        raise NotImplementedError(f"{type(self).__name__} cannot be written to")

    def close(self, fsync: bool = False) -> None:
        """Release the end (``fsync``: flush what was written first). Closing twice is a no-op."""


class DescriptorEnd(TransferEnd):
    """A transfer end holding an open descriptor of its file, released by :meth:`close`."""

    _fd = -1

    def close(self, fsync: bool = False) -> None:
        """Close the descriptor (``fsync``: flush what was written first); pieces already
        handed out stay valid. Closing twice is a no-op."""
        if self._fd < 0:
            return
        try:
            if fsync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1


class MappedFile(DescriptorEnd):
    """An existing local file of (at least) ``size`` bytes to send, mapped piece by piece as
    uint8 tensors over its pages; a piece stays mapped as long as its tensor lives."""

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        self._fd = os.open(path, os.O_RDONLY)
        held = os.fstat(self._fd).st_size
        if held < size:
            os.close(self._fd)
            raise OSError(f"{path} holds {held} bytes, fewer than the {size} expected")

    def piece(self, offset: int, length: int) -> torch.Tensor:
        """Bytes ``[offset, offset + length)`` as a read-only uint8 tensor over the file's
        pages (mapped from the page ``offset`` is in: a range of a file, such as a parity
        chunk's piece, starts anywhere)."""
        if length == 0:
            import torch

            return torch.empty(0, dtype=torch.uint8)
        lead = offset % mmap.ALLOCATIONGRANULARITY
        pages = map_populated(self._fd, length + lead, writable=False, offset=offset - lead)
        return pages[lead:] if lead else pages



class WrittenFile(DescriptorEnd):
    """A receiving end for a new file: pieces arrive in the transfer's reused buffers and are
    written at their offsets. (Mapping a new tmpfs file and receiving into it faults in every
    fresh page inside the transfer: ten times slower here than writing the pieces.)"""

    in_place = False

    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def fileno(self) -> int:
        """The open descriptor."""
        return self._fd

    def write_at(self, offset: int, data: torch.Tensor) -> None:
        """Write a received piece at ``offset``."""
        view = memoryview(data.numpy())
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)



class FileSource(TransferEnd):
    """A sending end over a readable file object (a backend's ``open_read``): pieces are read
    into the transfer's reused buffers."""

    in_place = False

    def __init__(self, file: IO[bytes]):
        self._file = file

    def read_into(self, offset: int, view: memoryview) -> int:
        """Read ``len(view)`` bytes at ``offset``."""
        self._file.seek(offset)
        return self._file.readinto(view)

    def close(self, fsync: bool = False) -> None:
        """Close the file."""
        self._file.close()


class BufferTarget(TransferEnd):
    """A receiving end in memory: pieces are views of one buffer of the file's size. Its pages
    are not touched before bytes arrive in them: a transfer of some ranges of a large file
    costs memory for those ranges only."""

    def __init__(self, size: int):
        import torch

        self._tensor = torch.empty(size, dtype=torch.uint8)
        #: the file's bytes (those received; others are undefined)
        self.data = memoryview(self._tensor.numpy()) if size else memoryview(b"")

    def piece(self, offset: int, length: int) -> torch.Tensor:
        """A writable view of bytes ``[offset, offset + length)``."""
        return self._tensor[offset:offset + length]

    def close(self, fsync: bool = False) -> None:
        """Nothing to release (the bytes stay in ``data``)."""
