"""The plugin system: built-ins, entry points, [store] plugins; and the PluginErrors a plugin
author sees, each naming the plugin and where it came from."""

from __future__ import annotations

import inspect
import logging
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from recording import Recorder
from tierstore import PluginError, hookspecs
from tierstore.events import EventKind, Phase


def tier(tmp_path, **extra):
    return {"name": "nvme", "backend": "local", "path": str(tmp_path / "nvme"), **extra}


def write_module(tmp_path, monkeypatch, name, source):
    """An importable plugin module named ``name`` on sys.path."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def write_distribution(tmp_path, monkeypatch, dist, entry_points):
    """An installed distribution (a .dist-info on sys.path) with a `tierstore` entry point."""
    info = tmp_path / f"{dist}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[tierstore]\n{lines}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


THIRD_PARTY_BACKEND = """
    import tierstore
    from tierstore_plugins.local import LocalBackend

    class FancyBackend(LocalBackend):
        '''A local directory under another name.'''

    @tierstore.hookimpl
    def tierstore_register_backends(register):
        register("fancy", FancyBackend)
    """


def test_store_plugins_key_adds_a_backend_a_config_can_use(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_fancy", THIRD_PARTY_BACKEND)
    config = {"store": {"plugins": [module]}, "tier": [tier(tmp_path, backend="fancy")]}
    sd = {"w": torch.randn(10, 10)}
    with tierstore.open(config) as store:
        reg = store._ctx.host.lookup("backend", "fancy")
        assert reg.plugin == "acme_fancy" and "[store] plugins" in reg.origin
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        out = {"w": torch.zeros(10, 10)}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-1")
    assert torch.equal(out["w"], sd["w"])
    manifest = (tmp_path / "nvme" / "step-1" / "tierstore.json").read_text()
    assert '"backend": "fancy"' in manifest


#: A backend written from docs/plugins.md alone: the constructor the page gives, its own
#: ``path`` option, the seven primitives, and nothing else (no rename, no default_commit).
PAGE_BACKEND = """
    import os
    import shutil

    from tierstore.plugin import Backend, Option, hookimpl

    class PlainDirBackend(Backend):
        '''A directory, without rename.'''

        options = (Option("path", str, required=True, expand=True, description="where"),)

        def __init__(self, root, path):
            self.root = path

        def _abs(self, path):
            return os.path.join(self.root, path) if path else self.root

        def check_reachable(self):
            return None

        def open_write(self, path):
            return open(self._abs(path), "wb")

        def open_read(self, path):
            return open(self._abs(path), "rb")

        def size(self, path):
            full = self._abs(path)
            return os.path.getsize(full) if os.path.isfile(full) else None

        def list(self, path):
            full = self._abs(path)
            return sorted(os.listdir(full)) if os.path.isdir(full) else []

        def makedirs(self, path):
            os.makedirs(self._abs(path), exist_ok=True)

        def delete(self, path):
            full = self._abs(path)
            if os.path.isdir(full):
                shutil.rmtree(full)
            elif os.path.lexists(full):
                os.unlink(full)

    @hookimpl
    def tierstore_register_backends(register):
        register("plaindir", PlainDirBackend)
    """


def test_a_backend_written_from_the_page_saves_and_loads_with_the_default_settings(
        tmp_path, monkeypatch):
    """A backend without rename that names no commit protocol gets ``manifest-last`` (the one
    it can run; ``atomic`` needs rename), so the defaults work: saves, an overwrite and loads."""
    module = write_module(tmp_path, monkeypatch, "acme_plain", PAGE_BACKEND)
    config = {"store": {"plugins": [module], "overwrite": True},
              "tier": [tier(tmp_path, backend="plaindir")]}
    with tierstore.open(config) as store:
        backend = store._ctx.tiers.named("nvme").backend
        assert type(backend).default_commit == "manifest-last"
        for step in (1, 2, 2):
            sd = {"w": torch.randn(64, 64), "step": step}
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id=f"step-{step}")
        out = {"w": torch.zeros(64, 64), "step": 0}
        dcp.load(out, storage_reader=store.reader(), checkpoint_id="step-2")
        assert sorted(c.id for c in store.list()) == ["step-1", "step-2"]
    assert torch.equal(out["w"], sd["w"]) and out["step"] == 2


def test_entry_point_plugins_are_found(tmp_path, monkeypatch):
    write_module(tmp_path, monkeypatch, "acme_ep", THIRD_PARTY_BACKEND)
    write_distribution(tmp_path, monkeypatch, "acme-tierstore", {"acme": "acme_ep"})
    with tierstore.open({"tier": [tier(tmp_path, backend="fancy")]}) as store:
        reg = store._ctx.host.lookup("backend", "fancy")
        assert reg.plugin == "acme"
        assert "entry point 'acme = acme_ep' of distribution acme-tierstore 1.2.3" in reg.origin


def test_broken_entry_point_names_the_distribution(tmp_path, monkeypatch):
    write_distribution(tmp_path, monkeypatch, "broken-ext", {"broken": "no_such_module_xyz"})
    with pytest.raises(PluginError) as info:
        tierstore.open({"tier": [tier(tmp_path)]})
    msg = str(info.value)
    assert "plugin 'broken'" in msg and "distribution broken-ext 1.2.3" in msg
    assert "failed to load" in msg and "No module named 'no_such_module_xyz'" in msg


def test_duplicate_name_names_both_plugins(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_dup", """
        import tierstore
        from tierstore_plugins.local import LocalBackend

        @tierstore.hookimpl
        def tierstore_register_backends(register):
            register("local", LocalBackend)
        """)
    with pytest.raises(PluginError) as info:
        tierstore.open({"store": {"plugins": [module]}, "tier": [tier(tmp_path)]})
    msg = str(info.value)
    assert "backend 'local' is registered twice" in msg
    assert "by plugin 'tierstore_plugins.local' (built-in)" in msg
    assert "by plugin 'acme_dup' ([store] plugins in <dict>)" in msg


def test_bad_hook_signature_names_plugin_and_hook(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_badsig", """
        import tierstore

        @tierstore.hookimpl
        def tierstore_register_backends(register, flavour):
            pass
        """)
    with pytest.raises(PluginError) as info:
        tierstore.open({"store": {"plugins": [module]}, "tier": [tier(tmp_path)]})
    msg = str(info.value)
    assert "plugin 'acme_badsig' ([store] plugins in <dict>) has a bad hook" in msg
    assert "tierstore_register_backends" in msg and "flavour" in msg
    assert "tierstore/hookspecs.py" in msg


def test_misspelled_hook_lists_the_real_ones(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_typo", """
        import tierstore

        @tierstore.hookimpl
        def tierstore_register_backend(register):
            pass
        """)
    with pytest.raises(PluginError) as info:
        tierstore.open({"store": {"plugins": [module]}, "tier": [tier(tmp_path)]})
    msg = str(info.value)
    assert "plugin 'acme_typo'" in msg and "tierstore_register_backend" in msg
    assert "tierstore_register_backends" in msg  # the list of valid hooks


def test_missing_plugin_module(tmp_path):
    with pytest.raises(PluginError) as info:
        tierstore.open({"store": {"plugins": ["acme_not_installed"]}, "tier": [tier(tmp_path)]})
    msg = str(info.value)
    assert "plugin module 'acme_not_installed' ([store] plugins in <dict>) failed to import" in msg
    assert "python -c 'import acme_not_installed'" in msg


def test_factory_of_the_wrong_kind(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_wrongkind", """
        import tierstore

        class NotABackend:
            pass

        @tierstore.hookimpl
        def tierstore_register_backends(register):
            register("odd", NotABackend)
        """)
    with pytest.raises(PluginError) as info:
        tierstore.open({"store": {"plugins": [module]}, "tier": [tier(tmp_path)]})
    msg = str(info.value)
    assert "plugin 'acme_wrongkind'" in msg and "registered backend 'odd' as NotABackend" in msg
    assert "does not subclass tierstore.plugin.Backend" in msg


def test_registration_hook_that_raises(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_raises", """
        import tierstore

        @tierstore.hookimpl
        def tierstore_register_codecs(register):
            raise RuntimeError("zstd library too old")
        """)
    with pytest.raises(PluginError, match=r"plugin 'acme_raises' .* failed in "
                                          r"tierstore_register_codecs: RuntimeError: zstd library too old"):
        tierstore.open({"store": {"plugins": [module]}, "tier": [tier(tmp_path)]})


def test_no_global_plugin_manager(tmp_path, monkeypatch):
    module = write_module(tmp_path, monkeypatch, "acme_iso", THIRD_PARTY_BACKEND)
    with tierstore.open({"store": {"plugins": [module]}, "tier": [tier(tmp_path)]}) as a, \
            tierstore.open({"tier": [tier(tmp_path)]}) as b:
        assert a._ctx.host.pm is not b._ctx.host.pm
        assert "fancy" in a._ctx.host.names("backend")
        assert "fancy" not in b._ctx.host.names("backend")


def test_observers_see_phases_in_order_and_events_with_timings(tmp_path):
    rec = Recorder()
    with tierstore.open({"tier": [tier(tmp_path, keep=1)]}, plugins=[rec]) as store:
        for step in (1, 2):
            dcp.save({"w": torch.randn(100, 100)}, storage_writer=store.writer(),
                     checkpoint_id=f"step-{step}")
        dcp.load({"w": torch.zeros(100, 100)}, storage_reader=store.reader(), checkpoint_id="step-2")
    names = [p for p, cid, _, _ in rec.phases if cid == "step-1"]
    assert names[0] == Phase.SAVE_BEGIN and Phase.WRITE_FILE in names
    assert names.index(Phase.WRITE_METADATA) < names.index(Phase.WRITE_MANIFEST) \
        < names.index(Phase.PUBLISH)
    kinds = [e.kind for e in rec.events]
    assert kinds.count(EventKind.COMMITTED) == 2
    assert [e.checkpoint_id for e in rec.events if e.kind == EventKind.EVICTED] == ["step-1"]
    committed = next(e for e in rec.events if e.kind == EventKind.COMMITTED)
    assert committed.tier == "nvme" and committed.seconds > 0 and committed.nbytes > 40_000
    written = [e for e in rec.events if e.kind == EventKind.WRITTEN]
    assert written and all(e.detail["file"].endswith(".distcp") for e in written)
    assert any(e.kind == EventKind.LOADED and e.nbytes >= 40_000 for e in rec.events)


def test_a_failing_observer_never_breaks_a_save(tmp_path, caplog):
    class Broken:
        @tierstore.hookimpl
        def tierstore_event(self, event):
            raise ValueError("observer bug")

    with tierstore.open({"tier": [tier(tmp_path)]}, plugins=[Broken()]) as store:
        with caplog.at_level(logging.ERROR, logger="tierstore"):
            dcp.save({"w": torch.ones(3)}, storage_writer=store.writer(), checkpoint_id="step-1")
        assert store.latest() == "step-1"
    assert "observer" in caplog.text and "observer bug" in caplog.text


def test_every_hook_is_documented():
    hooks = [(n, f) for n, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if n.startswith("tierstore_")]
    assert len(hooks) >= 9
    for name, fn in hooks:
        doc = " ".join((fn.__doc__ or "").split())
        assert "Called" in doc, f"{name}: say when it is called"
        assert "rank" in doc, f"{name}: say on which ranks"
        assert "Returns" in doc, f"{name}: say what it returns"
        assert "firstresult" in doc, f"{name}: say whether it is firstresult"
