"""``StagerTests``: what a staging plugin (the copy ``dcp.async_save`` makes of a state dict before
training goes on) must do.

The contract (:class:`tierstore.plugin.Stager`): ``stage`` returns a copy of the state dict with
the same structure, whose tensors are on the host, equal to the originals, and which does not
change when training updates the originals afterwards.
"""

from __future__ import annotations

import copy
import io
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.plugin import Stager, StagingJob, hookimpl

from ._helpers import assert_options_declared, assert_trees_equal, tensor_bytes
from .roundtrip import _empty_like, assert_state_dicts_equal, make_state_dict

__all__ = ["StagerTests", "make_training_state", "mutate_in_place"]


def make_training_state(seed: int = 0) -> dict[str, Any]:
    """A state dict with every shape of value staging meets: nested dicts, lists of tensors and
    dicts, a tuple, several dtypes, a 0-d, an empty and a non-contiguous tensor, plain values
    and an ``io.BytesIO``. Values are finite, so that in-place updates really change them."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(256, 128, generator=g),
            "b": torch.randn(128, generator=g).to(torch.bfloat16),
            "w_t": torch.randn(48, 32, generator=g).t(),
            "half": torch.randn(3, 5, generator=g).half(),
        },
        "layers": [torch.randn(7, generator=g), {"scale": torch.randn(2, 2, generator=g).double()}],
        "optim": {
            "step": torch.tensor(seed + 11),
            "mask": torch.rand(33, generator=g) > 0.5,
            "codes": torch.randint(-100, 100, (4, 4), generator=g, dtype=torch.int8),
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "ids": [0, 1, 2]}],
        },
        "pair": (torch.arange(6, dtype=torch.int32), "tag"),
        "empty": torch.empty(0, 3),
        "epoch": seed + 3,
        "name": f"run-{seed}",
        "extra": io.BytesIO(b"dataloader state " + bytes([seed % 256]) * 100),
    }


def mutate_in_place(sd: dict[str, Any]) -> None:
    """What training does after staging: every tensor updated in place, plain values, lists and
    dicts changed, the BytesIO overwritten."""
    def update(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bool:
                value.logical_not_()
            else:
                value.add_(1)
        elif isinstance(value, dict):
            for v in value.values():
                update(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                update(v)

    update(sd)
    sd["epoch"] += 100
    sd["name"] = "changed"
    sd["optim"]["param_groups"][0]["lr"] = 99.0
    sd["optim"]["param_groups"][0]["ids"].append(3)
    sd["layers"].append(torch.ones(1))
    sd["extra"].seek(0)
    sd["extra"].write(b"OVERWRITTEN")


def _tensors(tree: Any, where: str = "state_dict") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield where, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{where}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{where}[{i}]")


class _StagerPlugin:
    """A plugin object registering one stager instance under ``name``."""

    def __init__(self, name: str, stager: Stager):
        self.name, self.stager = name, stager

    @hookimpl
    def tierstore_register_staging(self, register):
        """Register the stager under test (a factory returning the instance)."""
        register(self.name, lambda: self.stager)


class StagerTests:
    """Conformance tests for a :class:`tierstore.plugin.Stager`.

    Subclass it in a class named ``Test...`` and provide the fixture ``stager``: a fresh
    stager per test (the kit closes it)::

        class TestMyStager(StagerTests):
            @pytest.fixture
            def stager(self):
                return MyStager()

    Optional fixture: ``source_device`` (default ``"cpu"``), where the training tensors live;
    a GPU stager's test module may override it to ``"cuda"``.
    """

    #: name the async_save test registers the stager under (not one a plugin uses)
    staging_name: str = "conformance-stager"

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def stager(self) -> Stager:
        """The stager under test, fresh. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'stager' fixture: a constructed "
                    f"tierstore.plugin.Stager (see StagerTests)")

    @pytest.fixture
    def source_device(self) -> str:
        """Device of the training tensors handed to ``stage``."""
        return "cpu"

    @pytest.fixture
    def staged_once(self, stager, source_device):
        """``(stager, original state dict, snapshot of it, staged copy)``; closes the stager."""
        sd = self.on_device(make_training_state(1), source_device)
        snapshot = self.snapshot(sd)
        staged = stager.stage(sd)
        yield stager, sd, snapshot, staged
        stager.close()

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def on_device(sd: Any, device: str) -> Any:
        """``sd`` with every tensor moved to ``device`` (layout kept: views stay views)."""
        if device == "cpu":
            return sd
        if isinstance(sd, torch.Tensor):
            return sd.to(device)
        if isinstance(sd, dict):
            return {k: StagerTests.on_device(v, device) for k, v in sd.items()}
        if isinstance(sd, (list, tuple)):
            return type(sd)(StagerTests.on_device(v, device) for v in sd)
        return sd

    @staticmethod
    def snapshot(sd: Any) -> Any:
        """A deep copy of ``sd`` on the CPU, to compare with later."""
        return copy.deepcopy(StagerTests._to_cpu(sd))

    @staticmethod
    def _to_cpu(sd: Any) -> Any:
        """``sd`` with every tensor on the CPU (CPU tensors are not copied)."""
        if isinstance(sd, torch.Tensor):
            return sd.cpu()
        if isinstance(sd, dict):
            return {k: StagerTests._to_cpu(v) for k, v in sd.items()}
        if isinstance(sd, (list, tuple)):
            return type(sd)(StagerTests._to_cpu(v) for v in sd)
        return sd

    # -- tests ---------------------------------------------------------------------------------
    def test_options_are_declared_with_descriptions(self, stager):
        """``options`` is a tuple of Option, each described, defaults passing their checks."""
        assert isinstance(stager, Stager), f"{type(stager).__name__} does not subclass Stager"
        assert_options_declared(type(stager))
        stager.close()

    def test_staged_copy_is_on_the_host_and_equal(self, staged_once):
        """Same structure and values (tensors bit for bit, dtypes, shapes), tensors on the CPU."""
        _, _, snapshot, staged = staged_once
        assert_trees_equal(staged, snapshot, "staged")
        for where, t in _tensors(staged, "staged"):
            assert t.device.type == "cpu", f"{where} is on {t.device}, not on the host"

    def test_staging_leaves_the_input_alone(self, staged_once):
        """stage() does not change the training state dict."""
        _, sd, snapshot, _ = staged_once
        assert_trees_equal(self._to_cpu(sd), snapshot, "input after stage")

    def test_staged_copy_does_not_follow_training(self, staged_once):
        """Updating every tensor in place, plain values, lists, dicts and the BytesIO after
        stage() leaves the staged copy as it was."""
        _, sd, snapshot, staged = staged_once
        mutate_in_place(sd)
        with pytest.raises(AssertionError):  # the update really changed the originals
            assert_trees_equal(self._to_cpu(sd), snapshot)
        assert_trees_equal(staged, snapshot, "staged after training went on")

    def test_second_stage_reflects_the_new_values(self, staged_once):
        """A later stage() of the updated state dict returns the new values."""
        stager, sd, _, _ = staged_once
        mutate_in_place(sd)
        want = self.snapshot(sd)
        staged = stager.stage(sd)
        assert_trees_equal(staged, want, "second stage")
        mutate_in_place(sd)
        assert_trees_equal(staged, want, "second stage after training went on")

    @pytest.mark.parametrize("change", ["shape", "dtype", "key added", "key removed"])
    def test_layout_change_between_stages(self, staged_once, source_device, change):
        """A tensor changing shape or dtype, or a key coming or going, is staged correctly."""
        stager, sd, _, _ = staged_once
        if change == "shape":
            sd["model"]["w"] = torch.randn(300, 7).to(source_device)
        elif change == "dtype":
            sd["model"]["w"] = sd["model"]["w"].to(torch.float64)
        elif change == "key added":
            sd["model"]["new"] = torch.randn(5).to(source_device)
        else:
            del sd["model"]["b"]
        want = self.snapshot(sd)
        assert_trees_equal(stager.stage(sd), want, f"staged after {change}")

    def test_reported_bytes_and_reuse(self, staged_once):
        """last_bytes is None or covers every tensor's bytes; the first stage cannot have
        reused buffers (last_reused None or False); both are reported again on the next stage."""
        stager, sd, snapshot, _ = staged_once
        total = tensor_bytes(snapshot)
        for when in ("first stage", "second stage"):
            if when == "second stage":
                stager.stage(sd)
            nbytes = stager.last_bytes
            assert nbytes is None or (isinstance(nbytes, int) and not isinstance(nbytes, bool)), \
                f"{when}: last_bytes is {nbytes!r}, not None or an int"
            assert nbytes is None or nbytes >= total, \
                f"{when}: last_bytes {nbytes} is less than the {total} bytes of tensors staged"
            assert stager.last_reused in (None, True, False), \
                f"{when}: last_reused is {stager.last_reused!r}, not None or a bool"
            if when == "first stage":
                assert stager.last_reused in (None, False), \
                    "last_reused is True after the first stage: there was nothing to reuse"

    def test_a_started_job_holds_the_state_of_the_call(self, stager, source_device):
        """``start()`` (what the core calls) returns a StagingJob; run, its result equals the
        state at the call, and once ``fence()`` has returned, training may change every tensor
        without reaching it (a lazy stager's copy ends after the call, an eager one's before)."""
        sd = self.on_device(make_training_state(3), source_device)
        want = self.snapshot(sd)
        job = stager.start(sd, _no_spill)
        assert isinstance(job, StagingJob), \
            f"start() returned a {type(job).__name__}, not a tierstore.plugin.StagingJob"
        job.run()
        job.fence(timeout=60)
        assert job.copied or job.fenced, \
            "fence() returned before every value was taken, and ordered nothing after the copies"
        mutate_in_place(sd)
        assert_trees_equal(job.result(timeout=60), want, "the started job's tree")
        stager.close()

    def test_close_is_safe_to_repeat(self, stager, source_device):
        """close() before any stage, after one, and twice in a row does not raise."""
        stager.close()
        sd = self.on_device(make_training_state(2), source_device)
        want = self.snapshot(sd)
        assert_trees_equal(stager.stage(sd), want)
        stager.close()
        stager.close()

    def test_async_save_through_a_store(self, tmp_path, stager):
        """dcp.async_save through a store using the stager saves the state as it was at the
        call, even as training updates the tensors before the save ends (once the staging is
        over: when async_save returns, or, for a lazy stager, at its staging_completion)."""
        config = {"store": {"staging": self.staging_name},
                  "tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "t")}]}
        sd = make_state_dict(4)
        want = copy.deepcopy(sd)
        with tierstore.open(config, plugins=[_StagerPlugin(self.staging_name, stager)]) as store:
            resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
            if stager.lazy:
                assert hasattr(resp, "staging_completion"), \
                    "a lazy stager's async_save did not return DCP's AsyncSaveResponse"
                resp.staging_completion.result()
            sd["model"]["embed.weight"].add_(1.0)
            sd["optim"]["counts"].zero_()
            getattr(resp, "upload_completion", resp).result()
            store.wait()
            loaded = _empty_like(want)
            dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-1")
        assert_state_dicts_equal(loaded, want)


def _no_spill() -> Any:
    raise AssertionError("the stager asked for a spill, which the kit only gives to a stager "
                         "with a memory budget smaller than the state dict")
