"""A hostile or broken ``.metadata`` on a tier: refused by the restricted unpickler
(tierstore.format.metadata) before anything in it runs, with an IntegrityError that names the
copy and the problem; legitimate metadata of every kind still loads exactly as ``pickle.loads``
would load it.

Each test tampers with a real checkpoint and then rewrites the manifest's size and checksum of
``.metadata`` (``_replace_metadata``), so that nothing but the unpickler and its checks stands
in the way.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_state_dicts_equal, assert_trees_equal, load_like, make_state_dict
from torch.distributed.checkpoint.metadata import Metadata

import tierstore
from tierstore.errors import DrainError, IntegrityError
from tierstore.format.checksum import checksum_of
from tierstore.format.manifest import MANIFEST_NAME, METADATA_NAME, FileEntry, Manifest
from tierstore.format.metadata import ALLOWED_GLOBALS, load_metadata

REMEDY = "restore it from another tier or delete the checkpoint"
# os.system pickles under the module that defines it (posix on Linux).
SYSTEM = f"{os.system.__module__}.system"


# --------------------------------------------------------------------------- tampering

def _rewrite_manifest(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``mutate`` to the manifest's fields and write it back as tierstore would, so that
    it passes every check a reader makes of the manifest itself (its seal, when manifests carry
    one, is recomputed by ``to_json``). The one place that knows how a manifest is written."""
    data = json.loads(path.read_bytes())
    data.pop("seal", None)
    mutate(data)
    data["files"] = {name: FileEntry(**entry) for name, entry in data["files"].items()}
    path.write_bytes(Manifest(**data).to_json())


def _replace_metadata(ckpt: Path, raw: bytes) -> None:
    """Put ``raw`` in place of the checkpoint's ``.metadata``, manifest entry updated to match."""
    (ckpt / METADATA_NAME).write_bytes(raw)

    def mutate(data: dict[str, Any]) -> None:
        data["files"][METADATA_NAME].update(size=len(raw), checksum=checksum_of(raw))

    _rewrite_manifest(ckpt / MANIFEST_NAME, mutate)


class _RunsCommand:
    """Unpickling it runs a shell command: the classic ``__reduce__`` payload."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _build_on(target: bytes, attrs: dict[str, Any]) -> bytes:
    """A pickle whose BUILD opcode sets ``attrs`` on the object ``target`` (pickle opcodes)
    pushes: with allowed globals alone, a class or an enum member of the whole process."""
    state = pickle.dumps((None, attrs), protocol=2)  # (no dict state, attributes to set)
    return b"\x80\x02" + target + state[2:-1] + pickle.BUILD + pickle.STOP


def _save(store, sd: dict, cid: str = "step-1") -> None:
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=cid)


def _load_refused(config: dict, cid: str = "step-1") -> IntegrityError:
    """Load ``cid`` with a fresh store and return the IntegrityError ``dcp.load`` raises (from
    the reader's reset, before DCP's collective steps: the error reaches the caller as is)."""
    with tierstore.open(config) as store, pytest.raises(IntegrityError) as info:
        load_like(store, cid, make_state_dict(0))
    return info.value


@pytest.fixture
def saved(local_config, tmp_path) -> Path:
    """A real checkpoint ``step-1`` on the `local` tier `nvme`; its directory."""
    with tierstore.open(local_config) as store:
        _save(store, make_state_dict(0))
    ckpt = tmp_path / "nvme" / "step-1"
    assert (ckpt / METADATA_NAME).is_file() and (ckpt / MANIFEST_NAME).is_file()
    return ckpt


def _assert_names_copy(err: Exception) -> None:
    text = str(err)
    assert "tier 'nvme'" in text and f"step-1/{METADATA_NAME}" in text, text
    assert REMEDY in text, text


# --------------------------------------------------------------------------- hostile pickles

def test_code_in_metadata_is_refused_and_never_runs(saved, local_config, tmp_path):
    pwned = tmp_path / "pwned"
    _replace_metadata(saved, pickle.dumps(_RunsCommand(f"touch {pwned}")))
    err = _load_refused(local_config)
    assert not pwned.exists(), "the pickle's command ran"
    _assert_names_copy(err)
    assert SYSTEM in str(err), str(err)


def test_drain_refuses_code_in_metadata(local_config, tmp_path):
    """The drain to a tier with other codecs unpickles the metadata to rewrite it: the same
    refusal, reported by store.wait() as a DrainError, and nothing reaches the slower tier."""
    with tierstore.open(local_config) as store:
        _save(store, make_state_dict(0))
    pwned = tmp_path / "pwned"
    _replace_metadata(tmp_path / "nvme" / "step-1",
                      pickle.dumps(_RunsCommand(f"touch {pwned}")))
    both = {"tier": [*local_config["tier"],
                     {"name": "slow", "backend": "local", "path": str(tmp_path / "slow"),
                      "codecs": ["zstd"]}]}
    with tierstore.open(both) as store:  # resumes the copy nobody made: step-1 -> slow
        with pytest.raises(DrainError) as info:
            store.wait(timeout=60)
        assert "slow" not in {t for c in store.list() for t in c.tiers}
    assert not pwned.exists(), "the pickle's command ran"
    assert SYSTEM in str(info.value) and f"step-1/{METADATA_NAME}" in str(info.value)


@pytest.mark.parametrize("case", ["not a pickle", "truncated", "a plain dict",
                                  "a field left out"])
def test_unreadable_metadata_is_refused(saved, local_config, case):
    raw = (saved / METADATA_NAME).read_bytes()
    bad = {"not a pickle": b"PK\x03\x04 certainly not a pickle",
           "truncated": raw[:len(raw) // 2],
           "a plain dict": pickle.dumps({"state_dict_metadata": {}, "storage_data": {}}),
           # every DCP version writes state_dict_metadata (it has no default)
           "a field left out": pickle.dumps(Metadata.__new__(Metadata))}[case]
    _replace_metadata(saved, bad)
    err = _load_refused(local_config)
    _assert_names_copy(err)
    expected = {"not a pickle": "not a pickle of DCP metadata",
                "truncated": "not readable as DCP metadata",
                "a plain dict": "it holds a dict, not DCP's Metadata",
                "a field left out": "its Metadata has no field 'state_dict_metadata'"}[case]
    assert expected in str(err), str(err)


def test_path_out_of_the_checkpoint_is_refused(saved, local_config):
    metadata = pickle.loads((saved / METADATA_NAME).read_bytes())
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../evil.distcp"
    _replace_metadata(saved, pickle.dumps(metadata))
    err = _load_refused(local_config)
    _assert_names_copy(err)
    assert "relative_path" in str(err) and "'../../evil.distcp'" in str(err), str(err)
    assert f"storage_data[{index!r}]" in str(err), str(err)


@pytest.mark.parametrize("target, attrs, holder", [
    # Metadata itself: every later load would get its methods from the pickle
    (b"ctorch.distributed.checkpoint.metadata\nMetadata\n", {"__eq__": None},
     lambda: Metadata),
    # a memory-format member, through its class: every later save would pickle a bad code
    (b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R",
     {"_value_": 7},
     lambda: next(iter(torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING))),
    # a member of the enum torch <= 2.2 pickled memory formats with
    (b"ctorch.distributed._shard.sharded_tensor.metadata\nMEM_FORMAT_ENCODING\nK\x00\x85R",
     {"_value_": 7},
     lambda: next(iter(torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING))),
    # the stand-in answering getattr (enum members pickled by name)
    (b"c__builtin__\ngetattr\n", {"cache": {}},
     lambda: ALLOWED_GLOBALS[("builtins", "getattr")]),
    (b"cpathlib._local\nPosixPath\n", {"__reduce__": None}, lambda: pathlib.PosixPath),
], ids=["class", "enum member", "torch 2.2 enum member", "getattr stand-in", "path class"])
def test_changing_shared_objects_is_refused_and_undone(saved, local_config, tmp_path, target,
                                                        attrs, holder):
    obj = holder()
    before = dict(vars(obj))
    _replace_metadata(saved, _build_on(target, attrs))
    try:
        err = _load_refused(local_config)
        _assert_names_copy(err)
        assert "tried to change" in str(err) and next(iter(attrs)) in str(err), str(err)
        assert dict(vars(obj)) == before
        # saves and loads of this process are unaffected
        with tierstore.open(local_config) as store:
            sd = make_state_dict(2)
            _save(store, sd, "step-2")
            assert_state_dicts_equal(load_like(store, "step-2", sd), sd)
    finally:  # whatever happened, leave the process's classes as they were
        for key in set(vars(obj)) - set(before):
            type.__delattr__(obj, key) if isinstance(obj, type) else vars(obj).pop(key)
        for key, value in before.items():
            if vars(obj).get(key, object()) is not value:
                (type.__setattr__(obj, key, value) if isinstance(obj, type)
                 else vars(obj).__setitem__(key, value))


def _first_info(md):
    return next(iter(md.storage_data.values()))


def _first_tensor(md):
    return next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks")
                and len(v.size) == 2)


@pytest.mark.parametrize("mutate, field", [
    (lambda md: setattr(_first_info(md), "relative_path", "/etc/passwd"), "relative_path"),
    (lambda md: setattr(_first_info(md), "relative_path", "__0_0.distcp\x00"), "relative_path"),
    (lambda md: setattr(_first_info(md), "relative_path", "..\\evil.distcp"), "relative_path"),
    (lambda md: setattr(_first_info(md), "relative_path", "sub/__0_0.distcp"), "relative_path"),
    (lambda md: setattr(_first_info(md), "offset", -1), ".offset"),
    (lambda md: setattr(_first_info(md), "length", "10"), ".length"),
    (lambda md: setattr(_first_tensor(md).chunks[0], "offsets", torch.Size([0])), ".chunks[0]"),
    (lambda md: setattr(_first_tensor(md).chunks[0], "sizes", (-1, 2)), ".chunks[0].sizes"),
    (lambda md: setattr(_first_tensor(md).chunks[0], "sizes", torch.Size([10**6, 1])),
     ".chunks[0]"),
    (lambda md: md.state_dict_metadata.update(epoch="not storage metadata"),
     "state_dict_metadata['epoch']"),
    (lambda md: setattr(md, "storage_data", list(md.storage_data.values())), "storage_data"),
], ids=["absolute", "nul", "backslash", "subdirectory", "negative offset", "length not int",
        "chunk dimensionality", "negative chunk size", "chunk past the tensor",
        "not storage metadata", "storage_data not a dict"])
def test_malformed_fields_are_named(saved, mutate, field):
    metadata = pickle.loads((saved / METADATA_NAME).read_bytes())
    mutate(metadata)
    with pytest.raises(IntegrityError) as info:
        load_metadata(pickle.dumps(metadata), f"tier 'nvme': step-1/{METADATA_NAME}")
    _assert_names_copy(info.value)
    assert "field '" in str(info.value) and field in str(info.value), str(info.value)


def test_refusal_names_the_global_whatever_the_protocol(saved):
    """Every protocol DCP can write (2 and newer) refers to globals the same way; the one
    refused is named in the message."""
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        raw = pickle.dumps(_RunsCommand("exit 1"), protocol=protocol)
        with pytest.raises(IntegrityError, match=SYSTEM.replace(".", r"\.")):
            load_metadata(raw, f"tier 'nvme': step-1/{METADATA_NAME}")


# --------------------------------------------------------------------------- legitimate metadata

def _assert_same_as_pickle(raw: bytes) -> Metadata:
    got = load_metadata(raw, "test")
    assert got == pickle.loads(raw)
    return got


def test_real_metadata_loads_as_pickle_loads_it(local_config, tmp_path):
    """Plain tensors of every dtype, nested dicts, non-tensor values, with and without a codec:
    nothing legitimate is refused, and a full save/load still round-trips."""
    sd = make_state_dict(1)
    sd["extra"] = {"blob": io.BytesIO(b"\x00opaque"), "items": [1, "two", 3.0, None],
                   "step": 7, "name": "run", "complex": torch.randn(5, dtype=torch.complex64),
                   "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)}
    for codecs in ([], ["zstd"]):
        config = {"tier": [{"name": "t", "backend": "local", "codecs": codecs,
                            "path": str(tmp_path / f"t{len(codecs)}")}]}
        with tierstore.open(config) as store:
            _save(store, sd)
            _assert_same_as_pickle((tmp_path / f"t{len(codecs)}" / "step-1" / METADATA_NAME)
                                   .read_bytes())
            assert_trees_equal(load_like(store, "step-1", sd), sd)
    # what stock DCP writes (it records the checkpoint id as a pathlib path)
    stock = tmp_path / "stock"
    dcp.save(sd, checkpoint_id=stock)
    _assert_same_as_pickle((stock / METADATA_NAME).read_bytes())


@pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")
def test_sharded_tensor_metadata_loads_as_pickle_loads_it(one_rank_group, tmp_path):
    """DTensor shards (sharded and replicated over a one-rank mesh) and a ShardedTensor."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (1,))
    sharded = init_from_local_shards(
        [Shard(torch.randn(4, 2), ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))], [4, 2])
    sd = {"w": distribute_tensor(torch.randn(8, 4), mesh, [DShard(0)]),
          "b": distribute_tensor(torch.randn(3), mesh, [Replicate()]),
          "st": sharded, "step": 3}
    config = {"tier": [{"name": "t", "backend": "local", "path": str(tmp_path / "t")}]}
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1",
                 process_group=store.process_group)
        metadata = _assert_same_as_pickle((tmp_path / "t" / "step-1" / METADATA_NAME)
                                          .read_bytes())
        assert {"w", "b", "st", "step"} <= set(metadata.state_dict_metadata)
        target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [DShard(0)]),
                  "b": distribute_tensor(torch.zeros(3), mesh, [Replicate()]),
                  "st": init_from_local_shards(
                      [Shard(torch.zeros(4, 2), ShardMetadata([0, 0], [4, 2], "rank:0/cpu"))],
                      [4, 2]),
                  "step": 0}
        dcp.load(target, storage_reader=store.reader(), checkpoint_id="step-1",
                 process_group=store.process_group)
    assert torch.equal(target["w"].to_local(), sd["w"].to_local())
    assert torch.equal(target["b"].to_local(), sd["b"].to_local())
    assert torch.equal(target["st"].local_shards()[0].tensor, sharded.local_shards()[0].tensor)
    assert target["step"] == 3


def test_items_that_overlap_are_refused_not_loaded_wrong(saved, local_config):
    """Metadata (from someone who knows the format) placing a small tensor inside the large one
    before it would hand it the bytes after that one: the file is refused instead."""
    metadata = pickle.loads((saved / METADATA_NAME).read_bytes())
    infos = sorted((i for i in metadata.storage_data.values()
                    if i.relative_path == _first_info(metadata).relative_path),
                   key=lambda i: i.offset)
    infos[1].offset = infos[0].offset + 8  # inside the first item of the same file
    infos[1].length = min(infos[1].length, infos[0].length - 8)
    _replace_metadata(saved, pickle.dumps(metadata))
    with tierstore.open(local_config) as store:
        with pytest.raises(BaseException) as info:  # DCP's CheckpointException wraps it
            load_like(store, "step-1", make_state_dict(0))
    assert "inside the item before it" in str(info.value), str(info.value)
