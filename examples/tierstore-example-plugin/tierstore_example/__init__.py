"""An example third-party tierstore plugin: backend ``example-dir`` and codec ``example-zlib``.

It imports only the public plugin API, ``tierstore.plugin``, and is found through the entry point
``example = "tierstore_example"`` (group ``tierstore``) of its ``pyproject.toml``, so a config
names its plugins without ``[store] plugins``::

    [[tier]]
    name = "disk"
    backend = "example-dir"
    path = "/data/ckpt"
    codecs = [{ name = "example-zlib", level = 6 }]
"""

from __future__ import annotations

from tierstore.plugin import hookimpl

from .backend import ExampleDirBackend
from .codec import ZlibCodec

__all__ = ["ExampleDirBackend", "ZlibCodec", "ZlibStream"]


def __getattr__(name: str):
    """``ZlibStream``, the codec's DCP extension, imported (with DCP) when first asked for."""
    if name == "ZlibStream":
        from .stream import ZlibStream

        return ZlibStream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def tierstore_register_backends(register):
    """Register the ``example-dir`` backend."""
    register("example-dir", ExampleDirBackend)


@hookimpl
def tierstore_register_codecs(register):
    """Register the ``example-zlib`` codec."""
    register("example-zlib", ZlibCodec)
