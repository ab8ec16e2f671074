"""The backend on docs/plugins.md works as the page gives it: a newcomer who copies it gets a
backend that passes the conformance kit and saves and loads with the default settings.

The page's code blocks are the test's input, found by the marker comment before each
(``<!-- example: backend -->``, ``<!-- example: backend tests -->``) and written where their first
line says (``# my_company/tierstore_dir.py``); the entry point and the tier come from the page's
TOML blocks. Nothing here adds to what the page shows, so a page that drifts from the code fails
here. The example uses only names the page explains outside its code, and every code line fits
the docs site (80 characters).

Also here: which commit protocol a backend gets when its class names none
(``Backend.default_commit``), and that each backend shipped with tierstore keeps the one it had.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierstore
from tierstore.plugin import Backend
from tierstore_conformance import assert_state_dicts_equal, make_state_dict
from tierstore_conformance.roundtrip import _empty_like

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "plugins.md"
BACKEND_MARKER = "<!-- example: backend -->"
TESTS_MARKER = "<!-- example: backend tests -->"
#: the widest code line the docs site shows whole
SITE_WIDTH = 80

_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)


def page_text() -> str:
    return PAGE.read_text()


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(offset, language, code) of every fenced block on the page, indentation removed."""
    out = []
    for m in _FENCE.finditer(text):
        indent = len(m.group(1))
        code = "".join(line[indent:] for line in m.group(3).splitlines(keepends=True))
        out.append((m.start(), m.group(2), code))
    return out


def block_after(text: str, marker: str) -> str:
    """The code of the first fenced block after ``marker``."""
    at = text.find(marker)
    assert at >= 0, f"{PAGE.name} has no {marker!r} before its example"
    following = [code for start, _, code in code_blocks(text) if start > at]
    assert following, f"no code block follows {marker!r} on {PAGE.name}"
    return following[0]


def written_to(code: str) -> str:
    """The path a block says it is (its first line, ``# my_company/tierstore_dir.py``)."""
    first = code.splitlines()[0]
    assert first.startswith("# ") and first.endswith(".py"), \
        f"the example's first line should name its file, not {first!r}"
    return first[2:].strip()


def toml_block_with(text: str, needle: str) -> dict:
    """The first TOML block on the page holding ``needle``, parsed."""
    for _, lang, code in code_blocks(text):
        if lang == "toml" and needle in code:
            return tomllib.loads(code)
    raise AssertionError(f"no TOML block on {PAGE.name} holds {needle!r}")


@pytest.fixture
def page_package(tmp_path, monkeypatch):
    """The page's backend module and its test module, written where they say, on sys.path;
    returns (module name, directory). The module is forgotten afterwards (its files go)."""
    text = page_text()
    backend_code = block_after(text, BACKEND_MARKER)
    module_file = written_to(backend_code)
    tests_code = block_after(text, TESTS_MARKER)
    for rel, code in ((module_file, backend_code), (written_to(tests_code), tests_code)):
        target = tmp_path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(code)
    package = Path(module_file).parent
    if package != Path("."):
        (tmp_path / package / "__init__.py").touch()
    module = module_file[:-len(".py")].replace("/", ".")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, tmp_path
    top = module.split(".")[0]
    for name in [n for n in sys.modules if n == top or n.startswith(f"{top}.")]:
        del sys.modules[name]


def test_every_code_line_on_the_page_fits_the_site():
    """The docs site cuts code lines longer than 80 characters."""
    long = [(lang, line) for _, lang, code in code_blocks(page_text())
            for line in code.splitlines() if len(line) > SITE_WIDTH]
    assert long == [], f"code lines over {SITE_WIDTH} characters on {PAGE.name}: {long}"


def test_the_example_backend_uses_only_names_the_page_explains():
    """Every name the example takes from tierstore, and every method or attribute it
    defines or uses on its backend (its own ``_private`` helpers aside), is named in the
    page's text outside the code."""
    text = page_text()
    code = block_after(text, BACKEND_MARKER)
    prose = _FENCE.sub("", text)
    explained = {word for span in re.findall(r"`([^`\n]+)`", prose)
                 for word in re.findall(r"[A-Za-z_]\w*", span)}
    tree = ast.parse(code)
    used: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierstore"):
            used.update(alias.name for alias in node.names)
        elif isinstance(node, ast.FunctionDef):  # the hook
            used.add(node.name)
        elif isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and b.id == "Backend" for b in node.bases):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    used.add(item.name)
                elif isinstance(item, ast.Assign):
                    used.update(t.id for t in item.targets if isinstance(t, ast.Name))
            used.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id == "self")
    used = {n for n in used if not n.startswith("_") or n == "__init__"}
    # The constructor is explained as "the constructor" with its call.
    used.discard("__init__")
    assert "Backend" in used and "check_reachable" in used, used  # the parse found the class
    assert used - explained == set(), \
        f"the example uses names its page does not explain: {sorted(used - explained)}"


def test_the_example_backend_names_no_commit_protocol_and_has_no_rename():
    """The example is the backend the issue was about: seven primitives, no rename, no
    ``default_commit``; the core gives it ``manifest-last``."""
    code = block_after(page_text(), BACKEND_MARKER)
    for name in ("default_commit", "supports_rename", "def rename", "local_path"):
        assert name not in code, f"the example should not need {name!r}"


def test_the_example_backend_passes_the_conformance_kit_as_the_page_runs_it(page_package):
    """The page's own test module for the example (BackendTests and RoundTripTests) run by
    pytest, as its author would: every test ran, none failed or was skipped."""
    _, directory = page_package
    tests_file = written_to(block_after(page_text(), TESTS_MARKER))
    report = directory / "report.xml"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"--junitxml={report}", "--rootdir", str(directory), tests_file],
        cwd=directory, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)})
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    suite = ET.parse(report).getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] > 40 and counts["failures"] == counts["errors"] == 0, counts
    assert counts["skipped"] == 0, counts
    classes = {case.get("classname").rsplit(".", 1)[-1] for case in suite.iter("testcase")}
    assert classes == {"TestDirBackend", "TestDirRoundTrip"}, classes


def test_the_example_backend_saves_and_loads_with_the_default_settings(page_package,
                                                                       tmp_path, monkeypatch):
    """Registered by the entry point the page gives (an installed distribution's metadata),
    used by the page's tier with no ``[store] commit``: saves (one of them over an existing
    id), a load, bytes equal; the checkpoint on disk was committed with ``manifest-last``."""
    module, directory = page_package
    text = page_text()
    entry_points = toml_block_with(text, f'"{module}"')
    group = entry_points["project"]["entry-points"]["tierstore"]
    assert module in group.values(), f"the page's entry point {group} does not name {module}"
    info = directory / "my-company-tierstore-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-company-tierstore\n"
                                   "Version: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in group.items())
    (info / "entry_points.txt").write_text(f"[tierstore]\n{lines}")
    monkeypatch.syspath_prepend(str(directory))

    tier = toml_block_with(text, "[[tier]]")["tier"][0]
    tier["path"] = str(tmp_path / "disk")
    config = {"store": {"overwrite": True}, "tier": [tier]}
    assert "commit" not in config["store"]

    sd = make_state_dict(3)
    want = copy.deepcopy(sd)
    with tierstore.open(config) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-2")  # over it
        loaded = _empty_like(want)
        dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-2")
        assert sorted(c.id for c in store.list()) == ["step-1", "step-2"]
    assert_state_dicts_equal(loaded, want)
    for fqn, value in want.items():
        if isinstance(value, torch.Tensor):
            got = loaded[fqn]
            assert got.dtype == value.dtype and got.shape == value.shape, fqn
            assert (got.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    == value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()), fqn

    manifest = json.loads((tmp_path / "disk" / "step-2" / "tierstore.json").read_text())
    assert manifest["plugins"]["backend"] == tier["backend"]
    assert manifest["plugins"]["commit"] == "manifest-last", manifest["plugins"]


# -- which commit protocol a backend gets -----------------------------------------------------

class _Primitives(Backend):
    """The seven primitives, doing nothing: enough to build one."""

    def __init__(self, root: str = "") -> None:
        self.root = root

    def check_reachable(self): return None
    def open_write(self, path): raise NotImplementedError
    def open_read(self, path): raise FileNotFoundError(path)
    def size(self, path): return None
    def list(self, path): return []
    def makedirs(self, path): pass
    def delete(self, path): pass


class _WithRename(_Primitives):
    supports_rename = True


class _RenameFromOptions(_Primitives):
    """One class for storage with and without rename, decided per instance."""

    def __init__(self, root: str = "", rename: bool = False) -> None:
        super().__init__(root)
        self.supports_rename = rename


class _Named(_Primitives):
    default_commit = "my-commit"


class _NamedBelow(_Named):
    supports_rename = True


class _NamedAtomicWithoutRename(_WithRename):
    default_commit = "atomic"


class _ThenNoRename(_NamedAtomicWithoutRename):
    supports_rename = False


@pytest.mark.parametrize("cls, kwargs, expected", [
    (_Primitives, {}, "manifest-last"),
    (_WithRename, {}, "atomic"),
    (_RenameFromOptions, {"rename": True}, "atomic"),
    (_RenameFromOptions, {"rename": False}, "manifest-last"),
    (_Named, {}, "my-commit"),
    (_NamedBelow, {}, "my-commit"),
    (_ThenNoRename, {}, "atomic"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_a_backend_that_names_no_commit_protocol_gets_the_one_it_can_run(cls, kwargs,
                                                                          expected):
    """Named (by the class or a base below ``Backend``): kept, whatever ``supports_rename``
    says. Not named: ``atomic`` with rename, ``manifest-last`` without, following the
    instance where it sets ``supports_rename`` itself."""
    backend = cls(**kwargs)
    assert backend.default_commit == expected
    if cls is not _RenameFromOptions:
        assert cls.default_commit == expected
    backend.default_commit = "set-on-the-instance"
    assert backend.default_commit == "set-on-the-instance"


def test_the_backends_shipped_keep_their_commit_protocols():
    """Each built-in backend and the example plugin's get the protocol they always had."""
    from tierstore_plugins.fsspec_backend import FsspecBackend
    from tierstore_plugins.local import LocalBackend, MemoryBackend
    from tierstore_plugins.obstore_backend import ObstoreBackend
    from tierstore_plugins.peer import PeerBackend
    sys.path.insert(0, str(ROOT / "examples" / "tierstore-example-plugin"))
    try:
        from tierstore_example.backend import ExampleDirBackend
    finally:
        sys.path.remove(str(ROOT / "examples" / "tierstore-example-plugin"))
    got = {cls.__name__: (cls.default_commit, cls.supports_rename) for cls in (
        LocalBackend, MemoryBackend, PeerBackend, FsspecBackend, ObstoreBackend,
        ExampleDirBackend)}
    assert got == {"LocalBackend": ("atomic", True), "MemoryBackend": ("atomic", True),
                   "PeerBackend": ("atomic", True),
                   "FsspecBackend": ("manifest-last", False),
                   "ObstoreBackend": ("manifest-last", False),
                   "ExampleDirBackend": ("atomic", True)}
