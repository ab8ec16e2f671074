"""Lightning's checkpoint paths and tierstore's checkpoint ids, one to one.

Lightning names a checkpoint by a path (``<dirpath>/epoch=3-step=100.ckpt``, ``last.ckpt``,
``last-v1.ckpt``); a tierstore id is one path segment of letters, digits, ``.``, ``_`` and ``-``,
not starting with ``.``, at most 200 characters. The id is made from the file name alone (the
directory is where Lightning looks, not part of the checkpoint's name in the store):

1. a trailing ``.ckpt`` (Lightning's extension) is dropped, so that the id ends with the step of
   Lightning's default names (``epoch=3-step=100.ckpt`` -> ``...100``), the number a tier's
   ``every`` reads; any other name keeps its whole text and gets a lone ``_`` at the end;
2. letters, digits, ``-`` and ``.`` stay as they are (but a leading ``.``);
3. ``_`` becomes ``__``;
4. every other character (``=`` above all), and a leading ``.``, becomes ``_`` and two
   upper-case hex digits per byte of its UTF-8 encoding, as ``%3D`` in a URL: ``=`` is ``_3D``.

So ``epoch=3-step=100.ckpt`` is ``epoch_3D3-step_3D100``, ``last.ckpt`` is ``last``,
``last-v1.ckpt`` is ``last-v1``, ``val_loss=0.12.ckpt`` is ``val__loss_3D0.12`` and ``model.pt``
is ``model.pt_``. Every ``_`` of an id starts one of the three escapes, so an id reads back into
exactly one name: :func:`checkpoint_path` is the inverse of :func:`checkpoint_id`, and refuses an
id this mapping does not make.
"""

from __future__ import annotations

import os
import re

__all__ = ["checkpoint_id", "checkpoint_path", "EXTENSION", "MAX_ID_LENGTH"]

#: Lightning's checkpoint file extension (``ModelCheckpoint.FILE_EXTENSION``)
EXTENSION = ".ckpt"
#: tierstore's longest checkpoint id
MAX_ID_LENGTH = 200

_PLAIN = re.compile(r"[A-Za-z0-9.\-]")
_HEX = "0123456789ABCDEF"
_NOT_CKPT = "_"  # the mark, at the end of an id, of a name without Lightning's extension


def checkpoint_id(path: str | os.PathLike) -> str:
    """The tierstore checkpoint id of Lightning's checkpoint ``path`` (its file name; see the
    module docstring for the rule). ValueError when the name is empty or its id would be longer
    than tierstore allows."""
    name = os.path.basename(os.fspath(path).rstrip("/" + os.sep))
    if not name:
        raise ValueError(f"checkpoint path {os.fspath(path)!r} has no file name to make a "
                         f"tierstore checkpoint id of")
    ckpt = name.endswith(EXTENSION) and len(name) > len(EXTENSION)
    stem = name[:-len(EXTENSION)] if ckpt else name
    out = []
    for i, char in enumerate(stem):
        if _PLAIN.fullmatch(char) and not (i == 0 and char == "."):
            out.append(char)
        elif char == "_":
            out.append("__")
        else:
            out.extend(f"_{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
    if not ckpt:
        out.append(_NOT_CKPT)
    cid = "".join(out)
    if len(cid) > MAX_ID_LENGTH:
        raise ValueError(f"checkpoint file name {name!r} makes a tierstore id of {len(cid)} "
                         f"characters, and at most {MAX_ID_LENGTH} are allowed (each character "
                         f"but letters, digits, '.' and '-' takes three): choose a shorter "
                         f"ModelCheckpoint(filename=...)")
    return cid


def checkpoint_path(checkpoint_id: str, dirpath: str | os.PathLike) -> str:
    """The path in ``dirpath`` of the Lightning checkpoint that ``checkpoint_id`` stands for:
    the inverse of :func:`checkpoint_id`. ValueError for an id the mapping does not make (an id
    saved by other code than this adapter, e.g. ``step_100``)."""
    name = _name_of(checkpoint_id)
    return os.path.join(os.fspath(dirpath), name)


def _name_of(cid: str) -> str:
    raw = bytearray()
    i, n, ckpt = 0, len(cid), True
    while i < n:
        char = cid[i]
        if char != "_":
            raw += char.encode("ascii", "replace")
            i += 1
        elif i + 1 == n:
            ckpt = False  # the mark of a name without the extension
            i += 1
        elif cid[i + 1] == "_":
            raw += b"_"
            i += 2
        elif i + 2 < n and cid[i + 1] in _HEX and cid[i + 2] in _HEX:
            raw.append(int(cid[i + 1:i + 3], 16))
            i += 3
        else:
            raise _foreign(cid)
    try:
        stem = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _foreign(cid) from None
    name = stem + EXTENSION if ckpt else stem
    # One name, one id: an id spelling a character another way (``_41`` for ``A``) is not ours.
    if not stem or checkpoint_id(name) != cid:
        raise _foreign(cid)
    return name


def _foreign(cid: str) -> ValueError:
    return ValueError(f"{cid!r} is not a checkpoint id that tierstore.integrations.lightning "
                      f"makes from a Lightning checkpoint path (see "
                      f"tierstore.integrations.lightning.paths); was it saved by other code?")
