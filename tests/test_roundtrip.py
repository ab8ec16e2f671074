"""Bitwise round trips through dcp.save/dcp.load with a tierstore writer and reader (one process),
for every kind of state a training job checkpoints."""

from __future__ import annotations

import io
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import assert_state_dicts_equal, load_like
from torch.distributed.checkpoint.stateful import Stateful

import tierstore

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                      "float8_e5m2fnuz") if hasattr(torch, n)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          torch.complex128] + FLOAT8


def random_tensor(shape, dtype, gen):
    """Random bytes of the right dtype (every bit pattern matters for a bitwise test)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, generator=gen, dtype=torch.float32)
        if dtype.is_complex:
            return torch.complex(base, torch.randn(shape, generator=gen)).to(dtype)
        return base.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen,
                         dtype=torch.int64).to(dtype)


def round_trip(store, sd, cid="step-1"):
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id=cid)
    return load_like(store, cid, sd)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bitwise(store, dtype):
    gen = torch.Generator().manual_seed(0)
    sd = {"small": random_tensor((7, 3), dtype, gen),
          "large": random_tensor((600, 1000), dtype, gen)}  # large enough for the direct read path
    assert_state_dicts_equal(round_trip(store, sd), sd)


def test_nan_and_inf_payloads_round_trip(store):
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45])
    nan_bits = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)  # non-canonical NaN
    sd = {"t": torch.cat([t, nan_bits])}
    assert_state_dicts_equal(round_trip(store, sd), sd)


def test_zero_size_tensors(store):
    sd = {"empty": torch.empty(0), "empty2d": torch.empty(0, 5, dtype=torch.bfloat16),
          "scalar": torch.tensor(3.5)}
    assert_state_dicts_equal(round_trip(store, sd), sd)


def test_non_contiguous_views_save_only_their_projection(store, tmp_path):
    base = torch.arange(1_000_000, dtype=torch.float32).reshape(1000, 1000)
    sd = {"transposed": base.t(), "strided": base[::3, 1::2], "narrow": base[10:20],
          "expanded": torch.arange(4.0).expand(1000, 4)}
    out = round_trip(store, sd)
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
    # The narrow view must not drag the 4 MB base storage into the checkpoint.
    info = store.list()[0]
    assert info.size_bytes < 4_000_000 * 2.2


class Counter(Stateful):
    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": self.n, "blob": io.BytesIO(b"x" * 100)}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_byte_io_items_step_counters_rng_state_and_stateful(store):
    random.seed(1234)
    py_rng = random.getstate()
    torch_rng = torch.get_rng_state()
    sd = {"step": 4242, "py_rng": py_rng, "torch_rng": torch_rng, "meta": {"lr": 3e-4, "name": "run-7"},
          "counter": Counter(17)}
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    out = {"step": 0, "py_rng": None, "torch_rng": torch.zeros_like(torch_rng),
           "meta": {"lr": 0.0, "name": ""}, "counter": Counter(0)}
    dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert out["step"] == 4242
    assert out["py_rng"] == py_rng
    assert torch.equal(out["torch_rng"], torch_rng)
    assert out["meta"] == {"lr": 3e-4, "name": "run-7"}
    assert out["counter"].n == 17


def test_ten_thousand_small_tensors(store):
    gen = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.w": torch.randn(4, generator=gen) for i in range(10_000)}
    assert_state_dicts_equal(round_trip(store, sd), sd)


def test_single_tensor_of_256_mib(tmp_path):
    config = {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "t"),
                        "fsync": False}]}
    big = torch.empty(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
    big.copy_(torch.arange(big.numel(), dtype=torch.float32))
    big[::4097] = -1.5
    with tierstore.open(config) as store:
        dcp.save({"big": big}, storage_writer=store.writer(), checkpoint_id="step-1")
        out = {"big": torch.zeros_like(big)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["big"], big)


def test_stock_dcp_loads_a_tierstore_local_checkpoint(store, local_config):
    gen = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(300, 300, generator=gen), "b": torch.randn(300, generator=gen).bfloat16(),
          "step": 9}
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-9")
    out = {"w": torch.zeros(300, 300), "b": torch.zeros(300, dtype=torch.bfloat16), "step": 0}
    # Plain DCP, no tierstore involved: the directory is a stock DCP checkpoint.
    dcp.load(out, checkpoint_id=f"{local_config['tier'][0]['path']}/step-9")
    assert_state_dicts_equal(out, sd)


def test_load_into_a_different_dtype_and_a_resharded_view(store):
    sd = {"w": torch.randn(1000, 300)}
    dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
    out = {"w": torch.zeros(1000, 300, dtype=torch.float64)}
    dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["w"], sd["w"].double())
    # A non-contiguous destination takes the general path and gets the same values.
    dest = torch.zeros(300, 1000).t()
    dcp.load({"w": dest}, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(dest, sd["w"])


def test_memory_tier_round_trip(tmp_path):
    config = {"tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "shm")}]}
    sd = {"w": torch.randn(500, 500), "step": 3}
    with tierstore.open(config) as store:
        assert_state_dicts_equal(round_trip(store, sd), sd)


def test_tensor_items_are_exactly_torch_save_bytes_without_crc():
    """Data files hold torch.save output (what stock DCP readers expect), minus the zip CRC."""
    from tierstore.format.tensor_records import save_tensor

    t = torch.randn(300, 7).bfloat16()
    ours = io.BytesIO()
    save_tensor(t, ours)
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        stock = io.BytesIO()
        torch.save(t, stock)
    finally:
        torch.serialization.set_crc32_options(previous)
    assert ours.getvalue() == stock.getvalue()
    assert torch.serialization.get_crc32_options() == previous
