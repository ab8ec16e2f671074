"""A non-tensor value whose numpy dtype is forged: someone who can write an unsigned tier saves a
value (DCP pickles it with ``torch.save``) that is an array of a structured dtype with an object
field, its pickled dtype state claiming it holds no objects. Built as pickled, numpy would read
eight bytes of the file as a pointer to a Python object and crash the process reading the field.
A load refuses such a value, naming it and saying why, and leaves the destination as it was;
the numpy values training really saves (RNG state, arrays and scalars of plain dtypes) still
load exactly.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from numpy._core.multiarray import _reconstruct
from torch.distributed.checkpoint.api import CheckpointException

import tierstore
from tierstore import TierstoreError

OBJECT_FIELD = (3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0)


class ForgedDtype:
    """Pickles as ``numpy.dtype('V8')`` given ``state``: what numpy's own ``__setstate__``
    accepts without checking it against the dtype's flags."""

    def __init__(self, state: tuple, name: str = "V8"):
        self.state, self.name = state, name

    def __reduce__(self):
        return np.dtype, (self.name, False, True), self.state


class ForgedArray:
    """Pickles as numpy pickles an array, with ``dtype`` and ``data`` as given."""

    def __init__(self, dtype, data: bytes, shape: tuple = (1,)):
        self.dtype, self.data, self.shape = dtype, data, shape

    def __reduce__(self):
        return (_reconstruct, (np.ndarray, (0,), b"b"),
                (1, self.shape, self.dtype, False, self.data))


def config(tmp_path: Path) -> dict:
    return {"tier": [{"name": "fast", "backend": "local", "path": str(tmp_path / "fast")}]}


def save(tmp_path: Path, value) -> None:
    with tierstore.open(config(tmp_path)) as store:
        dcp.save({"w": torch.arange(4.0), "loader": {"order": value, "epoch": 2}},
                 storage_writer=store.writer(), checkpoint_id="step-1")


def refused_load(tmp_path: Path) -> tuple[str, dict]:
    out = {"w": torch.zeros(4), "loader": {"order": "unchanged", "epoch": 0}}
    with tierstore.open(config(tmp_path)) as store:
        # DCP wraps what read_data raises in a CheckpointException carrying our message.
        with pytest.raises((TierstoreError, CheckpointException)) as info:
            dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    return str(info.value), out


def test_a_value_with_an_object_dtype_forged_as_plain_is_refused_not_run(tmp_path):
    save(tmp_path, ForgedArray(ForgedDtype(OBJECT_FIELD), b"\x41" * 8))
    message, out = refused_load(tmp_path)
    assert "non-tensor value 'loader.order'" in message
    assert "numpy object dtype ('O8')" in message and "only plain dtypes" in message
    assert "nothing of it was loaded and nothing ran" in message
    assert out["loader"] == {"order": "unchanged", "epoch": 0}


@pytest.mark.parametrize("state, why", [
    # A structured dtype even of plain fields: fields are offsets numpy trusts.
    ((3, "|", None, ("a",), {"a": (np.dtype("<f8"), 0)}, 8, 1, 16),
     "structured dtype, with fields"),
    ((3, "|", (np.dtype("<f8"), (1,)), None, None, 8, 1, 0), "subarray dtype"),
    # A plain void dtype whose flags say it holds objects (63), or whose size is not 8.
    ((3, "|", None, None, None, 8, 1, 63), "not the one numpy writes"),
    ((3, "|", None, None, None, 4096, 1, 0), "not the one numpy writes"),
], ids=["structured", "subarray", "object-flags", "item-size"])
def test_a_value_with_a_dtype_state_numpy_never_writes_is_refused(tmp_path, state, why):
    save(tmp_path, ForgedArray(ForgedDtype(state), b"\x00" * 8))
    message, out = refused_load(tmp_path)
    assert "non-tensor value 'loader.order'" in message
    assert "numpy dtype '|V8'" in message and why in message, message
    assert out["loader"] == {"order": "unchanged", "epoch": 0}


def test_an_array_given_fewer_bytes_than_its_shape_needs_is_refused(tmp_path):
    save(tmp_path, ForgedArray(np.dtype("<f8"), b"\x00" * 8, shape=(1 << 20,)))
    message, out = refused_load(tmp_path)
    assert "non-tensor value 'loader.order'" in message
    assert "8 bytes of data, not 8388608" in message
    assert out["loader"] == {"order": "unchanged", "epoch": 0}


def test_reading_the_forged_field_never_crashes_the_process(tmp_path):
    """What a training job does next with its loaded state: read the field. Run in its own
    process, since a load that built the value would crash the interpreter there."""
    save(tmp_path, ForgedArray(ForgedDtype(OBJECT_FIELD), b"\x41" * 8))
    script = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp, tierstore
        out = {{"w": torch.zeros(4), "loader": {{"order": None, "epoch": 0}}}}
        with tierstore.open({config(tmp_path)!r}) as store:
            try:
                dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                print("REFUSED", "loader.order" in str(exc))
            else:
                print("LOADED", out["loader"]["order"]["a"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["REFUSED", "True"]


def stock_round_trip(value):
    """``value`` as stock DCP saves and loads a non-tensor value."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


def test_numpy_values_of_plain_dtypes_still_load_exactly(tmp_path):
    np.random.seed(5)
    values = {
        "rng": np.random.get_state(),
        "f8": np.linspace(0, 1, 7), "big_endian": np.arange(5, dtype=">i4"),
        "u1": np.arange(3, dtype=np.uint8), "bool": np.array([True, False]),
        "c16": np.array([1 + 2j]), "f2": np.array([0.5], dtype=np.float16),
        "text": np.array(["ab", "cde"]), "bytes": np.array([b"xy"], dtype="S3"),
        "void": np.zeros(2, dtype="V4"), "empty": np.zeros((0, 3)),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "when": np.array(["2024-01-02T03:04"], dtype="datetime64[ns]"),
        "every_5s": np.array([10], dtype="timedelta64[5s]"), "date": np.datetime64("2024-05-06"),
        "scalar_f4": np.float32(2.5), "scalar_i8": np.int64(-3), "scalar_u": np.str_("hé"),
    }
    with tierstore.open(config(tmp_path)) as store:
        dcp.save({"w": torch.ones(2), "np": dict(values)}, storage_writer=store.writer(),
                 checkpoint_id="step-1")
        out = {"w": torch.zeros(2), "np": {key: None for key in values}}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    got = out["np"]
    assert got["rng"][0] == values["rng"][0] and got["rng"][2:] == values["rng"][2:]
    assert np.array_equal(got["rng"][1], values["rng"][1])
    for key, value in values.items():
        if key == "rng":
            continue
        want = stock_round_trip(value)  # what stock dcp.load gives (numpy's own unpickling)
        assert type(got[key]) is type(want) and got[key].dtype == want.dtype, key
        assert np.asarray(got[key]).tobytes() == np.asarray(want).tobytes(), key
        if isinstance(want, np.ndarray):
            assert got[key].shape == want.shape and got[key].flags.f_contiguous == \
                want.flags.f_contiguous, key
