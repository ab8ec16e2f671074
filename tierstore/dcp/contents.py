"""What is inside a checkpoint, through DCP's own metadata and loader: ``inspect`` (files per rank,
tensors with their fully qualified names, shapes, dtypes and bytes) and ``export`` (one
consolidated file: ``torch.save`` of the flat state dict, or safetensors).

Both read through :class:`~tierstore.dcp.reader.TierstoreReader`, so they take the fastest good
copy, check every byte against the manifest and fall back to slower tiers as a load does.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tierstore.dcp.reader import TierstoreReader
from tierstore.errors import TierstoreError
from tierstore.format.manifest import Manifest
from tierstore.tiers.reports import ExportResult, InspectReport, StoredFile, StoredTensor

__all__ = ["EXPORT_FORMATS", "describe", "export"]

EXPORT_FORMATS = ("torch", "safetensors")


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
    out and listed in ``skipped``). The file appears complete or not at all."""
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
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    flat, _ = flatten_state_dict(state)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(k for k in flat if k not in tensors) if fmt == "safetensors" else []
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
