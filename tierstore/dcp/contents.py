"""What is inside a checkpoint, through DCP's own metadata and loader: ``inspect`` (files per rank,
tensors with their fully qualified names, shapes, dtypes and bytes) and ``export`` (one
consolidated file: ``torch.save`` of the flat state dict, or safetensors; or a stock DCP
checkpoint directory, which is how a deduplicated checkpoint reaches a reader without
tierstore).

Both read through :class:`~tierstore.dcp.reader.TierstoreReader`, so they take the fastest good
copy, check every byte against the manifest and fall back to slower tiers as a load does.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter, save
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tierstore.dcp.reader import TierstoreReader
from tierstore.errors import TierstoreError
from tierstore.format.manifest import Manifest
from tierstore.tiers.reports import ExportResult, InspectReport, StoredFile, StoredTensor

__all__ = ["EXPORT_FORMATS", "describe", "export"]

EXPORT_FORMATS = ("torch", "safetensors", "dcp")


def describe(manifest: Manifest, tiers: list[str], reader: TierstoreReader) -> InspectReport:
    """The :class:`InspectReport` of ``manifest``'s checkpoint, complete on ``tiers``; its
    tensors come from DCP's ``.metadata`` read (and checked) through ``reader``."""
    cid = manifest.checkpoint_id
    reader.reset(cid)
    metadata: Metadata = reader.read_metadata()
    tensors, objects = [], []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            shape = list(md.size)
            dtype = md.properties.dtype
            numel = 1
            for n in shape:
                numel *= n
            tensors.append(StoredTensor(fqn, shape, str(dtype).removeprefix("torch."),
                                        numel * torch.empty((), dtype=dtype).element_size()))
        else:
            objects.append(fqn)
    files = [StoredFile(name, entry.size, entry.rank)
             for name, entry in sorted(manifest.files.items())]
    return InspectReport(cid, manifest.world_size, tiers, files, tensors, objects,
                         manifest.size_bytes, manifest.step, manifest.committed,
                         manifest.pinned, list(manifest.codecs))


def export(checkpoint_id: str, fmt: str, path: str, reader: TierstoreReader) -> ExportResult:
    """Load the whole checkpoint through ``reader`` (DCP's own consolidation: every shard of
    every tensor into one full tensor) and write it to ``path`` as one file: ``torch`` (a
    ``torch.save`` of ``{fqn: value}``) or ``safetensors`` (its tensors; other values are left
    out and listed in ``skipped``). The file appears complete or not at all.

    Non-tensor values are unpickled only for ``torch``, and only once the reader's check
    (``tierstore.format.values``, with ``[store] trusted_pickles``) passed them; for
    ``safetensors`` they are never read. A refused value fails the export with the reader's
    ``UntrustedValue``, naming its key."""
    if fmt not in EXPORT_FORMATS:
        raise TierstoreError(f"export format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise TierstoreError("export --format safetensors needs the safetensors package: "
                                 "pip install 'tierstore[export]'") from None
    state: dict[str, Any] = {}
    reader.reset(checkpoint_id)  # what dcp.load does with its checkpoint_id
    planner = _TensorsOnly() if fmt == "safetensors" else _EmptyStateDictLoadPlanner()
    try:
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        raise _unwrapped(exc) from None
    flat, _ = flatten_state_dict(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(k for k in flat if k not in tensors) if fmt == "safetensors" else []
    if fmt == "dcp":
        _save_stock(state, path)
        return ExportResult(checkpoint_id, fmt, os.path.abspath(path), len(tensors),
                            sum(t.numel() * t.element_size() for t in tensors.values()), [])
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would make it, not mkstemp's 0600
    try:
        if fmt == "torch":
            torch.save(dict(flat), tmp)
        else:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                      metadata={"checkpoint_id": checkpoint_id})
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return ExportResult(checkpoint_id, fmt, os.path.abspath(path), len(tensors),
                        sum(t.numel() * t.element_size() for t in tensors.values()), skipped)


def _save_stock(state: dict[str, Any], path: str) -> None:
    """Write ``state`` to the directory ``path`` as stock DCP's ``FileSystemWriter`` writes a
    checkpoint of one process (what ``dcp.load`` reads without tierstore, at any world size);
    the directory appears complete or not at all."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        raise TierstoreError(f"export --format dcp: {target} exists; give a new directory")
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", dir=parent)
    try:
        save(state, storage_writer=FileSystemWriter(tmp), no_dist=True)
        os.chmod(tmp, 0o777 & ~_umask())  # as a plain mkdir would make it, not mkdtemp's 0700
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


class _TensorsOnly(_EmptyStateDictLoadPlanner):
    """Loads the tensors of a checkpoint and never reads its non-tensor values (their keys keep
    DCP's placeholder, so the export lists them as left out)."""

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan without its BYTE_IO reads."""
        plan = super().create_local_plan()
        return dataclasses.replace(plan, items=[i for i in plan.items
                                                if i.type != LoadItemType.BYTE_IO])


def _unwrapped(exc: CheckpointException) -> BaseException:
    """What the reader raised inside DCP's step, when it is one of tierstore's errors (its message
    is the operator's answer, not DCP's traceback text), else ``exc`` itself."""
    for error, _trace in exc.failures.values():
        if isinstance(error, TierstoreError):
            return error
    return exc
