"""Every ``.metadata`` DCP could have written loads from a tier, and nothing else does.

The restricted unpickler (tierstore.format.metadata) must accept what DCP's writers pickled in
the torch and Python versions whose checkpoints today's ``dcp.load`` still reads:

- torch <= 2.2 named ShardedTensor's ``TensorProperties`` (and its ``MEM_FORMAT_ENCODING``) for
  every tensor: our analog of PyTorch's ``test_sharded_tensor_dependency``. A save planner that
  builds the metadata as those versions did makes stock ``dcp.save`` (and tierstore's writer)
  pickle exactly that;
- torch <= 2.3 wrote no ``storage_meta`` or ``version``, and the first ``StorageMeta`` had no
  ``modules``;
- early CPython 3.11 releases pickle enum members by name (``builtins.getattr``; 3.11.2, Debian
  12's Python, does), Python 3.13 names path
  classes ``pathlib._local.*``, Windows records a ``WindowsPath``, ``FsspecWriter`` records the
  checkpoint id as given (a str or a pure path), and any pickle protocol from 2 up.

Checkpoints written by stock DCP are copied onto a tier with a manifest (``_adopt``), as someone
moving existing checkpoints to tierstore would, then loaded with ``store.reader()`` and compared
bit for bit. Where a pickle must come from an interpreter other than this one, it is made with
``pickle.Pickler.reducer_override`` returning what that interpreter's ``__reduce_ex__`` returns,
or by renaming a global in a protocol-2 pickle (whose globals are plain text lines).
"""

from __future__ import annotations

import enum
import io
import os
import pathlib
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_state_dicts_equal, empty_like, load_like
from torch.distributed._shard.sharded_tensor.metadata import MEM_FORMAT_ENCODING
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedProperties
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

import tierstore
from tierstore.errors import IntegrityError
from tierstore.format.checksum import checksum_of
from tierstore.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from tierstore.format.metadata import ALLOWED_GLOBALS, load_metadata

SHARDED = "torch.distributed._shard.sharded_tensor.metadata"
REMEDY = "restore it from another tier or delete the checkpoint"


def _state(seed: int = 0) -> dict[str, Any]:
    """A small state dict: several dtypes, a channels-last tensor, nesting, a non-tensor."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(16, 8, generator=g),
                      "b": torch.randn(8, generator=g).to(torch.bfloat16),
                      "conv": torch.randn(2, 3, 4, 5, generator=g).to(
                          memory_format=torch.channels_last),
                      "steps": torch.arange(5)},
            "epoch": 3}


# --------------------------------------------------------------------------- writing old metadata

class _Torch22Planner(DefaultSavePlanner):
    """The default save planner, with the metadata's tensor properties made as DCP of torch <=
    2.2 made them: instances of ShardedTensor's ``TensorProperties``, which then pickle under
    that module with its ``MEM_FORMAT_ENCODING``."""

    def create_global_plan(self, all_plans):
        plans, metadata = super().create_global_plan(all_plans)
        for md in metadata.state_dict_metadata.values():
            if isinstance(md, TensorStorageMetadata):
                p = md.properties
                md.properties = ShardedProperties(dtype=p.dtype, layout=p.layout,
                                                  requires_grad=p.requires_grad,
                                                  memory_format=p.memory_format,
                                                  pin_memory=p.pin_memory)
        return plans, metadata


class _Pickler(pickle.Pickler):
    """``pickle.dumps`` as another interpreter's would write it: ``enums_by_name`` pickles enum
    members as early CPython 3.11 releases do (``getattr(<class>, <name>)``, bpo-44342; 3.11.2
    does); ``path`` records every path as ``path(<the path as one str>)`` (``WindowsPath``: what
    DCP on Windows records; Python 3.13 pickles any path with one str)."""

    def __init__(self, file, protocol: int | None, enums_by_name: bool = False,
                 path: type | None = None):
        super().__init__(file, protocol)
        self._enums_by_name, self._path = enums_by_name, path

    def reducer_override(self, obj: Any) -> Any:
        if self._enums_by_name and isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if self._path is not None and isinstance(obj, pathlib.PurePath):
            return self._path, (str(obj),)
        return NotImplemented


def _dumps(metadata: Metadata, protocol: int | None = None, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol, **kwargs).dump(metadata)
    return buf.getvalue()


def _rename_global(raw: bytes, old: str, new: str) -> bytes:
    """A protocol-2 pickle with the global ``old`` (``module name``) written as ``new``."""
    assert raw[:2] == b"\x80\x02"
    before, after = [f"c{g.replace(' ', chr(10))}\n".encode() for g in (old, new)]
    assert before in raw, f"{old} is not in the pickle"
    return raw.replace(before, after)


def _globals_named(raw: bytes) -> set[tuple[str, str]]:
    """The globals ``raw`` refers to, resolved through the allow-list (nothing else runs)."""
    named: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            named.add((module, name))
            return ALLOWED_GLOBALS[(module, name)]

    Recorder(io.BytesIO(raw)).load()
    return named


def _stock_save(sd: dict, path: Path, **kwargs: Any) -> bytes:
    """Save ``sd`` with stock DCP's ``FileSystemWriter`` into ``path``; its ``.metadata``."""
    dcp.save(sd, storage_writer=FileSystemWriter(path), **kwargs)
    return (path / METADATA_NAME).read_bytes()


def _adopt(stock: Path, tier_root: Path, cid: str) -> Path:
    """Copy the stock DCP checkpoint ``stock`` onto a tier as checkpoint ``cid``: its files, and
    a manifest listing each with its size and checksum (the coordinator's ``.metadata`` without
    a rank, the data files of rank 0). Its directory on the tier."""
    ckpt = tier_root / cid
    shutil.copytree(stock, ckpt)
    files = {}
    for f in sorted(ckpt.iterdir()):
        raw = f.read_bytes()
        files[f.name] = FileEntry(len(raw), checksum_of(raw),
                                  None if f.name == METADATA_NAME else 0)
    (ckpt / MANIFEST_NAME).write_bytes(
        Manifest(cid, files, save_token=uuid.uuid4().hex).to_json())
    return ckpt


def _load_stock(path: Path, like: dict) -> dict:
    """``path`` loaded by stock DCP's ``FileSystemReader`` into ``empty_like(like)``."""
    dest = empty_like(like)
    dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
    return dest


def _load_from_tier(tier_root: Path, cid: str, like: dict) -> dict:
    """``cid`` loaded with ``dcp.load(..., storage_reader=store.reader())`` from a store whose
    only tier is ``tier_root``."""
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tier_root)}]}
    with tierstore.open(config) as store:
        return load_like(store, cid, like)


# --------------------------------------------------------------------------- (a) torch <= 2.2

def test_sharded_tensor_dependency_stock_checkpoint_loads_from_a_tier(tmp_path):
    """Our test_sharded_tensor_dependency: a checkpoint stock DCP wrote with ShardedTensor's
    TensorProperties (torch <= 2.2), copied onto a tier, loads bit for bit."""
    sd = _state(1)
    raw = _stock_save(sd, tmp_path / "stock", planner=_Torch22Planner())
    assert {(SHARDED, "TensorProperties"), (SHARDED, "MEM_FORMAT_ENCODING")} \
        <= _globals_named(raw)
    # what PyTorch's own test asserts: stock DCP loads it back
    back = _load_stock(tmp_path / "stock", sd)
    assert_state_dicts_equal(back, sd)

    _adopt(tmp_path / "stock", tmp_path / "nvme", "step-1")
    assert_state_dicts_equal(_load_from_tier(tmp_path / "nvme", "step-1", sd), sd)
    props = load_metadata(raw, "test").state_dict_metadata["model.b"].properties
    assert type(props) is ShardedProperties and props.dtype == torch.bfloat16


@pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")
def test_sharded_tensor_dependency_through_tierstore_and_its_drain(one_rank_group, tmp_path):
    """The same metadata written by tierstore's writer, with a ShardedTensor in the state dict:
    loads bit for bit from the tier it was saved on and from the copy the drain rewrote for a
    tier with another codec (which unpickles and pickles the metadata again)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    def sharded(t):
        return init_from_local_shards([Shard(t, ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))],
                                      [4, 2])

    st = torch.randn(4, 2)
    sd = {"st": sharded(st.clone()), "w": torch.randn(3, 5), "step": 7}
    fast = {"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}
    slow = {"name": "slow", "backend": "local", "path": str(tmp_path / "slow"),
            "codecs": ["zstd"]}
    with tierstore.open({"tier": [fast, slow]}) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1",
                 planner=_Torch22Planner(), process_group=store.process_group)
        store.wait(timeout=60)
    for tier in (fast, slow):
        raw = (Path(tier["path"]) / "step-1" / METADATA_NAME).read_bytes()
        assert (SHARDED, "TensorProperties") in _globals_named(raw), tier["name"]
        with tierstore.open({"tier": [tier]}) as store:
            dest = {"st": sharded(torch.zeros(4, 2)), "w": torch.zeros(3, 5), "step": 0}
            dcp.load(dest, storage_reader=store.reader(), checkpoint_id="step-1",
                     process_group=store.process_group)
        assert_state_dicts_equal(dest["st"].local_shards()[0].tensor, st, tier["name"])
        assert_state_dicts_equal({"w": dest["w"], "step": dest["step"]},
                                 {"w": sd["w"], "step": 7}, tier["name"])


# --------------------------------------------------------------------------- (b) every shape

def _repickle(change: Callable[[Metadata], None] | None = None, protocol: int | None = None,
              **how: Any) -> Callable[[bytes], tuple[bytes, Metadata]]:
    """A variant of a stock ``.metadata``: unpickled, changed by ``change``, pickled again with
    ``protocol`` as ``_Pickler(**how)`` writes it; the bytes and the metadata they stand for."""
    def make(stock: bytes) -> tuple[bytes, Metadata]:
        md = pickle.loads(stock)
        if change is not None:
            change(md)
        return _dumps(md, protocol, **how), md
    return make


def _set_id(checkpoint_id: Any) -> Callable[[Metadata], None]:
    def change(md: Metadata) -> None:
        md.storage_meta.checkpoint_id = checkpoint_id
    return change


def _torch_2_3(md: Metadata) -> None:
    """The fields torch <= 2.3 wrote: no storage_meta, no version (the class defaults, None)."""
    del md.storage_meta, md.version


def _no_modules(md: Metadata) -> None:
    """StorageMeta as it was before it had ``modules``."""
    del md.storage_meta.modules


def _python_3_13(cls: type, checkpoint_id: Any) -> Callable[[bytes], tuple[bytes, Metadata]]:
    """As Python 3.13 pickles a path: ``pathlib._local.<class>(<the path as one str>)``."""
    def make(stock: bytes) -> tuple[bytes, Metadata]:
        raw, md = _repickle(_set_id(checkpoint_id), 2, path=cls)(stock)
        name = cls.__name__
        return _rename_global(raw, f"pathlib {name}", f"pathlib._local {name}"), md
    return make


WINDOWS_ID = pathlib.PureWindowsPath(r"C:\ckpt\step-1")
METADATA_MODULE = "torch.distributed.checkpoint.metadata"

#: name -> (how the stock .metadata becomes this variant, the globals it must name)
VARIANTS: dict[str, tuple[Callable[[bytes], tuple[bytes, Metadata]], set[tuple[str, str]]]] = {
    "stock: default protocol, PosixPath id": (lambda raw: (raw, pickle.loads(raw)),
                                              {("pathlib", "PosixPath")}),
    **{f"protocol {p}": (_repickle(protocol=p), {("pathlib", "PosixPath")})
       for p in range(2, pickle.HIGHEST_PROTOCOL + 1)},
    "storage_meta None": (_repickle(lambda md: setattr(md, "storage_meta", None)), set()),
    "torch <= 2.3 fields": (_repickle(_torch_2_3), set()),
    "StorageMeta without modules": (_repickle(_no_modules), {(METADATA_MODULE, "StorageMeta")}),
    "CPython 3.11.2: enums by name": (_repickle(enums_by_name=True), {("builtins", "getattr")}),
    "CPython 3.11.2: enums by name, protocol 2": (_repickle(protocol=2, enums_by_name=True),
                                                  {("__builtin__", "getattr")}),
    "FsspecWriter: str id": (_repickle(_set_id("s3://bucket/step-1")), set()),
    "FsspecWriter: PurePosixPath id": (_repickle(_set_id(pathlib.PurePosixPath("/ckpt/step-1"))),
                                       {("pathlib", "PurePosixPath")}),
    "Windows: WindowsPath id": (_repickle(_set_id(WINDOWS_ID), path=pathlib.WindowsPath),
                                {("pathlib", "WindowsPath")}),
    "Windows: PureWindowsPath id": (_repickle(_set_id(WINDOWS_ID)),
                                    {("pathlib", "PureWindowsPath")}),
    **{f"Python 3.13: {cls.__name__} id": (_python_3_13(cls, checkpoint_id),
                                           {("pathlib._local", cls.__name__)})
       for cls, checkpoint_id in [(pathlib.PosixPath, pathlib.PosixPath("/ckpt/step-1")),
                                  (pathlib.PurePosixPath, pathlib.PurePosixPath("/ckpt/step-1")),
                                  (pathlib.WindowsPath, WINDOWS_ID),
                                  (pathlib.PureWindowsPath, WINDOWS_ID)]},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_stock_metadata_of_every_shape_loads_from_a_tier(tmp_path, variant):
    """A stock DCP checkpoint whose ``.metadata`` is pickled as ``variant`` (another protocol,
    an older torch's fields, another interpreter's or operating system's globals), copied onto
    a tier: it loads bit for bit, and its metadata is what was pickled (a path of the other
    operating system as its pure path)."""
    sd = _state(2)
    make, named = VARIANTS[variant]
    raw, want = make(_stock_save(sd, tmp_path / "stock"))
    assert named <= _globals_named(raw), "the variant does not exercise what it says"
    (tmp_path / "stock" / METADATA_NAME).write_bytes(raw)
    _adopt(tmp_path / "stock", tmp_path / "nvme", "step-1")
    assert_state_dicts_equal(_load_from_tier(tmp_path / "nvme", "step-1", sd), sd)
    # The same objects field by field (``==`` would read StorageMeta.modules, which older files
    # lack; a path of the other operating system is its pure path on both sides).
    assert pickle.dumps(load_metadata(raw, "test")) == pickle.dumps(want)


@pytest.mark.parametrize("checkpoint_id", [str, pathlib.Path, pathlib.PurePosixPath],
                         ids=["str", "PosixPath", "PurePosixPath"])
def test_fsspec_writer_checkpoint_ids_load_from_a_tier(tmp_path, checkpoint_id):
    """Stock ``FsspecWriter`` records the checkpoint id as it was given (a str or any path):
    each loads from a tier."""
    sd = _state(3)
    stock = tmp_path / "stock"
    dcp.save(sd, storage_writer=FsspecWriter(checkpoint_id(stock)))
    raw = (stock / METADATA_NAME).read_bytes()
    assert load_metadata(raw, "test").storage_meta.checkpoint_id == checkpoint_id(stock)
    _adopt(stock, tmp_path / "nvme", "step-1")
    assert_state_dicts_equal(_load_from_tier(tmp_path / "nvme", "step-1", sd), sd)


def test_every_allowed_global_is_one_dcp_writes(tmp_path):
    """Each (module, name) of the allow-list beyond the dtypes is named by a pickle the tests
    above load (torch <= 2.2's from stock DCP, or a variant): none is there for nothing, none
    goes untested."""
    stock = _stock_save(_state(4), tmp_path / "stock")
    named = _globals_named(_stock_save(_state(4), tmp_path / "old", planner=_Torch22Planner()))
    for make, _ in VARIANTS.values():
        named |= _globals_named(make(stock)[0])
    dtypes = {k for k, v in ALLOWED_GLOBALS.items() if isinstance(v, torch.dtype)}
    assert set(ALLOWED_GLOBALS) - dtypes - named == set()


# --------------------------------------------------------------------------- (c) still refused

class _Calls:
    """Unpickling it calls ``func(*args)``: how a pickle reaches a global it should not."""

    def __init__(self, func: Any, *args: Any):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("payload, message", [
    (_Calls(os.system, "exit 1"), f"refers to the global {os.system.__module__}.system, which "
                                  f"DCP metadata never contains (refused before anything ran)"),
    # torch 1.12's prototype format, which today's dcp.load cannot read either
    (_Calls(__import__("torch.distributed._shard.metadata", fromlist=["ShardMetadata"])
            .ShardMetadata, [0], [1], "cpu"),
     "refers to the global torch.distributed._shard.metadata.ShardMetadata, which DCP metadata "
     "never contains"),
    (_Calls(pathlib.Path, "/etc"), "refers to the global pathlib.Path, which DCP metadata "
                                   "never contains"),
    # getattr is answered for memory-format enum members only
    (_Calls(getattr, Metadata, "__init__"), "calls getattr(<class 'torch.distributed.checkpoint"
                                            ".metadata.Metadata'>, '__init__')"),
    (_Calls(getattr, MEM_FORMAT_ENCODING, "__class__"), "calls getattr(<enum "
                                                        "'MEM_FORMAT_ENCODING'>, '__class__')"),
], ids=["os.system", "ShardMetadata", "pathlib.Path", "getattr of a class",
        "getattr of an enum's attribute"])
def test_globals_outside_the_list_are_refused_from_a_tier(tmp_path, payload, message):
    """A copied checkpoint whose ``.metadata`` asks for anything else is refused with an
    IntegrityError naming the copy and what it asked for, before it is called."""
    _stock_save(_state(5), tmp_path / "stock")
    (tmp_path / "stock" / METADATA_NAME).write_bytes(pickle.dumps(payload))
    _adopt(tmp_path / "stock", tmp_path / "nvme", "step-1")
    with pytest.raises(IntegrityError) as info:
        _load_from_tier(tmp_path / "nvme", "step-1", _state(5))
    text = str(info.value)
    assert f"tier 'nvme': step-1/{METADATA_NAME}" in text and REMEDY in text, text
    assert message in text, text
