"""The core's structure, checked: layers (import-linter's contracts in pyproject.toml), no import
cycle among the core's modules, and a Store whose public names are the Contract's API."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

import tierstore

ROOT = Path(__file__).resolve().parent.parent

#: DESIGN.md, Contract, Python API
CONTRACT_API = {"writer", "reader", "latest", "list", "verify", "pin", "unpin", "gc", "wait",
                "pending", "stats", "preemption", "close", "process_group",
                # the operator tools: each command of `tierstore` is a Store method too
                "status", "inspect", "promote", "scrub", "export", "plan",
                # lazy staging: what training waits on before it changes the state
                "wait_staging", "hook_optimizer",
                # goodput: the training code's steps, beside the store's own events
                "record_step",
                # every = "auto": whether a save at this step would go to some tier
                "should_save",
                # erasure strategy: checking parity needs every member of a set (a collective)
                "verify_parity"}


def _lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is not installed in the test environment (pip install -e .[test])"
    return subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_layers_and_plugin_boundaries_hold():
    result = _lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), counting every import:
    module level, inside functions and under TYPE_CHECKING (grimp sees them all)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules)
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in edges[v]:
                out.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_no_import_cycle_among_the_core_modules():
    graph = grimp.build_graph("tierstore", cache_dir=None)
    assert _cycles(graph, "tierstore") == []


def test_cycle_detection_sees_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: a two-module package importing itself in a circle (one import
    inside a function, one under TYPE_CHECKING) is reported."""
    pkg = tmp_path / "circular_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from circular_pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from circular_pkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("circular_pkg", cache_dir=None)
    assert _cycles(graph, "circular_pkg") == [["circular_pkg.a", "circular_pkg.b"]]


def test_store_public_names_are_the_contract_api():
    public = {n for n in dir(tierstore.Store) if not n.startswith("_")}
    assert public == CONTRACT_API


def test_no_module_of_the_core_imports_the_package_back():
    """``__version__`` and everything else is imported from its module, never from the
    ``tierstore`` package (which imports the whole store)."""
    graph = grimp.build_graph("tierstore", cache_dir=None)
    importers = {m for m in graph.find_modules_that_directly_import("tierstore")
                 if m.startswith("tierstore.")}
    assert importers <= {"tierstore.demo"}, importers  # the demo is a user of the API


#: what runs code from bytes another process sent: torch.distributed's object collectives
#: (they pickle) and pickle's loaders
_PICKLING = {"all_gather_object", "broadcast_object_list", "gather_object",
             "scatter_object_list", "send_object_list", "recv_object_list", "broadcast_object",
             "loads", "load", "Unpickler"}


def test_no_module_exchanges_pickles_between_ranks():
    """What ranks send each other travels as typed messages (tierstore.transport.messages):
    no module of the core or of the built-in plugins calls a pickling collective, nor
    unpickles with ``pickle`` itself (the restricted unpicklers that check a tier's files
    subclass ``pickle.Unpickler`` and are named here)."""
    import ast

    restricted = {"tierstore/format/metadata.py", "tierstore/format/values.py"}
    found = []
    for path in sorted([*ROOT.glob("tierstore/**/*.py"), *ROOT.glob("plugins/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Attribute) or node.attr not in _PICKLING:
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name in {"dist", "distributed", "distributed_c10d", "c10d"} or (
                    name == "pickle" and not (rel in restricted and node.attr == "Unpickler")):
                found.append(f"{rel}:{node.lineno}: {name}.{node.attr}")
    assert not found, "pickles between processes:\n" + "\n".join(found)


def test_the_store_stays_a_thin_facade():
    """The Store only hands each call to the part that owns it (tierstore.assembly builds the
    parts): its class stays at most 300 lines, docstrings included, so that logic that grows
    goes to the layer it belongs to."""
    import inspect
    import tierstore.store

    lines = inspect.getsource(tierstore.store.Store).splitlines()
    assert len(lines) <= 300, (
        f"tierstore.store.Store is {len(lines)} lines: move the logic into the engine, the "
        f"DCP adapters or tierstore.assembly, and keep the Store a facade")
