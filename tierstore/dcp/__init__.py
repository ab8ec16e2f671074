"""The DCP adapters: the StorageWriter/AsyncStager (:mod:`.writer`), the StorageReader
(:mod:`.reader`) and the fetch of files this node lacks from peers before a load reads
(:mod:`.peer_fetch`).

Layer: dcp, above ``tierstore.engine``. Each adapter gets a narrow bundle of services
(``WriterServices``, ``ReaderServices``, defined beside it), never the Store. It may import the
engine and everything below.

The modules import DCP, which takes seconds, so the package imports none of them itself: each is
imported when first named, ``from tierstore import dcp; dcp.writer``, and a store that only
answers queries needing no DCP (``tierstore ls``) never imports them.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = frozenset({"contents", "peer_fetch", "reader", "shared_reads", "spill", "writer"})


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
