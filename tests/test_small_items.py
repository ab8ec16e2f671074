"""Many small items: a save gathers torch's small records into large writes, and the files stay
exactly what stock DCP reads (stock ``dcp.load`` without tierstore loads them bitwise)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import tierstore

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def many_small(n: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    base = torch.randn(64, 64, generator=gen)
    sd = {f"t{i}": torch.randn(i % 7 + 1, generator=gen) for i in range(n)}
    sd.update({
        "empty": torch.empty(0), "empty2d": torch.zeros(3, 0, dtype=torch.int16),
        "scalar": torch.tensor(3.5, dtype=torch.float64), "flag": torch.tensor([True, False]),
        "half": torch.randn(5, generator=gen).half(), "bf16": torch.randn(9, generator=gen).bfloat16(),
        "int8": torch.arange(-5, 5, dtype=torch.int8), "view": base[::3, 1::5],
        "transposed": base.t(), "big": torch.randn(1 << 17, generator=gen),
        "step": 7, "name": "run-3",
    })
    return sd


def zeros_like_tree(sd: dict) -> dict:
    return {k: (torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else None)
            for k, v in sd.items()}


def assert_bitwise(out: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            got = out[key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert _raw_bytes(got) == _raw_bytes(value), key
        else:
            assert out[key] == value, key


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes (bitwise: -0.0 and NaN payloads count)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_16384_small_tensors_load_bitwise_with_tierstore_and_with_stock_dcp(tmp_path):
    want = many_small(16_384)
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with tierstore.open(config) as store:
        dcp.save(want, storage_writer=store.writer(), checkpoint_id="step-1")
        out = zeros_like_tree(want)
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert_bitwise(out, want)
        assert store.verify("step-1").ok
    stock = zeros_like_tree(want)
    dcp.load(stock, storage_reader=FileSystemReader(str(tmp_path / "nvme" / "step-1")))
    assert_bitwise(stock, want)
