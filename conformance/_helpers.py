"""Small helpers shared by the per-kind kits (codec, staging, replication, commit, observer).

Private to ``tierstore_conformance``: plugin authors use the test classes, not these.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from tierstore.plugin import Option

from .roundtrip import assert_state_dicts_equal

__all__ = ["assert_options_declared", "assert_trees_equal", "tensor_bytes"]


def assert_options_declared(cls: type) -> None:
    """``cls.options`` is a tuple of :class:`tierstore.plugin.Option` with unique names, each
    with a description (the core quotes it in config errors), and whose defaults pass the
    option's own ``check`` (a default the core would refuse is a config nobody can write)."""
    options = getattr(cls, "options", None)
    name = cls.__name__
    assert isinstance(options, tuple), \
        f"{name}.options must be a tuple of tierstore.plugin.Option, not {type(options).__name__}"
    names = []
    for opt in options:
        assert isinstance(opt, Option), \
            f"{name}.options holds {opt!r}, which is not a tierstore.plugin.Option"
        assert opt.description.strip(), \
            f"{name} option '{opt.name}' has no description (config errors quote it)"
        if not opt.required and opt.default is not None and opt.check is not None:
            problem = opt.check(opt.default)
            assert problem is None, \
                f"{name} option '{opt.name}': its default {opt.default!r} fails its check: {problem}"
        names.append(opt.name)
    assert len(names) == len(set(names)), f"{name}.options declares a key twice: {names}"


def tensor_bytes(tree: Any) -> int:
    """Bytes of tensor data in a (nested) state dict."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def assert_trees_equal(got: Any, want: Any, where: str = "state_dict") -> None:
    """Like :func:`tierstore_conformance.assert_state_dicts_equal` (tensors bit for bit), also
    through lists, tuples (same container type) and ``io.BytesIO`` (same contents)."""
    if isinstance(want, (list, tuple)):
        assert type(got) is type(want), \
            f"{where}: expected a {type(want).__name__}, got {type(got).__name__}"
        assert len(got) == len(want), f"{where}: {len(got)} elements, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_trees_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: expected a dict, got {type(got).__name__}"
        assert sorted(got) == sorted(want), f"{where}: keys {sorted(got)}, expected {sorted(want)}"
        for key in want:
            assert_trees_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, io.BytesIO):
        assert isinstance(got, io.BytesIO), f"{where}: expected a BytesIO, got {type(got).__name__}"
        assert got.getvalue() == want.getvalue(), f"{where}: BytesIO contents differ"
    else:
        assert_state_dicts_equal(got, want, where)
