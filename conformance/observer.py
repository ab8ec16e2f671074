"""``ObserverTests``: what an observer (a plugin implementing the ``tierstore_event`` hook) must
do: take every event the engine emits without raising, from any thread, and keep working
through real saves and loads.

The core promises that a failing observer never fails a save (it logs the exception and goes
on); the kit checks that promise too, with a raising observer beside yours.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.plugin import Event, EventKind, hookimpl

from .roundtrip import _empty_like, assert_state_dicts_equal, make_state_dict

__all__ = ["ObserverTests"]

#: typical ``detail`` of each event kind (the engine's keys; observers may read them)
_DETAILS: dict[str, dict[str, Any]] = {
    EventKind.WRITTEN: {"file": "__0_0.distcp"},
    EventKind.FELL_BACK: {"file": "__0_0.distcp"},
    EventKind.FAILED: {"error": "OSError: disk full"},
    EventKind.PEER_FETCHED: {"file": "__1_0.distcp", "from": 1},
    EventKind.REPAIRED: {"files": ["__0_0.distcp"], "source": "s3"},
}


class _Recorder:
    """Records the kinds of the events it gets (to prove events flowed)."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    @hookimpl
    def tierstore_event(self, event):
        """Record the event's kind."""
        self.kinds.append(event.kind)


class _Raising:
    """An observer that raises on every event."""

    @hookimpl
    def tierstore_event(self, event):
        """Fail."""
        raise RuntimeError(f"conformance: raising observer got {event.kind}")


def _logged_errors(caplog) -> list[str]:
    """Messages of errors the core logged (observer failures are logged, never raised)."""
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and r.name.startswith("tierstore")]


class ObserverTests:
    """Conformance tests for an observer: a plugin object or module with a
    ``@tierstore.hookimpl`` ``tierstore_event(event)``.

    Subclass it in a class named ``Test...`` and provide the fixture ``observer``, a fresh
    observer per test::

        class TestMyObserver(ObserverTests):
            @pytest.fixture
            def observer(self):
                return MyObserver()
    """

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def observer(self) -> Any:
        """The observer under test. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide an 'observer' fixture: a plugin object "
                    f"with a @tierstore.hookimpl tierstore_event(event) (see ObserverTests)")

    @pytest.fixture
    def store_config(self, tmp_path) -> dict[str, Any]:
        """One local tier in a fresh directory."""
        return {"tier": [{"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme")}]}

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def all_events(tier: str | None) -> list[Event]:
        """One event of every kind, zero seconds and bytes, on ``tier`` (or none)."""
        return [Event(kind=kind, checkpoint_id="step-1", tier=tier, rank=0, seconds=0.0,
                      nbytes=0, detail=dict(_DETAILS.get(kind, {}))) for kind in EventKind.ALL]

    @staticmethod
    def save_and_load(config: dict[str, Any], plugins: list[Any]) -> list[str]:
        """dcp.save, dcp.async_save and dcp.load through a store with ``plugins``; checks what
        loads back and returns the kinds of the events the store emitted."""
        recorder = _Recorder()
        sd = make_state_dict(1)
        want = copy.deepcopy(sd)
        with tierstore.open(copy.deepcopy(config), plugins=[*plugins, recorder]) as store:
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
            dcp.async_save(sd, storage_writer=store.writer(), checkpoint_id="step-2").result()
            store.wait()
            for checkpoint_id in ("step-1", "step-2"):
                loaded = _empty_like(want)
                dcp.load(loaded, storage_reader=store.reader(), checkpoint_id=checkpoint_id)
                assert_state_dicts_equal(loaded, want, checkpoint_id)
        return recorder.kinds

    # -- tests ---------------------------------------------------------------------------------
    def test_tierstore_event_is_a_hook_implementation(self, observer):
        """tierstore_event exists and is marked with @tierstore.hookimpl (without the marker,
        pluggy never calls it and the observer silently sees nothing)."""
        impl = getattr(observer, "tierstore_event", None)
        assert callable(impl), f"{observer!r} has no tierstore_event method or function"
        assert getattr(impl, "tierstore_impl", None) is not None, \
            f"{observer!r}.tierstore_event is not marked with @tierstore.hookimpl"

    @pytest.mark.parametrize("tier", [None, "nvme"], ids=["no tier", "tier"])
    def test_every_event_kind_is_accepted(self, observer, tier):
        """Every EventKind.ALL event, zero seconds and bytes, with and without a tier, is
        taken without raising (the engine calls the hook by keyword, ``event=``)."""
        for event in self.all_events(tier):
            observer.tierstore_event(event=event)

    def test_events_from_many_threads(self, observer):
        """Events arrive from the engine's threads at once (drains, writers): no exception."""
        errors: list[BaseException] = []
        events = self.all_events("nvme") + self.all_events(None)

        def feed() -> None:
            try:
                for _ in range(50):
                    for event in events:
                        observer.tierstore_event(event=event)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=feed) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"observer raised from a thread: {errors[0]!r}"

    def test_works_through_real_saves_and_loads(self, observer, store_config, caplog):
        """A store opened with the observer saves and loads; the observer never failed on the
        events the store emitted (the core logs such failures)."""
        caplog.set_level(logging.ERROR, logger="tierstore")
        kinds = self.save_and_load(store_config, [observer])
        for kind in (EventKind.WRITTEN, EventKind.COMMITTED, EventKind.LOADED):
            assert kind in kinds, f"the store emitted no {kind!r} event ({sorted(set(kinds))})"
        assert _logged_errors(caplog) == []

    def test_a_raising_observer_beside_it_does_not_fail_the_save(self, observer, store_config,
                                                                 caplog):
        """Failure isolation (the core's promise): with an observer raising on every event
        before and after this one, saves and loads succeed and this observer still works."""
        caplog.set_level(logging.ERROR, logger="tierstore")
        self.save_and_load(store_config, [_Raising(), observer, _Raising()])
        failures = _logged_errors(caplog)
        assert failures, "the raising observer's failures were not logged"
        others = [message for message in failures if "_Raising" not in message]
        assert not others, f"errors logged for something else than the raising observer: " \
                           f"{others[:5]}"
