"""Staging from CUDA tensors (``make gpu-test``; skipped where CUDA is not available, as in CI):
pinned host buffers, device-to-host copies on a side stream ordered by events, the lazy staging's
optimizer hook ordering the training stream after the copies instead of blocking the host, and
budgeted waves from the device. Every checkpoint is compared bit for bit with the state of its
call, and no save may synchronize the device or a stream."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from recording import Recorder

import tierstore
from tierstore import EventKind

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def config(tmp_path, staging: dict) -> dict:
    return {"store": {"staging": staging},
            "tier": [{"name": "ram", "backend": "memory", "path": str(tmp_path / "ram"),
                      "keep": 2}]}


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def to_host(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_host(v) for v in tree)
    return copy.deepcopy(tree)


def assert_equal_on_host(got, want, path=""):
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got.cpu(), want.cpu()), path
    elif isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            assert_equal_on_host(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            assert_equal_on_host(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def load(store, checkpoint_id, like):
    out = copy.deepcopy(like)
    dcp.load(out, storage_reader=store.reader(), checkpoint_id=checkpoint_id)
    return out


@pytest.fixture
def no_device_sync(monkeypatch):
    """Fails the test on any device-wide or stream synchronize (an event's is allowed)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("device"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize",
                        lambda self: calls.append(f"stream {self}"))
    return calls


def train_and_save(store, model, opt, steps: int, lazy: bool):
    """Steps with a save after each; returns {step: host copy of the state at its call}."""
    snapshots, responses = {}, []
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
        opt.step()
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        snapshots[step] = to_host(sd)
        resp = dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}")
        responses.append(getattr(resp, "upload_completion", resp))
    for fut in responses:
        fut.result()
    return snapshots


@pytest.mark.parametrize("staging", ["cpu", "pinned"])
def test_eager_staging_from_cuda_uses_pinned_buffers_and_round_trips(tmp_path, staging):
    model, opt = model_and_optimizer()
    with tierstore.open(config(tmp_path, {"name": staging})) as store:
        snapshots = train_and_save(store, model, opt, 3, lazy=False)
        assert store._stager.pinned
        got = load(store, "step-2", {"model": model.state_dict(), "optim": opt.state_dict()})
        assert_equal_on_host(to_host(got), snapshots[2])


def test_lazy_staging_with_the_hook_orders_the_training_stream_and_never_syncs(
        tmp_path, no_device_sync):
    model, opt = model_and_optimizer()
    rec = Recorder()
    with tierstore.open(config(tmp_path, {"name": "pinned", "lazy": True}),
                        plugins=[rec]) as store:
        store.hook_optimizer(opt)
        snapshots = train_and_save(store, model, opt, 4, lazy=True)
        assert no_device_sync == [], no_device_sync
        for step in (2, 3):
            got = load(store, f"step-{step}", {"model": model.state_dict(),
                                                 "optim": opt.state_dict()})
            assert_equal_on_host(to_host(got), snapshots[step])
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert all(e.detail["lazy"] for e in staged)


@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "eager"])
def test_budgeted_staging_from_cuda_goes_in_waves_and_round_trips(tmp_path, lazy):
    model, opt = model_and_optimizer()
    total = sum(p.numel() * 4 for p in model.parameters()) * 3
    rec = Recorder()
    staging = {"name": "pinned", "lazy": lazy, "max_staging_bytes": total // 4}
    with tierstore.open(config(tmp_path, staging), plugins=[rec]) as store:
        store.hook_optimizer(opt)
        snapshots = train_and_save(store, model, opt, 3, lazy=lazy)
        got = load(store, "step-2", {"model": model.state_dict(), "optim": opt.state_dict()})
        assert_equal_on_host(to_host(got), snapshots[2])
        staged = [e for e in rec.events if e.kind == EventKind.STAGED]
        assert all(e.detail["waves"] > 1 for e in staged)
        assert all(e.detail["buffer_bytes"] <= total // 4 + 4096 * 1024 * 4 for e in staged)
