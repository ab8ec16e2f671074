"""Lightning's checkpoint paths and tierstore's checkpoint ids, one to one.

Lightning names a checkpoint by a path (``<dirpath>/epoch=3-step=100.ckpt``, ``last.ckpt``,
``last-v1.ckpt``); a tierstore id is one path segment of letters, digits, ``.``, ``_`` and ``-``,
not starting with ``.``, at most 200 characters. The id is made from the whole path, since two
``ModelCheckpoint`` callbacks (or two runs sharing a store) save the same file name into
different directories, and each of those is a checkpoint of its own that Lightning keeps or
removes on its own:

``<digest>_.<name>``

- ``<digest>`` is :func:`directory_digest` of the file's directory: the first 12 hex digits of
  the SHA-256 of the directory made absolute and normalized (``os.path.abspath``; links are not
  resolved, no file system is read);
- ``_.`` separates it from the name (the name's part never starts with it, and the rule below
  never makes ``_.``: this is how an id of this rule is told from one of the rule before it);
- ``<name>`` is the file name, escaped:

  1. a trailing ``.ckpt`` (Lightning's extension) is dropped, so that the id ends with the step
     of Lightning's default names (``epoch=3-step=100.ckpt`` -> ``...100``), the number a
     tier's ``every`` reads; any other name keeps its whole text and gets a lone ``_`` at the
     end;
  2. letters, digits, ``-`` and ``.`` stay as they are (but a leading ``.``);
  3. ``_`` becomes ``__``;
  4. every other character (``=`` above all), and a leading ``.``, becomes ``_`` and two
     upper-case hex digits per byte of its UTF-8 encoding, as ``%3D`` in a URL: ``=`` is
     ``_3D``.

So in a directory whose digest is ``3fa9c2d1e0b4``, ``epoch=3-step=100.ckpt`` is
``3fa9c2d1e0b4_.epoch_3D3-step_3D100``, ``last.ckpt`` is ``3fa9c2d1e0b4_.last``,
``val_loss=0.12.ckpt`` is ``3fa9c2d1e0b4_.val__loss_3D0.12`` and ``model.pt`` is
``3fa9c2d1e0b4_.model.pt_``. Every ``_`` of the name's part starts one of the three escapes, so
an id reads back into exactly one name: :func:`checkpoint_path` is the inverse of
:func:`checkpoint_id`, and refuses an id this mapping does not make, or one made for another
directory.

Ids of the rule before this one (the escaped name alone, ``epoch_3D3-step_3D100``) are still
read: the pointer file at a checkpoint's path names its id, and the strategies load the id a
pointer names (:func:`checkpoint_path` reads such an id as a file name in any directory).
"""

from __future__ import annotations

import hashlib
import os
import re

__all__ = ["checkpoint_id", "checkpoint_path", "directory_digest", "is_checkpoint_of",
           "EXTENSION", "MAX_ID_LENGTH", "DIGEST_LENGTH"]

#: Lightning's checkpoint file extension (``ModelCheckpoint.FILE_EXTENSION``)
EXTENSION = ".ckpt"
#: tierstore's longest checkpoint id
MAX_ID_LENGTH = 200
#: hex digits of the directory's digest at the start of an id
DIGEST_LENGTH = 12

_SEPARATOR = "_."  # between the digest and the name: never made by the name's escapes
_PLAIN = re.compile(r"[A-Za-z0-9.\-]")
_HEX = "0123456789ABCDEF"
_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_LENGTH}}}")
_NOT_CKPT = "_"  # the mark, at the end of an id, of a name without Lightning's extension


def directory_digest(dirpath: str | os.PathLike) -> str:
    """The first :data:`DIGEST_LENGTH` hex digits of the SHA-256 of ``dirpath`` made absolute
    and normalized (``os.path.abspath``, relative to this process's working directory): how
    the ids of the checkpoints saved in that directory start."""
    absolute = os.path.abspath(os.fspath(dirpath))
    return hashlib.sha256(absolute.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_LENGTH]


def checkpoint_id(path: str | os.PathLike) -> str:
    """The tierstore checkpoint id of Lightning's checkpoint ``path``: its directory's digest
    and its file name (see the module docstring for the rule). ValueError when the name is
    empty or its id would be longer than tierstore allows."""
    text = os.fspath(path).rstrip("/" + os.sep)
    name = os.path.basename(text)
    if not name:
        raise ValueError(f"checkpoint path {os.fspath(path)!r} has no file name to make a "
                         f"tierstore checkpoint id of")
    cid = directory_digest(os.path.dirname(os.path.abspath(text))) + _SEPARATOR + _escape(name)
    if len(cid) > MAX_ID_LENGTH:
        raise ValueError(f"checkpoint file name {name!r} makes a tierstore id of {len(cid)} "
                         f"characters, and at most {MAX_ID_LENGTH} are allowed ("
                         f"{DIGEST_LENGTH + len(_SEPARATOR)} for the directory, and each "
                         f"character of the name but letters, digits, '.' and '-' takes three): "
                         f"choose a shorter ModelCheckpoint(filename=...)")
    return cid


def is_checkpoint_of(checkpoint_id: str, dirpath: str | os.PathLike) -> bool:
    """Whether ``checkpoint_id`` is the id of a checkpoint saved in ``dirpath`` (by this rule;
    an id of the rule before it does not say where it was saved: False)."""
    digest, escaped = _split(checkpoint_id)
    return digest is not None and digest == directory_digest(dirpath) and bool(escaped)


def checkpoint_path(checkpoint_id: str, dirpath: str | os.PathLike) -> str:
    """The path in ``dirpath`` of the Lightning checkpoint that ``checkpoint_id`` stands for:
    the inverse of :func:`checkpoint_id`. ValueError for an id the mapping does not make (an id
    saved by other code than this adapter, e.g. ``step_100``), or one saved in another
    directory. An id of the rule before this one (the name alone) reads as that name in
    ``dirpath``."""
    digest, escaped = _split(checkpoint_id)
    name = _name_of(escaped, checkpoint_id)
    if digest is not None and digest != directory_digest(dirpath):
        raise ValueError(f"checkpoint id {checkpoint_id!r} was saved in another directory than "
                         f"{os.fspath(dirpath)!r} (its digest is {digest}, that directory's is "
                         f"{directory_digest(dirpath)})")
    return os.path.join(os.fspath(dirpath), name)


def _split(cid: str) -> tuple[str | None, str]:
    """(digest, the name's part) of an id of this rule; (None, cid) for any other."""
    end = DIGEST_LENGTH + len(_SEPARATOR)
    if cid[DIGEST_LENGTH:end] == _SEPARATOR and _DIGEST.fullmatch(cid[:DIGEST_LENGTH]):
        return cid[:DIGEST_LENGTH], cid[end:]
    return None, cid


def _escape(name: str) -> str:
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
    return "".join(out)


def _name_of(escaped: str, cid: str) -> str:
    raw = bytearray()
    i, n, ckpt = 0, len(escaped), True
    while i < n:
        char = escaped[i]
        if char != "_":
            raw += char.encode("ascii", "replace")
            i += 1
        elif i + 1 == n:
            ckpt = False  # the mark of a name without the extension
            i += 1
        elif escaped[i + 1] == "_":
            raw += b"_"
            i += 2
        elif i + 2 < n and escaped[i + 1] in _HEX and escaped[i + 2] in _HEX:
            raw.append(int(escaped[i + 1:i + 3], 16))
            i += 3
        else:
            raise _foreign(cid)
    try:
        stem = raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise _foreign(cid) from None
    name = stem + EXTENSION if ckpt else stem
    # One name, one id: an id spelling a character another way (``_41`` for ``A``) is not ours.
    if not stem or _escape(name) != escaped:
        raise _foreign(cid)
    return name


def _foreign(cid: str) -> ValueError:
    return ValueError(f"{cid!r} is not a checkpoint id that tierstore.integrations.lightning "
                      f"makes from a Lightning checkpoint path (see "
                      f"tierstore.integrations.lightning.paths); was it saved by other code?")
