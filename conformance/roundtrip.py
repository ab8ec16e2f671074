"""``RoundTripTests``: a real ``dcp.save`` / ``dcp.load`` through a store built from a config.

These run a whole store (staging, writer, commit protocol, backend, reader) the way a training job
does, and compare what comes back bit for bit with what went in.

No test is ever skipped. :class:`RoundTripTests` runs for every config;
:class:`StockLoadableRoundTripTests` adds the no-lock-in check (stock ``dcp.load`` reads the
checkpoint straight from the first tier) for configs whose first tier is a filesystem
(``local_path()``) without codecs, and fails if the config has no such first tier.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.store import Store

__all__ = ["RoundTripTests", "StockLoadableRoundTripTests", "make_state_dict",
           "assert_state_dicts_equal"]

INVALID_IDS = ["", "../x", "a/b", "/abs", ".hidden", "..", "step 1", "step-1\n", "a\\b"]


def _random_tensor(gen: torch.Generator, dtype: torch.dtype,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """Every bit random (NaNs with payloads, denormals, -0.0 included) except for bool."""
    numel = 1
    for s in shape:
        numel *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def make_state_dict(seed: int = 0) -> dict[str, Any]:
    """A state dict like a training job's: nested dicts, several dtypes, a 0-d and an empty
    tensor, a non-contiguous view, a tensor of a few MiB and non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": _random_tensor(g, torch.float32, (1024, 1024)),  # 4 MiB
            "layer": {
                "weight": _random_tensor(g, torch.bfloat16, (64, 48)),
                "bias": _random_tensor(g, torch.float16, (48,)),
                "scale": _random_tensor(g, torch.float64, (7,)),
                "proj_t": _random_tensor(g, torch.float32, (32, 16)).t(),  # non-contiguous
            },
        },
        "optim": {
            "step": _random_tensor(g, torch.int64, ()),
            "exp_avg": _random_tensor(g, torch.float32, (300, 5)),
            "mask": _random_tensor(g, torch.bool, (33,)),
            "codes": _random_tensor(g, torch.int8, (2, 3, 4)),
            "bytes": _random_tensor(g, torch.uint8, (100,)),
            "counts": _random_tensor(g, torch.int32, (9,)),
            "param_groups": [{"lr": 0.001 * (seed + 1), "betas": (0.9, 0.999)}],
        },
        "empty": torch.empty(0, 4),
        "epoch": seed + 3,
        "run": {"name": f"run-{seed}", "tags": ["a", "b"]},
    }


def _empty_like(sd: Any) -> Any:
    """A load target of the same structure: zero tensors in fresh memory, other values emptied."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros(sd.shape, dtype=sd.dtype)
    if isinstance(sd, dict):
        return {k: _empty_like(v) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(_empty_like(v) for v in sd)
    return type(sd)() if isinstance(sd, (int, float, str)) else None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_state_dicts_equal(got: Any, want: Any, where: str = "state_dict") -> None:
    """Assert ``got`` equals ``want`` bit for bit: same keys, dtypes, shapes and bytes of every
    tensor (so NaN payloads and -0.0 count), and equal non-tensor values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), \
            f"{where}: expected a tensor, got {type(got).__name__}"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
        assert got.shape == want.shape, \
            f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert torch.equal(_bits(got), _bits(want)), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        assert sorted(got) == sorted(want), f"{where}: keys {sorted(got)}, expected {sorted(want)}"
        for key in want:
            assert_state_dicts_equal(got[key], want[key], f"{where}[{key!r}]")
    else:
        assert got == want, f"{where}: {got!r}, expected {want!r}"


def _tier_roots(store: Store) -> dict[str, list[str]]:
    """What each tier's root holds, and (by the backdoor) what the directory above it holds, so
    that an id escaping the root (``../x``) is seen too."""
    seen = {}
    for tier in store._ctx.tiers:
        seen[tier.name] = sorted(tier.backend.list(""))
        local = tier.backend.local_path("")
        if local is not None:
            parent = os.path.dirname(os.path.abspath(local))
            seen[f"{tier.name} (parent)"] = sorted(os.listdir(parent))
    return seen


class RoundTripTests:
    """Save and load through ``store.writer()`` / ``store.reader()`` with real DCP calls.

    Subclass it in a class named ``Test...`` and provide the fixture ``store_config``: a dict
    for :func:`tierstore.open` with fresh tier roots per test::

        class TestMyBackendRoundTrip(RoundTripTests):
            @pytest.fixture
            def store_config(self, tmp_path):
                return {"store": {"plugins": ["my_company.tierstore_ext"]},
                        "tier": [{"name": "mine", "backend": "mine", "path": str(tmp_path)}]}

    The fixture ``store`` (opened from ``store_config``, closed after the test) is provided.
    The overwrite test runs the config twice, with ``[store] overwrite`` off and on, whatever
    ``store_config`` sets. If the first tier is a filesystem without codecs, subclass
    :class:`StockLoadableRoundTripTests` instead to also check that stock DCP loads it.
    """

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def store_config(self) -> dict[str, Any]:
        """The store's configuration (dict form of the TOML). Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'store_config' fixture: a dict for "
                    f"tierstore.open() with fresh tier roots (see RoundTripTests)")

    @pytest.fixture
    def store(self, store_config: dict[str, Any]) -> Iterator[Store]:
        """A store opened from ``store_config``, closed after the test."""
        with tierstore.open(copy.deepcopy(store_config)) as store:
            yield store

    # -- tests ---------------------------------------------------------------------------------
    def test_save_then_load_is_bitwise_identical(self, store):
        """dcp.save then dcp.load gives every tensor and value back bit for bit."""
        sd = make_state_dict(1)
        want = copy.deepcopy(sd)
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        assert_state_dicts_equal(sd, want)  # saving does not touch the caller's state dict

        loaded = _empty_like(sd)
        dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-1")
        assert_state_dicts_equal(loaded, want)

    def test_async_save_keeps_what_was_staged(self, store):
        """dcp.async_save saves the state as it was when the call returned, not later changes."""
        sd = make_state_dict(2)
        want = copy.deepcopy(sd)
        future = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-2")
        # Training goes on and changes the tensors in place while the save runs.
        sd["model"]["embed.weight"].add_(1.0)
        sd["optim"]["counts"].zero_()
        future.result()
        store.wait()
        loaded = _empty_like(want)
        dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-2")
        assert_state_dicts_equal(loaded, want)

    def test_saved_checkpoints_are_listed_newest_first(self, store):
        """Saves show up in list() (newest first, with tiers and sizes) and latest()."""
        assert store.list() == []
        assert store.latest() is None
        writer = store.writer()  # one writer for several saves
        dcp.save(make_state_dict(1), storage_writer=writer, checkpoint_id="step-1")
        assert store.latest() == "step-1"
        dcp.save(make_state_dict(2), storage_writer=writer, checkpoint_id="step-2")
        assert store.latest() == "step-2"

        infos = store.list()
        assert [i.id for i in infos] == ["step-2", "step-1"]
        tier_names = [t.name for t in store._ctx.tiers]
        for info in infos:
            assert info.tiers and set(info.tiers) <= set(tier_names)
            assert info.size_bytes > 4 << 20  # at least the 4 MiB embedding
            assert not info.pinned
            assert 0 < info.created <= info.committed

    def test_verify_of_a_fresh_checkpoint_is_ok(self, store):
        """store.verify of a checkpoint just saved is ok on the tiers that hold it."""
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        report = store.verify("step-1")
        assert report.ok, str(report)
        assert report.tiers == store.list()[0].tiers

    @pytest.mark.parametrize("overwrite", [False, True], ids=["overwrite off", "overwrite on"])
    def test_saving_an_existing_id_follows_the_overwrite_setting(self, store_config, overwrite):
        """Saving an existing id: with ``[store] overwrite`` off it is a CommitError and the first
        checkpoint stays intact and loadable; with it on, the new data replaces the old."""
        config = copy.deepcopy(store_config)
        config.setdefault("store", {})["overwrite"] = overwrite
        with tierstore.open(config) as store:
            first, second = make_state_dict(1), make_state_dict(2)
            want_first, want_second = copy.deepcopy(first), copy.deepcopy(second)
            dcp.save(first, storage_writer=store.writer(), checkpoint_id="step-1")
            store.wait()
            if overwrite:
                dcp.save(second, storage_writer=store.writer(), checkpoint_id="step-1")
                want = want_second
            else:
                with pytest.raises(tierstore.CommitError, match="step-1"):
                    dcp.save(second, storage_writer=store.writer(), checkpoint_id="step-1")
                want = want_first
            store.wait()
            assert [i.id for i in store.list()] == ["step-1"]
            report = store.verify("step-1")
            assert report.ok, str(report)
            loaded = _empty_like(want)
            dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-1")
            assert_state_dicts_equal(loaded, want)

    @pytest.mark.parametrize("bad_id", INVALID_IDS, ids=repr)
    def test_invalid_ids_are_refused_before_anything_is_written(self, store, bad_id):
        """An id that is not one path segment is a ValueError for save, load and verify, and
        nothing appears on any tier (nor beside it)."""
        before = _tier_roots(store)
        with pytest.raises(ValueError, match="checkpoint id|checkpoint_id"):
            dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id=bad_id)
        assert _tier_roots(store) == before
        with pytest.raises(ValueError):
            dcp.load(_empty_like(make_state_dict(1)), storage_reader=store.reader(),
                     checkpoint_id=bad_id)
        with pytest.raises(ValueError):
            store.verify(bad_id)
        assert _tier_roots(store) == before
        assert store.list() == []

    def test_loading_a_missing_checkpoint_raises_checkpoint_not_found(self, store):
        """Loading an id no tier holds is CheckpointNotFound naming the id."""
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        with pytest.raises(tierstore.CheckpointNotFound, match="step-7"):
            dcp.load(_empty_like(make_state_dict(1)), storage_reader=store.reader(),
                     checkpoint_id="step-7")


class StockLoadableRoundTripTests(RoundTripTests):
    """:class:`RoundTripTests` plus the no-lock-in check, for a config whose first tier is a
    filesystem (its backend has a ``local_path()``) without codecs: stock ``dcp.load`` (its own
    ``FileSystemReader``, no tierstore) reads a checkpoint straight from that tier. A test fails
    if the config's first tier is not such a tier. Same fixtures as :class:`RoundTripTests`.
    """

    @staticmethod
    def _stock_loadable_problem(store: Store) -> str | None:
        """Why the store's first tier cannot be read by stock DCP, or None when it can."""
        tier = store._ctx.tiers[0]
        if tier.backend.local_path("") is None:
            return (f"the first tier '{tier.name}' (backend {tier.config.backend!r}) has no "
                    f"local_path(), so stock dcp.load cannot read it")
        if tier.config.codecs:
            return (f"the first tier '{tier.name}' has codecs {list(tier.config.codecs)}, which "
                    f"stock dcp.load does not undo")
        return None

    def test_config_has_a_stock_loadable_first_tier(self, store):
        """The config really has what this class is for: a first tier that is a filesystem
        without codecs (else subclass RoundTripTests instead)."""
        problem = self._stock_loadable_problem(store)
        assert problem is None, \
            f"{type(self).__name__} subclasses StockLoadableRoundTripTests but {problem}: " \
            f"subclass RoundTripTests instead, or put a filesystem tier without codecs first"

    def test_stock_dcp_loads_it_from_the_first_tier(self, store):
        """No lock-in: stock dcp.load reads the checkpoint straight from the first tier's files."""
        problem = self._stock_loadable_problem(store)
        assert problem is None, problem
        tier = store._ctx.tiers[0]
        checkpoint_id = f"step-{tier.config.every}"  # a step the first tier takes
        sd = make_state_dict(3)
        want = copy.deepcopy(sd)
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id=checkpoint_id)
        assert tier.name in store.list()[0].tiers
        local = tier.backend.local_path(checkpoint_id)
        assert local is not None and os.path.isdir(local), local
        loaded = _empty_like(want)
        dcp.load(loaded, checkpoint_id=local)  # stock FileSystemReader, no tierstore
        assert_state_dicts_equal(loaded, want, f"tier '{tier.name}'")
