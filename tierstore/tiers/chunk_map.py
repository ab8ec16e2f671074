"""A deduplicated file's chunks laid side by side in one mapping, as if the file were whole.

A load checks a local file through its pages, mapped (no copy; see
:func:`tierstore.format.item_io.map_checked`). A file of a deduplicated tier is its chunks, each
a file of its own; read into memory, it would cost a copy of every byte and a fresh page for
each. Instead :func:`map_chunks` reserves the file's length of address space and maps each
chunk's file at the chunk's offset in it (``MAP_FIXED``), so that the checked bytes are the
chunks' own pages, in order, at one address. A mapping needs a page-aligned start in the file:
chunks start where items start, and a save that cuts chunks starts each large item on a page
(:data:`tierstore.format.item_io.ALIGN_ITEMS_FROM`); what lies elsewhere (small items, the tail of a chunk shorter than
a page) is read into the reserved pages instead.

A chunk's file is mapped only when nobody but this user can change it (it is replaced by a
rename, never written in place: the mapped pages stay those checked); any other is read.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
from typing import IO, Callable

from tierstore.format.item_io import only_this_user_writes

__all__ = ["map_chunks"]

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)


def map_chunks(chunks: list[tuple[int, str]], open_chunk: Callable[[int, str], IO[bytes]],
               name: str) -> mmap.mmap | None:
    """The file the chunks ``chunks`` (``(length, digest)`` in order) make, as one read-only
    view: an anonymous mapping of the file's length with each page-aligned chunk's file
    mapped over its place and the rest read in. ``open_chunk(index, digest)`` opens a chunk's
    file (raising what a missing one raises). None where this system cannot map at a fixed
    address; OSError when a chunk's file is shorter than its recipe says."""
    size = sum(length for length, _ in chunks)
    if size == 0 or not hasattr(os, "pread"):
        return None
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        holder = ctypes.c_char.from_buffer(region)
        base = ctypes.addressof(holder)
        del holder  # (an exported buffer would keep region.close() from unmapping)
        view = memoryview(region)
        try:
            offset = 0
            for index, (length, digest) in enumerate(chunks):
                with open_chunk(index, digest) as f:
                    _place(f, view, base, offset, length, name, digest)
                offset += length
        finally:
            view.release()
    except BaseException:
        region.close()
        raise
    return region


def _place(f: IO[bytes], view: memoryview, base: int, offset: int, length: int, name: str,
           digest: str) -> None:
    """Put chunk ``digest`` (``length`` bytes, open as ``f``) at ``offset`` of the region."""
    fd = f.fileno()
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < length:
        raise OSError(f"{name}: chunk {digest} holds {st.st_size} bytes, its recipe says "
                      f"{length}")
    mapped = 0
    if offset % _PAGE == 0 and only_this_user_writes(st):
        mapped = length - length % _PAGE
        if mapped:
            got = _libc.mmap(base + offset, mapped, mmap.PROT_READ,
                             mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
            if got != base + offset:  # (MAP_FAILED: the reserved pages stay, and are read)
                mapped = 0
    pos = mapped
    while pos < length:
        n = os.preadv(fd, [view[offset + pos:offset + length]], pos)
        if n <= 0:
            raise OSError(f"{name}: chunk {digest} ends {length - pos} bytes early")
        pos += n

