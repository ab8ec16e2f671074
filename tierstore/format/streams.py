"""Writing to a file object that may take fewer bytes than it is given.

A raw file (``io.FileIO``, a socket, a plugin's own file object) may write only part of a
large buffer and say so in what ``write`` returns; a caller that ignores it loses the rest
without an error (the file is short, found only when it is read back). Every write of the core
to a backend's file goes through :func:`write_all`.
"""

from __future__ import annotations

from typing import IO

__all__ = ["write_all"]


def write_all(f: IO[bytes], data) -> None:
    """Write every byte of ``data`` (bytes-like) to ``f``, again and again while it takes only
    part of them. A ``write`` that returns None (a file object that does not count) is taken
    to have written everything; one that writes nothing raises OSError naming the file."""
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        if n is None or n >= len(view):
            return
        if n <= 0:
            raise OSError(f"{getattr(f, 'name', f)!r} took none of the {len(view)} bytes "
                          f"it was given (is the disk full?)")
        view = view[n:]
