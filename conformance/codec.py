"""``CodecTests``: what a codec (a byte transform applied to each item on the way to a tier)
must do.

A codec's ``extension()`` is a DCP ``StreamTransformExtension``: the kit writes bytes through it
and reads them back the way DCP does (an ``ExtensionRegistry`` rebuilding the extension from the
descriptor stored in the metadata), then saves and loads real state dicts through a store whose
tier uses the codec, and finally loads that checkpoint with stock DCP's ``FileSystemReader``.
"""

from __future__ import annotations

import copy
import io
import json
import random
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

import tierstore
from tierstore.format.item_io import NoCloseWriter
from tierstore.plugin import MANIFEST_NAME, Codec, hookimpl

from ._helpers import assert_options_declared
from .roundtrip import _empty_like, assert_state_dicts_equal, make_state_dict

__all__ = ["CodecTests"]

_MiB = 1 << 20


def _payload(kind: str) -> bytes:
    """Test data: empty, small, several MiB of random (incompressible) or repetitive bytes."""
    rng = random.Random(kind)
    if kind == "empty":
        return b""
    if kind == "one byte":
        return b"\x00"
    if kind == "small":
        return rng.randbytes(1000)
    if kind == "incompressible":
        return rng.randbytes(5 * _MiB + 3)
    words = [rng.randbytes(8) for _ in range(16)]  # compressible: few distinct words, zeros
    return b"".join(rng.choice(words) for _ in range(400_000)) + bytes(3 * _MiB + 1)


class _CodecPlugin:
    """A plugin object registering one codec instance under ``name``."""

    def __init__(self, name: str, codec: Codec):
        self.name, self.codec = name, codec

    @hookimpl
    def tierstore_register_codecs(self, register):
        """Register the codec under test (a factory returning the instance)."""
        register(self.name, lambda: self.codec)


class CodecTests:
    """Conformance tests for a :class:`tierstore.plugin.Codec`.

    Subclass it in a class named ``Test...`` and provide the fixture ``codec``, a constructed
    codec::

        class TestMyCodec(CodecTests):
            @pytest.fixture
            def codec(self):
                return MyCodec(level=5)

    The round trip registers the instance under :attr:`codec_name` with a small plugin object
    (fixture ``codec_plugin``) and names it in the tier's ``codecs``. Override ``codec_plugin``
    (a plugin object or module passed to ``tierstore.open(plugins=...)``) and ``codec_spec``
    (the entry of the tier's ``codecs`` list, a name or a table with ``name`` and options) to go
    through your own registration instead.
    """

    #: name the default ``codec_plugin`` registers the codec under (not one a plugin uses)
    codec_name: str = "conformance-codec"

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def codec(self) -> Codec:
        """The codec under test. Subclasses must override it."""
        pytest.fail(f"{type(self).__name__} must provide a 'codec' fixture: a constructed "
                    f"tierstore.plugin.Codec (see CodecTests)")

    @pytest.fixture
    def codec_plugin(self, codec: Codec) -> Any:
        """A plugin object registering ``codec`` under :attr:`codec_name`."""
        return _CodecPlugin(self.codec_name, codec)

    @pytest.fixture
    def codec_spec(self) -> Any:
        """The tier's ``codecs`` entry naming the codec (default: :attr:`codec_name`)."""
        return self.codec_name

    @staticmethod
    def store_config(root, codec_spec: Any) -> dict[str, Any]:
        """One ``local`` tier in ``root`` using the codec (its checkpoints are read back from
        ``root/<id>`` with stock DCP)."""
        return {"tier": [{"name": "coded", "backend": "local", "path": str(root),
                          "codecs": [codec_spec]}]}

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def encode(extension: StreamTransformExtension, data: bytes, piece: int = 1 * _MiB + 7) -> bytes:
        """``data`` written through ``extension.transform_to`` in pieces, stream closed."""
        out = io.BytesIO()
        stream = extension.transform_to(NoCloseWriter(out))
        view = memoryview(data)
        for start in range(0, len(view), piece):
            stream.write(view[start:start + piece])
        stream.close()
        return out.getvalue()

    @staticmethod
    def decode(descriptor: str, extension_class: type, stored: bytes) -> bytes:
        """``stored`` read back the way DCP does: an ``ExtensionRegistry`` (with the codec's
        extension class registered) rebuilds the extension from ``descriptor``."""
        registry = ExtensionRegistry()
        registry.register(extension_class)
        extensions = registry.from_descriptor_list([descriptor])
        assert len(extensions) == 1
        stream = extensions[0].transform_from(io.BytesIO(stored))
        return stream.read()

    # -- tests ---------------------------------------------------------------------------------
    def test_options_are_declared_with_descriptions(self, codec):
        """``options`` is a tuple of Option, each described, defaults passing their checks."""
        assert isinstance(codec, Codec), f"{type(codec).__name__} does not subclass Codec"
        assert_options_declared(type(codec))

    def test_extension_is_a_dcp_stream_transform(self, codec):
        """extension() is a StreamTransformExtension whose descriptor names its registry name."""
        ext = codec.extension()
        assert isinstance(ext, StreamTransformExtension), \
            f"{type(codec).__name__}.extension() returned {type(ext).__name__}, not a " \
            f"torch.distributed.checkpoint._extension.StreamTransformExtension"
        descriptor = ext.get_descriptor()
        assert isinstance(descriptor, str) and descriptor
        name = descriptor.partition("/")[0]
        assert name == type(ext).registry_name(), \
            f"descriptor {descriptor!r} does not start with registry_name() " \
            f"{type(ext).registry_name()!r}, so a reader's ExtensionRegistry cannot find it"

    @pytest.mark.parametrize("kind", ["empty", "one byte", "small", "incompressible",
                                      "compressible"])
    def test_bytes_read_back_identical(self, codec, kind):
        """Bytes written through the transform read back identical from the descriptor."""
        data = _payload(kind)
        ext = codec.extension()
        stored = self.encode(ext, data)
        got = self.decode(ext.get_descriptor(), type(ext), stored)
        assert len(got) == len(data), f"{kind}: {len(got)} bytes back, {len(data)} written"
        assert got == data, f"{kind}: bytes differ after the round trip"

    def test_write_piece_size_does_not_change_what_reads_back(self, codec):
        """Many tiny writes read back the same as one large one (streams buffer correctly)."""
        data = _payload("small") * 50
        ext = codec.extension()
        for piece in (1, 17, len(data)):
            stored = self.encode(ext, data, piece)
            assert self.decode(ext.get_descriptor(), type(ext), stored) == data, f"piece {piece}"

    def test_dcp_round_trip_through_a_store(self, tmp_path, codec_spec, codec_plugin, codec):
        """dcp.save / dcp.load through a store whose tier uses the codec: tensors bitwise equal,
        the manifest lists the codec and every item in the metadata carries its descriptor."""
        sd = make_state_dict(1)
        want = copy.deepcopy(sd)
        with tierstore.open(self.store_config(tmp_path / "coded", codec_spec),
                            plugins=[codec_plugin]) as store:
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
            loaded = _empty_like(want)
            dcp.load(loaded, storage_reader=store.reader(), checkpoint_id="step-1")
        assert_state_dicts_equal(loaded, want)

        root = tmp_path / "coded" / "step-1"
        manifest = json.loads((root / MANIFEST_NAME).read_text())
        assert len(manifest["codecs"]) == 1, f"manifest codecs: {manifest['codecs']}"
        descriptor = codec.extension().get_descriptor()
        metadata = FileSystemReader(str(root)).read_metadata()
        assert metadata.storage_data, "the metadata records no items"
        for index, info in metadata.storage_data.items():
            assert list(info.transform_descriptors or ()) == [descriptor], \
                f"item {index.fqn} records transforms {info.transform_descriptors}"

    def test_stock_dcp_loads_it_with_the_extension_registered(self, tmp_path, codec_spec,
                                                              codec_plugin, codec):
        """No lock-in: stock dcp.load (FileSystemReader with an ExtensionRegistry knowing the
        codec's extension) undoes the codec from the stored descriptors."""
        sd = make_state_dict(2)
        want = copy.deepcopy(sd)
        with tierstore.open(self.store_config(tmp_path / "coded", codec_spec),
                            plugins=[codec_plugin]) as store:
            dcp.save(sd, storage_writer=store.writer(), checkpoint_id="step-1")
        registry = ExtensionRegistry()
        registry.register(type(codec.extension()))
        reader = FileSystemReader(str(tmp_path / "coded" / "step-1"),
                                  _extension_registry=registry)
        loaded = _empty_like(want)
        dcp.load(loaded, storage_reader=reader)
        assert_state_dicts_equal(loaded, want)
