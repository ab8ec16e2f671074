"""How one tensor chunk becomes the bytes of a DCP data file: exactly what ``torch.save`` writes.

Stock DCP writes each tensor item as a whole ``torch.save`` archive, and stock ``dcp.load`` reads
it with ``torch.load``; tierstore writes the same bytes, so its data files stay loadable without
it. Two costs of ``torch.save`` are avoided:

- the zip CRC32, which costs more CPU than the rest of a save together (0.5 s per GiB here) and is
  redundant: every byte goes through the file checksum of the manifest, and ``torch.load`` never
  checks the CRC;
- for small tensors, the serializer itself. Setting up torch's zip writer and pickler costs
  about 50 µs per tensor, which is most of a save of thousands of small tensors. Without the CRC,
  the archive of a tensor differs from that of any other tensor of the same dtype, shape and
  strides only in the tensor's own bytes, so the archive around them is built once per such
  *signature* (:class:`TensorTemplate`) and reused: the record is template prefix + the tensor's
  bytes + template suffix. Each template is proved on creation (two archives of the signature,
  every data byte different, must differ exactly in the data region), so a torch whose archive
  layout changes only loses the shortcut, never the format.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import threading
from dataclasses import dataclass
from typing import IO, Callable

import torch

__all__ = ["TensorTemplate", "host_tensor", "save_tensor", "storage_alignment", "template_for",
           "tensor_bytes", "TEMPLATE_MAX_BYTES"]

#: tensors of fewer bytes than this are written through a template; larger ones have too few
#: items per byte for the serializer's set-up to matter, and a template costs two archives of
#: the signature's size to make
TEMPLATE_MAX_BYTES = 1 << 20
#: templates kept at once (per process); a state dict rarely has more distinct small shapes
_TEMPLATE_CACHE_MAX = 8192


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor holding exactly the bytes of ``tensor``, row-major, in its own storage
    (``torch.save`` writes whole storages; the direct read path assumes row-major)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if (not tensor.is_contiguous() or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.nbytes):
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory, without a copy (writable: the reader
    fills destinations through it)."""
    if tensor.nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    return memoryview(buf).cast("B")


def _save_tensor_without_crc(tensor: torch.Tensor, out: IO[bytes]) -> None:
    """``torch.save(tensor, out)`` without the zip CRC32. The bytes are those of ``torch.save``
    under ``torch.serialization.set_crc32_options(False)``; that option is process-wide, so the
    writer is built directly instead of flipping it under the user."""
    writer = torch._C.PyTorchFileWriter(out, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _probe_crc_free_save() -> Callable[[torch.Tensor, IO[bytes]], None]:
    """The CRC-free save when this torch supports it (private API, checked once), else torch.save."""
    try:
        probe, buf = torch.arange(5, dtype=torch.float32), io.BytesIO()
        _save_tensor_without_crc(probe, buf)
        buf.seek(0)
        if torch.equal(torch.load(buf, weights_only=True), probe):
            return _save_tensor_without_crc
    except Exception:  # any change in torch's private serialization API
        pass
    return torch.save


_save_tensor = _probe_crc_free_save()


class _HeldFailure(io.RawIOBase):
    """Passes writes to ``raw``; after the first one that fails (a full disk, or a file closed
    meanwhile: ValueError) it swallows the rest and keeps the error. torch's zip writer must
    always reach its end: its destructor aborts the whole process (``terminate called ...
    unexpected pos``) when its file failed under it half-way, and a writer abandoned by a save
    that stopped half-way writes the archive's end from that destructor, whenever the garbage
    collector frees it: by then ``raw`` may be closed, and refuses the bytes."""

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self._raw = raw
        self.error: OSError | ValueError | None = None

    def writable(self) -> bool:
        """Always writable."""
        return True

    def write(self, data) -> int:
        """Write ``data`` through, or count it once a write has failed."""
        if self.error is None:
            try:
                return self._raw.write(data)
            except (OSError, ValueError) as exc:
                self.error = exc
        return memoryview(data).nbytes

    def flush(self) -> None:
        """Nothing is buffered here."""


def save_tensor(tensor: torch.Tensor, out: IO[bytes]) -> None:
    """Write ``tensor`` as ``torch.save`` would (CRC-free where torch allows) into ``out``; an
    ``OSError`` of ``out`` is raised once torch's writer has finished, never inside it."""
    guarded = _HeldFailure(out)
    _save_tensor(tensor, guarded)
    if guarded.error is not None:
        raise guarded.error


@dataclass(frozen=True)
class TensorTemplate:
    """The archive ``torch.save`` writes for every tensor of one signature, around its bytes."""

    prefix: bytes
    suffix: bytes


_templates: dict[tuple, TensorTemplate | None] = {}
_templates_lock = threading.Lock()


def storage_alignment() -> int:
    """torch's current storage alignment in archives (a setting: read it once per file, not per
    tensor, and pass it to :func:`template_for`)."""
    return torch.serialization._get_storage_alignment()


def template_for(tensor: torch.Tensor, alignment: int) -> TensorTemplate | None:
    """The template of ``tensor``'s signature (a contiguous CPU tensor from :func:`host_tensor`,
    under :data:`TEMPLATE_MAX_BYTES`) at ``alignment`` (:func:`storage_alignment`), made on
    first sight; None where this torch's archives do not have that shape (then the tensor is
    written by the serializer)."""
    if _save_tensor is not _save_tensor_without_crc:
        return None  # with the CRC, the archive depends on the bytes
    key = (tensor.dtype, tensor.shape, tensor.stride(), alignment)
    try:
        return _templates[key]
    except KeyError:
        pass
    template = _make_template(tensor) if alignment == storage_alignment() else None
    with _templates_lock:
        if len(_templates) >= _TEMPLATE_CACHE_MAX:
            _templates.clear()  # a state dict of that many shapes gains little from templates
        _templates[key] = template
    return template


def _make_template(like: torch.Tensor) -> TensorTemplate | None:
    """Save two tensors of ``like``'s signature whose every byte differs (all 0x00, all 0xFF):
    the archives must have the same length and differ exactly in one run of ``nbytes`` bytes,
    which is the data; what is around it is the template."""
    nbytes = like.nbytes
    archives = []
    for fill in (0x00, 0xFF):
        t = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)
        if nbytes:
            torch.frombuffer(tensor_bytes(t), dtype=torch.uint8).fill_(fill)
        buf = io.BytesIO()
        try:
            _save_tensor(t, buf)
        except Exception:
            return None
        archives.append(buf.getvalue())
    zeros, ones = archives
    if len(zeros) != len(ones):
        return None
    if nbytes == 0:
        return TensorTemplate(zeros, b"") if zeros == ones else None
    start = next((i for i in range(len(zeros)) if zeros[i] != ones[i]), None)
    if start is None:
        return None
    end = start + nbytes
    if (zeros[:start] != ones[:start] or zeros[end:] != ones[end:]
            or zeros[start:end] != bytes(nbytes) or ones[start:end] != b"\xff" * nbytes):
        return None
    return TensorTemplate(zeros[:start], zeros[end:])
