"""The example third-party plugin (examples/tierstore-example-plugin) is installed in the test
environment, discovered through its entry point alone, usable from a plain config, and passes
its own conformance tests (run here in a subprocess, as its author would run them).

`make test` installs it (``pip install -e examples/tierstore-example-plugin``)."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

# Detailed assertion messages from the kit's own asserts (possible only before its import).
if "tierstore_conformance" not in sys.modules:
    pytest.register_assert_rewrite("tierstore_conformance")

import tierstore
from tierstore_conformance import assert_state_dicts_equal, make_state_dict
from tierstore_conformance.roundtrip import _empty_like

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tierstore-example-plugin"
DIST = "tierstore-example-plugin"
INSTALL_HINT = f"install it: {sys.executable} -m pip install -e {EXAMPLE.relative_to(ROOT)}"


def test_the_example_is_installed_from_this_checkout_with_its_entry_point():
    """The distribution is installed, its ``tierstore`` entry point names the module, and the
    module imported is this checkout's (an editable install)."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise AssertionError(f"{DIST} is not installed; {INSTALL_HINT}") from None
    eps = {ep.name: ep.value for ep in dist.entry_points if ep.group == "tierstore"}
    assert eps == {"example": "tierstore_example"}, eps
    import tierstore_example
    assert Path(tierstore_example.__file__).resolve().is_relative_to(EXAMPLE), \
        f"tierstore_example comes from {tierstore_example.__file__}, not {EXAMPLE}; {INSTALL_HINT}"


def test_tierstore_plugins_lists_them_with_their_entry_point():
    """``tierstore plugins`` shows the example backend and codec, found by the entry point."""
    out = subprocess.run([sys.executable, "-m", "tierstore.cli", "plugins"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("    ")}
    origin = f"entry point 'example = tierstore_example' of distribution {DIST} 0.1.0"
    for name in ("example-dir", "example-zlib"):
        assert name in lines, f"{name} not listed by `tierstore plugins`:\n{out.stdout}"
        assert origin in lines[name], lines[name]


def test_a_plain_config_uses_the_example_backend_and_codec(tmp_path):
    """No ``plugins=`` and no ``[store] plugins``: a config naming ``example-dir`` and
    ``example-zlib`` saves and loads bit for bit, and the files on disk carry the codec."""
    config = {"tier": [{"name": "disk", "backend": "example-dir", "path": str(tmp_path / "d"),
                        "codecs": [{"name": "example-zlib", "level": 3}]}]}
    sd = make_state_dict(5)
    want = copy.deepcopy(sd)
    with tierstore.open(config) as store:
        dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        loaded = _empty_like(want)
        dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-1")
    assert_state_dicts_equal(loaded, want)

    checkpoint = tmp_path / "d" / "step-1"
    manifest = json.loads((checkpoint / "tierstore.json").read_text())
    assert manifest["plugins"]["backend"] == "example-dir", manifest["plugins"]
    assert len(manifest["codecs"]) == 1 and "example-zlib" in json.dumps(manifest["codecs"])
    metadata = FileSystemReader(str(checkpoint)).read_metadata()
    descriptors = {tuple(info.transform_descriptors or ())
                   for info in metadata.storage_data.values()}
    assert descriptors == {("stream.zlib@tierstore-example/1",)}, descriptors


def test_the_example_passes_its_conformance_tests(tmp_path):
    """The example's own test module (subclasses of the backend, round-trip and codec kits)
    passes in a subprocess: every class ran, nothing failed or was skipped."""
    report = tmp_path / "report.xml"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         "tests/test_conformance.py"],
        cwd=EXAMPLE, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    suite = ET.parse(report).getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] > 0 and counts["failures"] == counts["errors"] == 0, counts
    assert counts["skipped"] == 0, counts
    classes = {case.get("classname").rsplit(".", 1)[-1] for case in suite.iter("testcase")}
    assert classes == {"TestExampleDirBackend", "TestExampleDirRoundTrip",
                       "TestExampleZlibRoundTrip", "TestExampleZlibCodec"}, classes
