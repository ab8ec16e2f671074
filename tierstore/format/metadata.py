"""Reading DCP's ``.metadata`` from a tier without trusting it.

``.metadata`` is a pickled :class:`~torch.distributed.checkpoint.metadata.Metadata`, and it comes
from tiers other people can write (shared filesystems, buckets). A plain ``pickle.loads`` runs
whatever the pickle asks for (``os.system`` through ``__reduce__``), so :func:`load_metadata`
unpickles with an allow-list of the globals that DCP's metadata is made of, then checks the shape
of what came out before anything (a planner, a read at an offset, a path) relies on it.

The allow-list holds what DCP's writers (``FileSystemWriter.finish`` and ``FsspecWriter``, which
``pickle.dump`` the ``Metadata`` the planner made; tierstore's writer does the same) put in that
file, in every torch and Python version whose checkpoints this torch's ``dcp.load`` still reads:
torch 1.13 (when DCP became ``torch.distributed.checkpoint``) to today, under any Python. It was
taken from the pickles of real saves (plain tensors of every dtype, nested dicts,
non-tensor values, DTensor shards, ShardedTensor, model and optimizer state dicts, zstd-encoded
items) and from DCP's history; every entry is a (module, name) pair, never a whole module:

- ``torch.distributed.checkpoint.metadata``: ``Metadata``, ``TensorStorageMetadata``,
  ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``,
  ``StorageMeta`` (the dataclasses the file is made of) and ``_MEM_FORMAT_ENCODING`` (how
  ``TensorProperties`` pickles its memory format). Files of torch 2.3 and older have no
  ``storage_meta`` (``StorageMeta`` came with torch 2.4, pytorch#124772) nor ``version`` (the
  class defaults, None, stand in), older ``StorageMeta`` no ``modules``; ``planner_data`` is a
  dict of tuples of str and int (the default planner's flattening map), no globals;
- ``torch.distributed._shard.sharded_tensor.metadata``: ``TensorProperties`` and
  ``MEM_FORMAT_ENCODING``. Until torch 2.2 DCP's ``metadata.py`` imported ShardedTensor's
  ``TensorProperties`` instead of defining its own (pytorch#116248 made the copy), so every
  tensor's properties in those checkpoints name that module; DCP's own
  ``test_sharded_tensor_dependency`` (``test/distributed/checkpoint/test_compatibility.py``)
  keeps them loadable. Left out when a torch no longer has the module (its ``dcp.load`` could
  not read them either);
- ``torch.distributed.checkpoint.filesystem._StorageInfo``: where each item sits in which data
  file (``storage_data``; the class has lived in that module since torch 1.13);
- ``torch.Size``: tensor sizes and chunk offsets;
- ``torch.<dtype>`` for each ``torch.dtype`` (``float32``, ``bfloat16``, ...): a dtype pickles as
  a reference to its module-level name, not through ``getattr``; only names that are dtypes are
  allowed, so ``torch.load`` or ``torch.ops`` are not;
- ``torch.serialization._get_layout``: how a ``torch.layout`` pickles (a ``copyreg`` reducer
  ``torch.serialization`` has registered since before DCP existed). It is answered with a lookup
  of this module's own (layout names only), so the pickle never gets hold of torch's function
  or the cache stored on it;
- ``builtins.getattr`` (``__builtin__.getattr`` in a protocol-2 pickle): early CPython 3.11
  releases pickle an enum member by name, ``getattr(<enum class>, <member name>)`` (bpo-44342;
  3.11.2 does, 3.11.7 and 3.12+ pickle ``<enum class>(<value>)`` again), so a checkpoint saved
  there names it for every tensor's memory format. It is answered by a stand-in that returns a
  member of the two memory-format enums above and refuses anything else;
- ``pathlib.PosixPath``, ``PurePosixPath``, ``WindowsPath``, ``PureWindowsPath``, also under
  ``pathlib._local`` (how Python 3.13 names them): ``StorageMeta.checkpoint_id``.
  ``FileSystemWriter`` records ``Path(checkpoint_id)``, ``FsspecWriter`` the id as given (a str or
  any of these paths). A concrete path of the other operating system cannot be made here (a
  checkpoint saved on Windows, loaded on Linux), so its pure path stands in for it.

Nothing else was ever in DCP's metadata: ``torch.memory_format`` cannot be pickled (hence the
encoding enums), nor can tensors be in it; no DCP version used ``collections.OrderedDict`` there;
and ``torch.distributed._shard.metadata.ShardMetadata`` and the ``torch.distributed._shard
.checkpoint`` classes belong to torch 1.12's prototype format (``ShardedTensorStorageMetadata``),
which today's ``dcp.load`` cannot read. No ``builtins`` beyond ``getattr`` are needed (protocol
2+ pickles lists, dicts, tuples, sets, bytes and numbers with opcodes of their own), and
persistent ids are refused.

Even allowed globals can be abused: pickle's BUILD opcode sets attributes on whatever object is
on its stack, and a class, an enum member or a function taken from the allow-list is shared by
the whole process. A pickle could thus rewrite ``Metadata`` or an enum member for every later
save and load. Each load therefore snapshots the attributes of those shared objects and, if the
pickle changed any, restores them and refuses the file.
"""

from __future__ import annotations

import copyreg
import enum
import io
import math
import operator
import os
import pathlib
import pickle
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata,
                                                   _MEM_FORMAT_ENCODING)

from tierstore.errors import IntegrityError
from tierstore.format.paths import is_plain_file_name

try:  # ShardedTensor is deprecated: a torch without it cannot load these checkpoints at all
    from torch.distributed._shard.sharded_tensor import metadata as _sharded_metadata
except ImportError:  # pragma: no cover - every torch tierstore supports still has it
    _sharded_metadata = None

__all__ = ["load_metadata", "ALLOWED_GLOBALS"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_SHARDED_METADATA = "torch.distributed._shard.sharded_tensor.metadata"

#: The classes a tensor's ``properties`` may be: DCP's, and ShardedTensor's (torch <= 2.2).
_TENSOR_PROPERTIES: tuple[type, ...] = (TensorProperties,) + (
    (_sharded_metadata.TensorProperties,) if _sharded_metadata is not None else ())
#: The enums those classes pickle their memory format with.
_MEMORY_FORMAT_ENUMS: tuple[type[enum.Enum], ...] = (_MEM_FORMAT_ENCODING,) + (
    (_sharded_metadata.MEM_FORMAT_ENCODING,) if _sharded_metadata is not None else ())
# Members by name, copied now: what a pickle later does to the classes cannot change them.
_MEMBERS_BY_NAME = [(cls, dict(cls.__members__)) for cls in _MEMORY_FORMAT_ENUMS]

#: the fields of a tensor's TensorProperties besides its dtype, with their types
_PROPERTY_TYPES: tuple[tuple[str, type], ...] = (
    ("layout", torch.layout), ("requires_grad", bool), ("memory_format", torch.memory_format),
    ("pin_memory", bool))

_LAYOUTS: dict[str, torch.layout] = {str(v): v for v in vars(torch).values()
                                     if isinstance(v, torch.layout)}


def _layout(name: object) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a layout by its name, nothing else."""
    layout = _LAYOUTS.get(name) if isinstance(name, str) else None
    if layout is None:
        raise pickle.UnpicklingError(f"{_short(name)} is not a torch layout")
    return layout


def _enum_member(cls: object, name: object) -> enum.Enum:
    """Stands in for ``getattr`` as early CPython 3.11 pickles an enum member,
    ``getattr(<enum class>, <member name>)``: a member of a memory-format enum, nothing else."""
    # Identity, not ``in``/``==``: ``cls`` is whatever the pickle put there.
    members = next((m for c, m in _MEMBERS_BY_NAME if c is cls), None)
    if members is None or not isinstance(name, str) or name not in members:
        raise _Refused(f"its pickle calls getattr({_short(cls)}, {_short(name)}), and DCP "
                       f"metadata only ever looks up a memory-format enum member that way "
                       f"(refused; getattr was not called)")
    return members[name]


# The path classes StorageMeta.checkpoint_id may be; one of the other operating system cannot be
# instantiated here (pathlib raises), so its pure counterpart stands in for it.
_PATHS: dict[str, type] = {
    "PurePosixPath": pathlib.PurePosixPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
    "PosixPath": pathlib.PurePosixPath if os.name == "nt" else pathlib.PosixPath,
    "WindowsPath": pathlib.WindowsPath if os.name == "nt" else pathlib.PureWindowsPath,
}

#: (module, name) -> the object a pickle gets for it; anything else is refused.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_DCP_METADATA, cls.__name__): cls
       for cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                   TensorProperties, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING)},
    **({(_SHARDED_METADATA, name): getattr(_sharded_metadata, name)
        for name in ("TensorProperties", "MEM_FORMAT_ENCODING")}
       if _sharded_metadata is not None else {}),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    **{("torch", name): value for name, value in vars(torch).items()
       if isinstance(value, torch.dtype)},
    ("torch.serialization", "_get_layout"): _layout,
    ("builtins", "getattr"): _enum_member,
    ("__builtin__", "getattr"): _enum_member,  # protocol 2 writes Python 2's module name
    **{(module, name): cls for module in ("pathlib", "pathlib._local")
       for name, cls in _PATHS.items()},
}

# Objects a pickle can reach (globals above and what calling them returns) that outlive the load
# and carry attributes a BUILD opcode could change: the Python classes, the enums' members and
# the stand-in functions. dtypes, layouts and torch.Size refuse new attributes by themselves.
# Each object once (several names lead to the same path class), so that a restore is not undone.
_SHARED: list[object] = list({id(v): v for v in [
    *(v for v in ALLOWED_GLOBALS.values()
      if hasattr(v, "__dict__") and not isinstance(v, torch.dtype)),
    *(member for cls in _MEMORY_FORMAT_ENUMS for member in cls)]}.values())
# copyreg caches ``__slotnames__`` in a class the first time one of its instances is pickled, by
# any thread: fill that cache now, so that during a load a new attribute can only be the pickle's.
for _cls in _SHARED:
    if isinstance(_cls, type):
        copyreg._slotnames(_cls)
del _cls
# One load at a time, so that one load's restore never undoes what another is checking.
_guard_lock = threading.Lock()

_REMEDY = ("the file was not written by DCP/tierstore; restore it from another tier or delete "
           "the checkpoint")


class _Refused(pickle.UnpicklingError):
    """The pickle asked for something the allow-list does not hold."""


class _Invalid(ValueError):
    """What came out of the pickle does not have the shape of DCP metadata."""


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` and no persistent ids."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):  # TypeError: names that are not hashable strings
            raise _Refused(f"its pickle refers to the global {_global_name(module, name)}, "
                           f"which DCP metadata never contains (refused before anything ran)"
                           ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"its pickle holds a persistent id ({_short(pid)}), which DCP metadata "
                       f"never contains")


def load_metadata(raw: bytes, where: str) -> Metadata:
    """Unpickle DCP's ``.metadata`` from ``raw`` with the allow-list of this module, then check
    that it is well-formed DCP metadata (see :func:`_check`).

    ``where`` says which copy it is, for the message (``"tier 'nvme': step-100/.metadata"``).
    Raises :class:`~tierstore.errors.IntegrityError` naming ``where`` and the refused global or
    the bad field when the bytes are not a pickle, are truncated, refer to anything outside the
    allow-list, change shared objects, or do not hold valid DCP metadata.
    """
    head = bytes(raw[:8])
    if head[:1] != pickle.PROTO or head[1:2] < b"\x02":
        # Every DCP version pickles with protocol 2 or newer, which starts with these bytes.
        raise IntegrityError(f"{where}: not a pickle of DCP metadata (it starts with "
                             f"{_short(head)}); {_REMEDY}")
    with _guard_lock:
        before = _snapshot()
        try:
            metadata = _RestrictedUnpickler(io.BytesIO(raw)).load()
        except _Refused as exc:
            raise IntegrityError(f"{where}: {exc}; {_REMEDY}") from None
        except Exception as exc:  # anything a malformed pickle makes the unpickler raise
            raise IntegrityError(
                f"{where}: not readable as DCP metadata ({type(exc).__name__}: "
                f"{_short(str(exc), 200)}); {_REMEDY}") from None
        finally:
            changed = _restore(before)
        if changed:
            raise IntegrityError(f"{where}: its pickle tried to change {', '.join(changed)} "
                                 f"(undone; refused); {_REMEDY}")
    try:
        _check(metadata)
    except _Invalid as exc:
        raise IntegrityError(f"{where}: {exc}; {_REMEDY}") from None
    except AttributeError as exc:
        # A field without a class default (state_dict_metadata, a chunk's sizes, ...) that the
        # pickle left out: every DCP version writes them.
        raise IntegrityError(f"{where}: {_missing_field(exc)}; {_REMEDY}") from None
    return metadata


# -- shared objects ------------------------------------------------------------------------------

def _snapshot() -> list[tuple[object, dict[str, Any]]]:
    return [(obj, dict(vars(obj))) for obj in _SHARED]


def _restore(snapshot: list[tuple[object, dict[str, Any]]]) -> list[str]:
    """Put back every attribute the load changed on a shared object; the names changed."""
    changed = []
    for obj, saved in snapshot:
        now = vars(obj)
        added = [k for k in now if k not in saved]
        altered = [k for k, v in saved.items() if k not in now or now[k] is not v]
        if not added and not altered:
            continue
        names = sorted(_short(k, 40) for k in added + altered)  # keys may be anything
        changed.append(f"{_label(obj)} ({', '.join(names[:5])}{', ...' if names[5:] else ''})")
        if isinstance(obj, type):
            # type's own setattr: EnumType's would refuse to touch member names
            for k in added:
                type.__delattr__(obj, k)
            for k in altered:
                type.__setattr__(obj, k, saved[k])
        else:
            for k in added:
                del now[k]
            now.update({k: saved[k] for k in altered})
    return changed


def _label(obj: object) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__module__}.{obj}"
    return getattr(obj, "__qualname__", type(obj).__name__)


# -- checks on what was unpickled ----------------------------------------------------------------

def _check(metadata: Any) -> None:
    """Raise :class:`_Invalid` naming the field unless ``metadata`` has DCP metadata's shape:
    the fields readers, planners and the drain use, with the types and ranges they assume."""
    if type(metadata) is not Metadata:
        raise _Invalid(f"it holds {_type(metadata)}, not DCP's Metadata")
    sdm = metadata.state_dict_metadata
    if not isinstance(sdm, dict):
        raise _Invalid(f"field 'state_dict_metadata' must be a dict, not {_type(sdm)}")
    for fqn, md in sdm.items():
        if not isinstance(fqn, str):
            raise _Invalid(f"field 'state_dict_metadata' has a key that is {_type(fqn)}, "
                           f"not a str ({_short(fqn)})")
        field = f"state_dict_metadata[{_short(fqn)}]"
        if type(md) is TensorStorageMetadata:  # the one class of that name since torch 1.13
            _check_tensor(md, field)
        elif type(md) is not BytesStorageMetadata:
            raise _Invalid(f"field '{field}' must be TensorStorageMetadata or "
                           f"BytesStorageMetadata, not {_type(md)}")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise _Invalid(f"field 'storage_data' must be a dict, not {_type(storage)}")
    names: set[str] = set()  # file names already checked: a few files hold many items
    for index, info in storage.items():
        _check_index(index)
        _check_storage_info(info, index, names)
    _check_every_item_stored(sdm, storage)
    meta = metadata.storage_meta
    if meta is not None and type(meta) is not StorageMeta:
        raise _Invalid(f"field 'storage_meta' must be a StorageMeta or None, not {_type(meta)}")
    if meta is not None:
        _check_storage_meta(meta)
    _check_planner_data(getattr(metadata, "planner_data", None))
    if metadata.version is not None and not isinstance(metadata.version, str):
        raise _Invalid(f"field 'version' must be a str or None, not {_type(metadata.version)}")


def _check_every_item_stored(sdm: dict, storage: dict) -> None:
    """Every chunk of every tensor and every non-tensor value has a place in storage_data
    (else DCP's read fails with a KeyError, or, for a chunk, the load leaves that part of the
    tensor as it was)."""
    stored = {(index.fqn, None if index.offset is None else tuple(index.offset))
              for index in storage}
    for fqn, md in sdm.items():
        if type(md) is BytesStorageMetadata:
            wanted = [(fqn, None)]
        else:
            wanted = [(fqn, tuple(chunk.offsets)) for chunk in md.chunks]
        for key in wanted:
            if key not in stored:
                where = "" if key[1] is None else f" at offsets {key[1]}"
                raise _Invalid(f"field 'storage_data' says nowhere where "
                               f"{_short(fqn)}{where} is stored")


def _check_tensor(md: TensorStorageMetadata, field: str) -> None:
    props = md.properties
    # DCP's TensorProperties, or ShardedTensor's in checkpoints of torch <= 2.2 (same fields)
    if type(props) not in _TENSOR_PROPERTIES or not isinstance(props.dtype, torch.dtype):
        raise _Invalid(f"field '{field}.properties' must be TensorProperties with a torch dtype")
    # What DCP hands torch.empty when it makes a tensor from the metadata (a load into an
    # empty state dict, dcp_to_torch_save): each of its type, or the load fails mid-way.
    for name, kind in _PROPERTY_TYPES:
        value = getattr(props, name)
        if not isinstance(value, kind):
            raise _Invalid(f"field '{field}.properties.{name}' must be a {kind.__name__} "
                           f"(got {_short(value)})")
    size = md.size
    if not _is_dims(size):
        raise _not_dims(f"{field}.size", size)
    if math.prod(size) > _INT64_MAX:  # (torch.empty of it would overflow, or try to)
        raise _Invalid(f"field '{field}.size' {_short(size)} holds more elements than a tensor "
                       f"can")
    if not isinstance(md.chunks, list):
        raise _Invalid(f"field '{field}.chunks' must be a list, not {_type(md.chunks)}")
    # Runs for every chunk of every tensor (hundreds of thousands on a large job): messages are
    # built only on failure.
    for n, chunk in enumerate(md.chunks):
        if type(chunk) is not ChunkStorageMetadata:
            raise _Invalid(f"field '{field}.chunks[{n}]' must be ChunkStorageMetadata, not "
                           f"{_type(chunk)}")
        offsets, sizes = chunk.offsets, chunk.sizes
        if not _is_dims(offsets):
            raise _not_dims(f"{field}.chunks[{n}].offsets", offsets)
        if not _is_dims(sizes):
            raise _not_dims(f"{field}.chunks[{n}].sizes", sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _Invalid(f"field '{field}.chunks[{n}]' has {len(offsets)}-d offsets and "
                           f"{len(sizes)}-d sizes for a {len(size)}-d tensor")
        if not all(map(operator.le, map(operator.add, offsets, sizes), size)):
            raise _Invalid(f"field '{field}.chunks[{n}]' (offsets {tuple(offsets)}, sizes "
                           f"{tuple(sizes)}) reaches past the tensor's size {tuple(size)}")
    # The chunks tile the tensor (DCP writes every element once): fewer elements leave part
    # of the destination as it was, with no error.
    covered = sum(math.prod(chunk.sizes) for chunk in md.chunks)
    if covered != math.prod(size):
        raise _Invalid(f"field '{field}.chunks' cover {covered} elements of a tensor of "
                       f"{math.prod(size)} ({tuple(size)})")


def _check_storage_meta(meta: StorageMeta) -> None:
    """Its ids are str (the checkpoint id also a path) or None, its modules a list of str;
    fields an older torch did not write are the class's defaults."""
    cid = getattr(meta, "checkpoint_id", None)
    if cid is not None and not isinstance(cid, (str, pathlib.PurePath)):
        raise _Invalid(f"field 'storage_meta.checkpoint_id' must be a str, a path or None "
                       f"(got {_short(cid)})")
    for name in ("save_id", "load_id"):
        value = getattr(meta, name, None)
        if value is not None and not isinstance(value, str):
            raise _Invalid(f"field 'storage_meta.{name}' must be a str or None (got "
                           f"{_short(value)})")
    modules = getattr(meta, "modules", None)
    if modules is not None and (not isinstance(modules, list)
                                or not all(isinstance(m, str) for m in modules)):
        raise _Invalid(f"field 'storage_meta.modules' must be a list of str (got "
                       f"{_short(modules)})")


def _check_planner_data(data: Any) -> None:
    """None, or the default planner's flattening map: each flat key -> the path of keys and
    indices (str and int) to its place in the nested state dict."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise _Invalid(f"field 'planner_data' must be a dict or None, not {_type(data)}")
    for key, path in data.items():
        if (not isinstance(key, str) or not isinstance(path, tuple)
                or not all(type(p) in (str, int) for p in path)):
            raise _Invalid(f"field 'planner_data' must map str keys to tuples of str and int "
                           f"(got {_short(key)}: {_short(path)})")


def _check_index(index: Any) -> None:
    if type(index) is not MetadataIndex or not isinstance(index.fqn, str):
        raise _Invalid(f"field 'storage_data' has a key that is {_type(index)}, not a "
                       f"MetadataIndex ({_short(index)})")
    if index.offset is not None and not _is_dims(index.offset):
        raise _not_dims(f"storage_data[{_short(index)}] (its key's offset)", index.offset)
    if index.index is not None and not _natural(index.index):
        raise _Invalid(f"field 'storage_data[{_short(index)}]' (its key's index) must be an "
                       f"int >= 0")


def _check_storage_info(info: Any, index: MetadataIndex, names: set[str]) -> None:
    if type(info) is not _StorageInfo:
        raise _Invalid(f"field 'storage_data[{_short(index)}]' must be a _StorageInfo, not "
                       f"{_type(info)}")
    # getattr: a pickle may leave any attribute out (_StorageInfo.__getstate__ itself drops
    # those that are None; the class supplies transform_descriptors' default).
    path = getattr(info, "relative_path", None)
    if not isinstance(path, str) or (path not in names and not is_plain_file_name(path)):
        raise _Invalid(f"field 'storage_data[{_short(index)}].relative_path' is {_short(path)}: "
                       f"it must be the plain name of a file in the checkpoint directory (no "
                       f"'/', '\\', '..', NUL, nothing absolute), like DCP's '__0_0.distcp'")
    names.add(path)
    for name in ("offset", "length"):
        value = getattr(info, name, None)
        if not _natural(value):
            raise _Invalid(f"field 'storage_data[{_short(index)}].{name}' must be an int >= 0 "
                           f"(got {_short(value)})")
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and (not isinstance(descriptors, (list, tuple))
                                    or not all(isinstance(d, str) for d in descriptors)):
        raise _Invalid(f"field 'storage_data[{_short(index)}].transform_descriptors' must be a "
                       f"list of str or None (got {_short(descriptors)})")


def _is_dims(value: Any) -> bool:
    """Whether ``value`` is a tuple (torch.Size is one) of ints >= 0."""
    if type(value) is torch.Size:  # holds only ints (its constructor refuses others): the sign
        return not value or (min(value) >= 0 and max(value) <= _INT64_MAX)
    return isinstance(value, tuple) and all(_natural(v) for v in value)


def _not_dims(field: str, value: Any) -> _Invalid:
    return _Invalid(f"field '{field}' must be a tuple of ints from 0 to 2**63-1 (got "
                    f"{_short(value)})")


#: the largest size, offset or index a file may give: what torch and DCP hold in an int64
_INT64_MAX = 2**63 - 1


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT64_MAX


def _missing_field(exc: AttributeError) -> str:
    """What an AttributeError raised by :func:`_check` says is missing, for the message."""
    owner, name = getattr(exc, "obj", None), getattr(exc, "name", None)
    if isinstance(name, str) and owner is not None:
        return f"its {type(owner).__qualname__} has no field {_short(name)}"
    return f"a field is missing ({_short(str(exc), 200)})"


def _global_name(module: Any, name: Any) -> str:
    """``module.name`` as the pickle spells it, quoted when it is not plain identifiers."""
    text = f"{module}.{name}"
    plain = all(isinstance(p, str) and p.replace(".", "_").isidentifier() and p.isascii()
                for p in (module, name))
    return text if plain and len(text) <= 120 else _short(text, 120)


def _type(value: Any) -> str:
    """``a dict``, ``an int``: the type of a value from the file, for a message."""
    name = type(value).__qualname__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` of a value from the file, cut short: it may be huge or full of control bytes,
    or not even printable (a torch.Size holding an int past 2**63)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the message says what it could
        return f"{_type(value)} that cannot be shown"
    return text if len(text) <= limit else text[:limit - 3] + "..."

