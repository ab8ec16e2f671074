"""The ``obstore`` backend (and its ``manifest-last`` commit protocol) passes the conformance kit
on S3 (SeaweedFS), Azure blob storage (Azurite) and GCS (fake-gcs-server, where the emulator
takes obstore's uploads), with the same options a user writes for the ``fsspec`` backend.

It declares ``supports_rename = False``, so it is checked with ``BackendTests``, and with
``RoundTripTests`` through a store whose only tier is the obstore one. The tests after the kit
check what a user would: fsspec-style options map (or are refused by name), credentials
appear nowhere, keys stay under the tier's root, large objects travel in parallel parts and
ranges, a dead server is given up on quickly, and tierstore works without obstore installed.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
import traceback
import uuid
import warnings

import pytest
import torch.distributed.checkpoint as dcp

# Detailed assertion messages from the kit's own asserts (possible only before its import).
if "tierstore_conformance" not in sys.modules:
    pytest.register_assert_rewrite("tierstore_conformance")

from helpers import assert_state_dicts_equal, load_like, make_state_dict
from tierstore_conformance import BackendTests, RoundTripTests

import tierstore
from tierstore import ConfigError, DrainError
from tierstore.plugin import GaveUp, IntegrityError, cannot_connect, foreground
from tierstore.plugin.host import build_plugin_host

pytest.importorskip("obstore", reason="the obstore backend's tests need obstore: "
                                      "pip install 'tierstore[obstore]'")

def _obstore_backend(url: str, options: dict | None = None, **keys):
    """Build the registered ``obstore`` backend the way the core does (root and url)."""
    reg = build_plugin_host().lookup("backend", "obstore")
    return reg.factory(root=url, url=url, options=dict(options or {}), **keys)


def _tier(name: str, url: str, options: dict, **keys) -> dict:
    return {"name": name, "backend": "obstore", "url": url, "options": options, **keys}


def _store_config(*tiers: dict) -> dict:
    return {"tier": list(tiers)}


def _messages(exc: BaseException) -> str:
    """The exception, its causes and its traceback text, as a user would see them."""
    return "".join(traceback.format_exception(exc))


class _ObstoreBackendTests(BackendTests):
    """Shared parts: ``reopen`` passes the options along (the default passes only ``root``),
    and the backdoor reads objects with the server's own client."""

    #: store options of the backend under test (set by the ``backend`` fixture)
    options: dict | None = None

    def reopen(self, backend):
        return _obstore_backend(backend.url, self.options)


# ----------------------------------------------------------------------------- S3 (SeaweedFS)

@pytest.fixture(scope="module")
def s3_module_bucket(seaweed):
    """One bucket for this module's S3 tests; each test gets a fresh, empty prefix in it (a
    SeaweedFS bucket costs ~1.3 s to create and drop)."""
    if not seaweed.running():
        seaweed.restart()
    url = seaweed.make_bucket(f"t-conformance-obstore-{uuid.uuid4().hex[:10]}")
    yield url
    if seaweed.running():
        try:
            seaweed.filesystem().rm(url[len("s3://"):], recursive=True)
        except Exception as e:  # noqa: BLE001 - cleanup only
            warnings.warn(f"could not delete test bucket {url}: {e!r}", stacklevel=1)


@pytest.fixture
def s3_root(seaweed, s3_module_bucket):
    """``s3://<module bucket>/<fresh prefix>``: no object under it yet."""
    if not seaweed.running():  # a test elsewhere killed it and did not bring it back
        seaweed.restart()
    url = f"{s3_module_bucket}/{uuid.uuid4().hex[:12]}"
    assert seaweed.filesystem().find(url[len("s3://"):]) == []
    return url


def _s3_read(seaweed, url: str, path: str) -> bytes | None:
    fs = seaweed.filesystem()
    try:
        return fs.cat_file(f"{url[len('s3://'):]}/{path}")
    except FileNotFoundError:
        return None


class TestObstoreS3Backend(_ObstoreBackendTests):
    @pytest.fixture
    def backend(self, seaweed, s3_root):
        # The options a user writes for the fsspec backend (s3fs's): key, secret, client_kwargs.
        self.options = seaweed.storage_options()
        self.seaweed = seaweed
        backend = _obstore_backend(f"{s3_root}/tier", self.options)
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, seaweed):
        """A bucket that does not exist (tierstore never creates buckets)."""
        backend = _obstore_backend(f"s3://no-such-bucket-{uuid.uuid4().hex[:10]}/tier",
                                   seaweed.storage_options())
        yield backend
        backend.close()

    def backdoor_read(self, backend, path):
        return _s3_read(self.seaweed, backend.url, path)


class TestObstoreS3RoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self, seaweed, s3_root):
        return _store_config(_tier("s3", f"{s3_root}/run", seaweed.storage_options()))


# ----------------------------------------------------------------------------- Azure (Azurite)

class TestObstoreAzureBackend(_ObstoreBackendTests):
    @pytest.fixture
    def backend(self, azurite, az_container):
        # adlfs's option for an emulator: a connection string.
        self.options = azurite.storage_options()
        self.azurite = azurite
        backend = _obstore_backend(f"{az_container}/tier", self.options)
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, azurite):
        """A container that does not exist."""
        backend = _obstore_backend(f"az://no-such-container-{uuid.uuid4().hex[:10]}/tier",
                                   azurite.storage_options())
        yield backend
        backend.close()

    def backdoor_read(self, backend, path):
        container, _, prefix = backend.url[len("az://"):].partition("/")
        return self.azurite.get_blob(container, f"{prefix}/{path}")


class TestObstoreAzureRoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self, azurite, az_container):
        return _store_config(_tier("azure", f"{az_container}/run", azurite.storage_options()))


# ------------------------------------------------------------------ GCS (fake-gcs-server)

@pytest.fixture(scope="module")
def gcs_takes_obstore_uploads(fake_gcs):
    """Skip, saying why, where the emulator cannot take what obstore's GCS client sends: it
    writes through GCS's XML API (a PUT of the object's path), which fake-gcs-server has not
    implemented (fsouza/fake-gcs-server#331; it answers "invalid uploadType")."""
    if not fake_gcs.running():
        fake_gcs.restart()
    bucket = fake_gcs.make_bucket(f"t-obstore-probe-{uuid.uuid4().hex[:10]}")
    backend = _obstore_backend(f"{bucket}/probe", fake_gcs.storage_options(), max_attempts=1)
    try:
        backend.write_bytes("probe", b"x")
    except Exception as e:  # noqa: BLE001 - the emulator's answer is the reason
        answer = str(e).rsplit(" - ", 1)[-1].strip()[:80]
        pytest.skip(f"fake-gcs-server cannot take obstore's GCS uploads (obstore writes "
                    f"through GCS's XML API, which the emulator lacks: "
                    f"fsouza/fake-gcs-server#331): {type(e).__name__}: {answer}")
    finally:
        backend.close()


class TestObstoreGCSBackend(_ObstoreBackendTests):
    @pytest.fixture
    def backend(self, fake_gcs, gcs_takes_obstore_uploads, gcs_bucket):
        # gcsfs's options for an emulator: endpoint_url and token = "anon".
        self.options = fake_gcs.storage_options()
        self.fake_gcs = fake_gcs
        backend = _obstore_backend(f"{gcs_bucket}/tier", self.options)
        yield backend
        backend.close()

    @pytest.fixture
    def unreachable_backend(self, fake_gcs, gcs_takes_obstore_uploads):
        backend = _obstore_backend(f"gs://no-such-bucket-{uuid.uuid4().hex[:10]}/tier",
                                   fake_gcs.storage_options())
        yield backend
        backend.close()

    def backdoor_read(self, backend, path):
        fs = self.fake_gcs.filesystem()
        try:
            return fs.cat_file(f"{backend.url[len('gs://'):]}/{path}")
        except FileNotFoundError:
            return None


class TestObstoreGCSRoundTrip(RoundTripTests):
    @pytest.fixture
    def store_config(self, fake_gcs, gcs_takes_obstore_uploads, gcs_bucket):
        return _store_config(_tier("gcs", f"{gcs_bucket}/run", fake_gcs.storage_options()))


# ----------------------------------------------------------------------------- what a user checks

def test_a_tier_moves_from_fsspec_to_obstore_by_changing_its_backend(seaweed, s3_root):
    """The same tier table, ``backend = "fsspec"`` then ``"obstore"``: the same layout, so a
    checkpoint saved through one is listed, verified and loaded through the other."""
    tier = {"name": "s3", "url": f"{s3_root}/run", "options": seaweed.storage_options()}
    with tierstore.open(_store_config({**tier, "backend": "fsspec"})) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
    with tierstore.open(_store_config({**tier, "backend": "obstore"})) as store:
        assert [(c.id, c.tiers) for c in store.list()] == [("step-1", ["s3"])]
        assert store.verify("step-1").ok
        assert_state_dicts_equal(load_like(store, "step-1", make_state_dict(1)),
                                 make_state_dict(1))
        dcp.save(make_state_dict(2), storage_writer=store.writer(), checkpoint_id="step-2")
    with tierstore.open(_store_config({**tier, "backend": "fsspec"})) as store:
        assert store.latest() == "step-2"
        assert store.verify("step-2").ok


def test_azure_takes_an_account_name_and_key_as_well_as_a_connection_string(azurite,
                                                                            az_container):
    """adlfs's separate options (account_name, account_key, and an endpoint_url for a
    non-Azure host) reach the same container as its connection string."""
    options = {"account_name": azurite.account, "account_key": azurite.key,
               "endpoint_url": azurite.endpoint_url}
    backend = _obstore_backend(f"{az_container}/run", options)
    try:
        assert backend.check_reachable() is None
        backend.write_bytes("d/f", b"hello")
        other = _obstore_backend(f"{az_container}/run", azurite.storage_options())
        assert other.read_bytes("d/f") == b"hello"
        other.close()
    finally:
        backend.close()


@pytest.mark.parametrize("options, named", [
    ({"profile": "prod"}, "profile"),
    ({"config_kwargs": {"retries": {"max_attempts": 3}}}, "config_kwargs.retries"),
    ({"client_kwargs": {"use_dualstack_endpoint": True}}, "client_kwargs.use_dualstack_endpoint"),
    ({"account_name": "someone"}, "account_name"),
    ({"no_such_option": 1}, "no_such_option"),
    ({"key": "a", "aws_access_key_id": "b"}, "aws_access_key_id"),
], ids=["aws profile", "botocore retries", "client argument", "azure option on s3",
        "unknown", "given twice"])
def test_an_option_obstore_cannot_take_is_a_config_error_naming_it(tmp_path, options, named):
    """Nothing is silently dropped: an option without an obstore equivalent fails the open
    with a ConfigError naming it (and what to write instead where there is something)."""
    config = _store_config(_tier("s3", "s3://bucket/run", options))
    with pytest.raises(ConfigError) as info:
        tierstore.open(config)
    assert f"'{named}'" in str(info.value), str(info.value)


def test_an_option_refused_for_every_store_is_reported_at_its_line(tmp_path):
    """A key no store takes (an AWS profile) is refused with the file and line of the
    tier's options, as every config mistake is."""
    toml = tmp_path / "tiers.toml"
    toml.write_text(f'[[tier]]\nname = "s3"\n'
                    f'backend = "obstore"\nurl = "s3://bucket/run"\n'
                    f'options = {{ profile = "prod" }}\n')
    with pytest.raises(ConfigError) as info:
        tierstore.open(str(toml))
    assert f"{toml}:5" in str(info.value) and "'profile'" in str(info.value), str(info.value)
    assert "AWS_" in str(info.value)  # what to do instead


@pytest.mark.parametrize("url", ["file:///tmp/x", "s3://", "s3://bucket/a/../b", "http://h/b"])
def test_a_url_that_is_no_object_store_is_a_config_error(url):
    with pytest.raises(ConfigError) as info:
        tierstore.open(_store_config(_tier("t", url, {})))
    assert "url" in str(info.value)


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_a_wrong_secret_fails_fast_at_open_saying_access_denied(request, kind):
    """A refused credential is a ConfigError at open naming the tier and saying access was
    denied; the credential appears nowhere in it, its causes or its traceback."""
    wrong = f"not-the-secret-{uuid.uuid4().hex}"
    if kind == "s3":
        server, url = request.getfixturevalue("seaweed"), request.getfixturevalue("s3_root")
        options = server.storage_options(secret=wrong)
    else:
        server, url = request.getfixturevalue("azurite"), request.getfixturevalue("az_container")
        wrong = base64.b64encode(uuid.uuid4().bytes * 2).decode()  # a key, but not its key
        options = server.storage_options(
            connection_string=server.connection_string.replace(server.key, wrong))
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        tierstore.open(_store_config(_tier(kind, f"{url}/run", options)))
    assert time.monotonic() - started < 10
    msg = str(info.value).lower()
    assert f"tier '{kind}'" in msg and "access denied" in msg, msg
    assert "does not exist" not in msg, msg
    assert wrong not in _messages(info.value)


@pytest.mark.parametrize("kind", ["s3", "azure"])
def test_a_missing_bucket_fails_fast_at_open_saying_it_does_not_exist(request, kind):
    server = request.getfixturevalue("seaweed" if kind == "s3" else "azurite")
    if not server.running():
        server.restart()
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:12]}"
    scheme = "s3" if kind == "s3" else "az"
    with pytest.raises(ConfigError) as info:
        tierstore.open(_store_config(_tier(kind, f"{scheme}://{bucket}/run",
                                           server.storage_options())))
    assert bucket in str(info.value) and "does not exist" in str(info.value), str(info.value)


def test_credentials_read_from_the_environment_work_and_appear_nowhere(
        seaweed, s3_root, azurite, az_container, tmp_path, monkeypatch):
    """``{ env = "NAME" }`` options reach the stores; the secrets they hold are in no message,
    repr, event or manifest, even when a request fails."""
    monkeypatch.setenv("TIERSTORE_TEST_S3_SECRET", seaweed.secret)
    monkeypatch.setenv("TIERSTORE_TEST_AZ_KEY", azurite.key)
    s3_options = seaweed.storage_options(secret={"env": "TIERSTORE_TEST_S3_SECRET"})
    az_options = {"account_name": azurite.account, "account_key": {"env": "TIERSTORE_TEST_AZ_KEY"},
                  "endpoint_url": azurite.endpoint_url}
    config = _store_config(
        {"name": "local", "backend": "local", "path": str(tmp_path / "local")},
        _tier("s3", f"{s3_root}/run", s3_options), _tier("azure", f"{az_container}/run",
                                                         az_options))
    texts = {}
    with tierstore.open(config) as store:
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        store.wait()
        assert store.list()[0].tiers == ["local", "s3", "azure"]
        assert store.verify("step-1", tier="azure").ok and store.verify("step-1", tier="s3").ok
        backends = [t.backend for t in store._ctx.tiers]
        texts["describe and repr"] = " ".join([b.describe() for b in backends]
                                              + [repr(b) for b in backends] + [repr(store)])
        # A failing request's message: the object is missing.
        with pytest.raises(FileNotFoundError) as info:
            backends[2].read_bytes("step-1/no-such-object")
        texts["error"] = _messages(info.value)
        texts["manifest"] = (backends[1].read_bytes("step-1/tierstore.json").decode()
                             + backends[2].read_bytes("step-1/tierstore.json").decode())
    for where, text in texts.items():
        assert seaweed.secret not in text, f"the S3 secret appears in the {where}"
        assert azurite.key not in text, f"the Azure key appears in the {where}"


def test_keys_named_by_a_manifest_or_a_listing_never_leave_the_tier_root(seaweed, s3_root):
    """A path that climbs out of the root is refused before any request; a neighbouring
    prefix (``run-2`` beside ``run``) is not part of the tier."""
    backend = _obstore_backend(f"{s3_root}/run", seaweed.storage_options())
    neighbour = _obstore_backend(f"{s3_root}/run-2", seaweed.storage_options())
    try:
        neighbour.write_bytes("step-1/x", b"not this tier's")
        for path in ("../run-2/step-1/x", "step-1/../../run-2/step-1/x", "/abs", "a//b"):
            with pytest.raises(IntegrityError):
                backend.read_bytes(path)
            with pytest.raises(IntegrityError):
                backend.write_bytes(path, b"x")
        assert backend.list("") == [] and backend.inventory("") == {}
        backend.delete("")  # the whole tier: the neighbour's objects stay
        assert neighbour.read_bytes("step-1/x") == b"not this tier's"
    finally:
        backend.close()
        neighbour.close()


def test_large_objects_travel_as_parallel_parts_and_ranges(seaweed, s3_root, tmp_path):
    """Past one part an object is a multipart upload (a PUT per part), a drain's upload of
    a local file too, and a load reads it back as concurrent ranged GETs: counted by the
    server."""
    bucket = s3_root[len("s3://"):].split("/", 1)[0]
    backend = _obstore_backend(f"{s3_root}/run", seaweed.storage_options(), part_mib=5,
                               concurrency=8)
    data = os.urandom(23 << 20)  # 5 parts of 5 MiB
    try:
        before = seaweed.request_counts(bucket)
        with backend.open_write("big") as f:
            for i in range(0, len(data), 1 << 20):
                f.write(memoryview(data)[i:i + (1 << 20)])
        after = seaweed.request_counts(bucket)
        assert after.get("PUT", 0) - before.get("PUT", 0) >= 5  # the parts
        local = tmp_path / "big"
        local.write_bytes(data)
        backend.put_files([(str(local), "drained")], {"drained": len(data)})
        assert backend.size("drained") == len(data)
        before = seaweed.request_counts(bucket)
        with backend.open_read("big") as f:
            assert f.read() == data
        gets = seaweed.request_counts(bucket).get("GET", 0) - before.get("GET", 0)
        assert gets >= 3, gets  # 8 MiB ranges (and the HEAD, counted as a GET)
        with backend.open_read_sized("drained", len(data)) as f:
            assert f.read_ranges([0, 10 << 20, len(data) - 7], [5, (10 << 20) + 5,
                                                                len(data)]) == [
                data[:5], data[10 << 20:(10 << 20) + 5], data[-7:]]
    finally:
        backend.close()


def test_a_writer_that_fails_publishes_nothing(seaweed, s3_root):
    """An exception inside ``with backend.open_write(...)`` leaves no object, small or
    already multipart."""
    backend = _obstore_backend(f"{s3_root}/run", seaweed.storage_options(), part_mib=5)
    try:
        for size in (100, 7 << 20):
            with pytest.raises(RuntimeError):
                with backend.open_write(f"d/{size}") as f:
                    f.write(os.urandom(size))
                    raise RuntimeError("the save failed")
            assert backend.size(f"d/{size}") is None
    finally:
        backend.close()


def _dead_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_server_is_given_up_on_by_the_tiers_own_retry_policy():
    """Against a port nothing listens on, a call retries as the tier says and no more
    (obstore's own retries are off), then raises GaveUp naming the tier; inside a call that
    can do without the tier it gives up after one quick retry, whatever the tier's budget."""
    options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{_dead_port()}",
               "region": "us-east-1"}
    backend = _obstore_backend("s3://bucket/run", options, max_attempts=3, retry_seconds=30)
    patient = _obstore_backend("s3://bucket/run", options, max_attempts=1000,
                               retry_seconds=600)
    try:
        with pytest.raises(GaveUp) as info:
            backend.read_bytes("x")
        assert "failed 3 times" in str(info.value) and "s3://bucket/run" in str(info.value)
        assert cannot_connect(info.value)
        started = time.monotonic()
        with foreground(), pytest.raises(Exception) as info:
            patient.check_reachable()
        assert cannot_connect(info.value)
        assert time.monotonic() - started < 2
    finally:
        backend.close()
        patient.close()


def test_a_dead_object_store_leaves_the_local_tier_working(tmp_path):
    """A store whose obstore tier cannot be connected to opens (the tier marked unreachable),
    saves to, lists and loads from its local tier; the drain to the dead tier fails as a
    DrainError naming it."""
    options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{_dead_port()}"}
    config = _store_config(
        {"name": "local", "backend": "local", "path": str(tmp_path / "local")},
        _tier("s3", "s3://bucket/run", options, max_attempts=2, retry_seconds=3))
    started = time.monotonic()
    with tierstore.open(config) as store:
        assert time.monotonic() - started < 5
        dcp.save(make_state_dict(1), storage_writer=store.writer(), checkpoint_id="step-1")
        assert store.latest() == "step-1"
        assert [(c.id, c.tiers) for c in store.list()] == [("step-1", ["local"])]
        assert_state_dicts_equal(load_like(store, "step-1", make_state_dict(1)),
                                 make_state_dict(1))
        with pytest.raises(DrainError) as info:
            store.wait()
        assert (info.value.checkpoint_id, info.value.tier) == ("step-1", "s3")
        assert "still complete on tier 'local'" in str(info.value)


def test_tierstore_works_without_obstore_and_a_tier_asking_for_it_says_how_to_install_it(
        tmp_path):
    """With obstore absent, importing tierstore and its built-in plugins imports nothing of
    it and a local store works; an obstore tier fails its open naming the extra."""
    script = f"""
import sys
sys.modules["obstore"] = None  # as if it were not installed
import tierstore, tierstore_plugins.obstore_backend
from tierstore import PluginError
with tierstore.open({{"tier": [{{"name": "l", "backend": "local", "path": {str(tmp_path)!r}}}]}}):
    pass
try:
    tierstore.open({{"tier": [{{"name": "s3",
                    "backend": "obstore", "url": "s3://bucket/run"}}]}})
except PluginError as e:
    print("REFUSED", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "REFUSED" in out.stdout and "pip install 'tierstore[obstore]'" in out.stdout, \
        out.stdout
    assert "tier 's3'" in out.stdout
