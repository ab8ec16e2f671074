"""The example plugin passes tierstore's conformance kit: the backend kit (with rename), round
trips with and without the codec, and the codec kit, as any third-party plugin would run it.

The store configs also name the module in ``[store] plugins``, so these tests run whether or not
the package is installed (the entry point and the module are the same plugin: registered once).
"""

from __future__ import annotations

import sys

import pytest

# Detailed assertion messages from the kit's own asserts (possible only before its import).
if "tierstore_conformance" not in sys.modules:
    pytest.register_assert_rewrite("tierstore_conformance")

import tierstore_example
from tierstore_conformance import (CodecTests, RenameBackendTests, RoundTripTests,
                                   StockLoadableRoundTripTests)
from tierstore_example import ExampleDirBackend, ZlibCodec


class TestExampleDirBackend(RenameBackendTests):
    plugin_modules = ("tierstore_example",)

    @pytest.fixture(params=["missing root", "existing root"])
    def backend(self, request, tmp_path):
        root = tmp_path / "tier"
        if request.param == "existing root":
            root.mkdir()
        backend = ExampleDirBackend(root=str(root))
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, tmp_path):
        blocker = tmp_path / "a-file"
        blocker.write_bytes(b"not a directory")
        backend = ExampleDirBackend(root=str(blocker / "tier"))
        yield backend
        backend.close()


class TestExampleDirRoundTrip(StockLoadableRoundTripTests):
    @pytest.fixture
    def store_config(self, tmp_path):
        return {"store": {"plugins": ["tierstore_example"]},
                "tier": [{"name": "disk", "backend": "example-dir", "path": str(tmp_path / "d")}]}


class TestExampleZlibRoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self, tmp_path):
        return {"store": {"plugins": ["tierstore_example"]},
                "tier": [{"name": "disk", "backend": "example-dir", "path": str(tmp_path / "d"),
                          "codecs": [{"name": "example-zlib", "level": 1}]}]}


class TestExampleZlibCodec(CodecTests):
    """Through the plugin's own registration: the module is the plugin, the tier names the
    codec with its options."""

    @pytest.fixture(params=[{}, {"level": 0}, {"level": 9}], ids=["default", "level 0", "level 9"])
    def options(self, request):
        return request.param

    @pytest.fixture
    def codec(self, options):
        return ZlibCodec(**options)

    @pytest.fixture
    def codec_plugin(self):
        return tierstore_example

    @pytest.fixture
    def codec_spec(self, options):
        return {"name": "example-zlib", **options}
