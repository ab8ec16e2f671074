"""Many small items: a save gathers torch's small records into large writes, and the files stay
exactly what stock DCP reads (stock ``dcp.load`` without tierstore loads them bitwise)."""

from __future__ import annotations

import io
import warnings

import pytest
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
    """Destinations for a load of ``sd``: zeroed contiguous tensors, None for other values."""
    return {k: (torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor)
                else zeros_like_tree(v) if isinstance(v, dict) else None)
            for k, v in sd.items()}


def assert_bitwise(out: dict, want: dict, where: str = "") -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            got = out[key]
            assert got.dtype == value.dtype and got.shape == value.shape, where + key
            assert _raw_bytes(got) == _raw_bytes(value), where + key
        elif isinstance(value, dict):
            assert_bitwise(out[key], value, f"{where}{key}.")
        else:
            assert out[key] == value, where + key


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


def stock_record(tensor: torch.Tensor) -> bytes:
    """What ``torch.save`` writes for ``tensor`` with its zip CRC turned off (the only part of
    stock's bytes tierstore leaves out; ``torch.load`` never reads it)."""
    buf = io.BytesIO()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(tensor.detach().clone(memory_format=torch.contiguous_format), buf)
    finally:
        torch.serialization.set_crc32_options(True)
    return buf.getvalue()


def test_every_tensor_record_is_byte_for_byte_what_torch_save_writes(tmp_path):
    want = many_small(600)
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with tierstore.open(config) as store:
        dcp.save(want, storage_writer=store.writer(), checkpoint_id="step-1")
    ckpt = tmp_path / "nvme" / "step-1"
    metadata = FileSystemReader(str(ckpt)).read_metadata()
    files = {}
    checked = 0
    for index, info in metadata.storage_data.items():
        value = want[index.fqn]
        if not isinstance(value, torch.Tensor):
            continue
        if info.relative_path not in files:
            files[info.relative_path] = (ckpt / info.relative_path).read_bytes()
        record = files[info.relative_path][info.offset:info.offset + info.length]
        assert record == stock_record(value), index.fqn
        checked += 1
    assert checked == sum(isinstance(v, torch.Tensor) for v in want.values())


def mixed_state() -> dict:
    """Large and small tensors of several dtypes, views, non-contiguous and zero-size tensors,
    and non-tensor values between them."""
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(300, 400, generator=gen)
    sd: dict = {}
    for i in range(40):
        sd[f"small{i}"] = torch.randn(i + 1, generator=gen).to(
            [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.float64][i % 5])
        sd[f"meta{i}"] = {"step": i, "tag": f"t{i}"}
        if i % 10 == 0:
            sd[f"large{i}"] = torch.randn(256, 1024 + i, generator=gen)  # over 1 MiB each
    sd.update({
        "view": base[10:20], "strided": base[::2, ::3], "transposed": base.t(),
        "empty": torch.empty(0, 5), "scalar": torch.tensor(2.5), "flags": torch.rand(33) > 0.5,
        "complex": torch.randn(7, dtype=torch.complex64, generator=gen),
        "row": torch.randn(1, 9, generator=gen).as_strided((1, 9), (1, 1)),
        "int64": torch.arange(-70_000, 70_000, dtype=torch.int64),
    })
    return sd


@pytest.mark.parametrize("verify_on_load", [True, False])
def test_mixed_items_in_several_files_per_rank_round_trip_bitwise(tmp_path, verify_on_load):
    want = mixed_state()
    config = {"store": {"io_threads": 4, "verify_on_load": verify_on_load},
              "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with tierstore.open(config) as store:
        dcp.save(want, storage_writer=store.writer(), checkpoint_id="step-1")
        assert len(list((tmp_path / "nvme" / "step-1").glob("*.distcp"))) >= 3
        out = zeros_like_tree(want)
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
        assert_bitwise(out, want)
    stock = zeros_like_tree(want)
    dcp.load(stock, storage_reader=FileSystemReader(str(tmp_path / "nvme" / "step-1")))
    assert_bitwise(stock, want)


def test_small_items_load_into_destinations_of_another_layout(tmp_path):
    """Destinations the raw bytes cannot be copied into (non-contiguous) are still filled right."""
    want = {f"t{i}": torch.randn(6, 4) for i in range(50)}
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with tierstore.open(config) as store:
        dcp.save(want, storage_writer=store.writer(), checkpoint_id="step-1")
        out = {k: torch.zeros(4, 6).t() for k in want}  # transposed: not contiguous
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def test_small_items_share_one_file_and_large_ones_spread_by_bytes(tmp_path):
    """With io_threads = 4, thousands of tiny tensors are one file (one thread: spread over
    threads they only fight over the GIL); large tensors fill the lightest files."""
    sd = {f"tiny{i}": torch.randn(16) for i in range(3000)}
    config = {"store": {"io_threads": 4},
              "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="tiny")
        sd.update({f"large{i}": torch.randn(1 << 18) for i in range(6)})  # 1 MiB each
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="mixed")
    assert len(list((tmp_path / "nvme" / "tiny").glob("*.distcp"))) == 1
    sizes = sorted(f.stat().st_size for f in (tmp_path / "nvme" / "mixed").glob("*.distcp"))
    # The tiny ones' file (about 4.8 MB of records) is the heaviest; the six large tensors
    # went two by two to the three others.
    assert len(sizes) == 4 and sizes[-1] > 4_000_000
    assert all(2 << 20 <= s < (2 << 20) + (1 << 16) for s in sizes[:3]), sizes
