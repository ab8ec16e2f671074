"""Tensor records built from templates are exactly ``torch.save``'s bytes (CRC off), for every
kind of small tensor; a torch whose archives do not fit the template idea loses the shortcut,
never the format."""

from __future__ import annotations

import io

import pytest
import torch

from tierstore.format import tensor_records
from tierstore.format.tensor_records import (host_tensor, storage_alignment, template_for,
                                             tensor_bytes)

SMALL_TENSORS = {
    "fp32 vector": torch.randn(1024),
    "bf16 matrix": torch.randn(3, 5).bfloat16(),
    "fp16": torch.randn(17).half(),
    "fp64 scalar": torch.tensor(2.5, dtype=torch.float64),
    "bool": torch.rand(7) > 0.5,
    "int8": torch.arange(-9, 9, dtype=torch.int8),
    "int64": torch.arange(1000),
    "complex": torch.randn(4, dtype=torch.complex64),
    "zero-size": torch.empty(0, 3),
    "size-1 dims with odd strides": torch.randn(1, 6).as_strided((1, 6), (1, 1)),
    "4-d": torch.randn(2, 3, 4, 5),
    "uint8 one byte": torch.tensor([200], dtype=torch.uint8),
}


def crc_free_save(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(tensor, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    return buf.getvalue()


def record(tensor: torch.Tensor) -> bytes:
    template = template_for(tensor, storage_alignment())
    assert template is not None
    return template.prefix + bytes(tensor_bytes(tensor)) + template.suffix


@pytest.mark.parametrize("name", list(SMALL_TENSORS))
def test_a_record_from_a_template_is_torch_save_byte_for_byte(name):
    tensor = host_tensor(SMALL_TENSORS[name])
    assert record(tensor) == crc_free_save(tensor)
    again = host_tensor(SMALL_TENSORS[name].clone())  # the same signature, other memory
    assert record(again) == crc_free_save(again)
    loaded = torch.load(io.BytesIO(record(tensor)), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert bytes(tensor_bytes(loaded.contiguous())) == bytes(tensor_bytes(tensor))


def test_an_archive_that_is_not_bytes_plus_fixed_parts_gets_no_template(monkeypatch):
    """A serializer whose archive depends on more than the bytes (here: a counter written
    after the data) must not be templated: every record then comes from the serializer."""
    calls = []

    def counting_save(tensor, out):
        calls.append(1)
        tensor_records._save_tensor_without_crc(tensor, out)
        out.write(len(calls).to_bytes(4, "little"))

    monkeypatch.setattr(tensor_records, "_save_tensor", counting_save)
    monkeypatch.setattr(tensor_records, "_save_tensor_without_crc", counting_save)
    monkeypatch.setattr(tensor_records, "_templates", {})
    assert template_for(torch.randn(11), storage_alignment()) is None
    assert calls  # it was tried, and refused
