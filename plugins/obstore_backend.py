"""Backend ``obstore``: an ``s3://``, ``gs://`` or ``az://`` tier on obstore's Rust client.

The same tier as ``fsspec``'s on an object store, on another client: the same keys (``url``,
``options`` with ``{ env = "NAME" }`` values, ``concurrency``, ``part_mib``, retries, leases), the
same layout and the same commit (``manifest-last``: nothing is renamed, the manifest object is
written after every data object is confirmed). ``options`` are written in fsspec's terms (what
s3fs, gcsfs and adlfs take: ``endpoint_url``, ``key``/``secret``, ``client_kwargs``, ``token``,
``account_name``/``account_key``, ``connection_string``, ...) and mapped to obstore's store
config; obstore's own config keys are accepted too. What cannot be mapped is a ``ConfigError``
naming the option, never silently dropped.

Every key is the tier's prefix plus a path checked by ``confined``: names read from a manifest
or a listing never reach outside the tier's root. Objects up to one part (``part_mib``) are
written in one PUT, larger ones as multipart uploads with parts in flight at once; bulk uploads
(drains) send many files at once; reads fetch byte ranges concurrently. obstore's own retries
are off: the tier's retry policy (``max_attempts``, ``retry_seconds``) alone governs, and
calls that can do without the tier use a client with a short connect timeout, so a dead server
costs them a fraction of a second. obstore's errors become Python's (``FileNotFoundError``,
``PermissionError``, ``ConnectionRefusedError``, ...) with every credential given in
``options`` replaced by ``***``.

obstore is imported when a tier uses this backend, never before: tierstore works without it,
and a tier that asks for it says how to install it (``pip install 'tierstore[obstore]'``).
"""

from __future__ import annotations

import io
import logging
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Callable, TypeVar

from tierstore.plugin import (Backend, ConfigError, DirectoryLock, Option, RetryPolicy,
                              TierstoreError, cannot_connect, confined, hookimpl, with_retries)
from tierstore_plugins.fsspec_backend import OBJECT_STORE_OPTIONS
from tierstore_plugins.object_reader import LazyPool, ObjectReader
from tierstore_plugins.leases import LeaseKeeper, lock_by_leases
from tierstore_plugins.obstore_options import (FSSPEC_NAMES, STORE_NAMES, Unmappable,
                                               options_problem, secrets_in, seconds_option,
                                               split_url, store_config, url_problem)

__all__ = ["ObstoreBackend", "ObjectStoreError", "ConnectTimeoutError", "EndpointConnectionError"]

log = logging.getLogger("tierstore.obstore")
T = TypeVar("T")

#: the extra that installs obstore, for messages
INSTALL_HINT = "pip install 'tierstore[obstore]'"
_MIN_VERSION = (0, 12)

#: credentials in URLs an error may quote (an Azure SAS, a presigned S3 URL)
_SIGNED_QUERY = re.compile(r"(?i)\b(sig|signature|x-amz-signature|x-amz-credential|"
                           r"x-amz-security-token|x-goog-signature|x-goog-credential)=[^&\s\"']+")

#: connect timeout (s) of the client used by calls that can do without the tier
#: (RetryPolicy.in_foreground(): queries, a load's search for copies, the health probe)
_FOREGROUND_CONNECT = "500ms"
#: an object that is never written: asking for it answers for the bucket and the credentials
_PROBE = ".tierstore-reachable"
#: what a store says about a bucket or container (not an object) that does not exist
_NO_BUCKET = re.compile(r"NoSuchBucket|ContainerNotFound|(bucket|container) does not exist", re.I)


# -- errors ------------------------------------------------------------------------------------

class ObjectStoreError(Exception):
    """A request the object store answered with an error (``status``: its HTTP status, None
    when unknown). Retried when the status is 429 or 5xx (``retry.is_transient`` reads it),
    failing at once otherwise."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ConnectTimeoutError(TimeoutError):
    """No connection to the store could be made in time (``retry.cannot_connect`` knows the
    name: inside ``foreground`` the tier is given up on at once)."""


class EndpointConnectionError(ConnectionError):
    """No connection to the store could be made: its host is unknown or unreachable."""


#: set on the exceptions this module made out of obstore's
_TRANSLATED = "_tierstore_obstore_error"
_STATUS = re.compile(r"status code: (\d{3})|\(code: (\d{3})\)")


def _status_of(text: str) -> int | None:
    found = _STATUS.search(text)
    return int(found.group(1) or found.group(2)) if found else None


_XML_ERROR = re.compile(r"<\?xml.*?<Code>(.*?)</Code>.*?<Message>([^<\n]*).*", re.S)


def _condensed(text: str) -> str:
    """``text`` with an XML error body (S3's, Azure's) cut down to its code and message."""
    return _XML_ERROR.sub(lambda m: f"{m.group(1)}: {m.group(2).strip()}", text)


def _translated(exc: BaseException, redact: Callable[[str], str]) -> BaseException:
    """``exc`` (raised by obstore) as the Python exception tierstore's retry helper and core
    understand, its message redacted and stripped of obstore's debug dump."""
    text = str(exc)
    head = _condensed(text.split("\n\nDebug source:", 1)[0].strip())
    message = redact(head[:1500])
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = _status_of(head)
    if isinstance(exc, FileNotFoundError) or "NotFoundError" in names:
        return FileNotFoundError(message)
    if names & {"PermissionDeniedError", "UnauthenticatedError"} or status in (401, 403):
        return PermissionError(message)
    if names & {"AlreadyExistsError", "PreconditionError"}:
        return FileExistsError(message)
    if names & {"InvalidPathError", "UnknownConfigurationKeyError"} or isinstance(exc,
                                                                                  ValueError):
        return ValueError(message)
    if "NotSupportedError" in names:
        return NotImplementedError(message)
    if status == 404:  # a list or a delete: the bucket or container is missing
        return FileNotFoundError(message)
    if status is not None:
        return ObjectStoreError(message, status)
    # No answer from the server: how the connection failed is in the debug dump only.
    if "tcp connect error" in text or "kind: Connect" in text or "dns error" in text:
        if "ConnectionRefused" in text:
            return ConnectionRefusedError(message)
        if "TimedOut" in text or "Elapsed" in text:
            return ConnectTimeoutError(message)
        if "dns error" in text:
            return socket.gaierror(message)
        return EndpointConnectionError(message)
    if re.search(r"timed out|timeout|TimedOut|Elapsed", text):
        return TimeoutError(message)
    if re.search(r"error sending request|connection (closed|reset)|ConnectionReset|"
                 r"broken pipe|error decoding response body|IncompleteMessage|kind: (Request|Body"
                 r"|Decode)", text, re.I):
        return ConnectionError(message)
    return ObjectStoreError(f"{type(exc).__name__}: {message}")


# -- the backend ---------------------------------------------------------------------------------

def _import_obstore():
    """obstore, imported on first use; ImportError saying how to install it otherwise."""
    try:
        import obstore
        import obstore.store  # noqa: F401 - the store classes
    except ImportError as exc:
        raise ImportError(f"backend 'obstore' needs the package obstore, which is not "
                          f"installed ({exc}); {INSTALL_HINT}") from None
    version = tuple(int(p) for p in re.findall(r"\d+", obstore.__version__)[:2])
    if version < _MIN_VERSION:
        raise ImportError(f"backend 'obstore' needs obstore >= 0.12, not "
                          f"{obstore.__version__}; {INSTALL_HINT} --upgrade")
    return obstore


class ObstoreBackend(Backend):
    """A tier on S3, GCS or Azure blob storage through obstore, with manifest-last commits."""

    options = (
        Option("url", str, required=True, expand=True, check=url_problem,
               description="where the tier lives: s3://bucket/run-7, gs://bucket/run-7 or "
                           "az://container/run-7 (may use {node})"),
        Option("options", dict, default={}, secret=True, check=options_problem,
               description="store options in fsspec's terms (endpoint_url, key/secret, token, "
                           "account_name/account_key, connection_string, ...) or obstore's "
                           "own; credentials: use {env = \"NAME\"}"),
        *OBJECT_STORE_OPTIONS,
    )
    default_commit = "manifest-last"
    supports_rename = False
    bulk_upload = True
    durable = True
    locks_write = True  # leases (plugins/leases.py)

    def __init__(self, root: str, url: str | None = None, options: dict | None = None,
                 concurrency: int = 16, part_mib: int = 16, max_attempts: int = 6,
                 retry_seconds: float = 120, lease_seconds: float = 120):
        self.url = self.root = url or root
        options = dict(options or {})
        # Longest first, so that a secret containing another one is replaced whole.
        self._secrets = sorted(set(secrets_in(options)), key=len, reverse=True)
        self.concurrency = concurrency
        self.part_size = part_mib << 20
        self.policy = RetryPolicy(max_attempts=max_attempts, max_seconds=float(retry_seconds))
        self.leases = LeaseKeeper(float(lease_seconds), self.write_bytes, self.delete)
        try:
            self.location = split_url(self.url)
            self._config = store_config(self.location, options)
        except ValueError as exc:
            raise ConfigError(f"backend 'obstore': url {self.describe()} {exc}") from None
        except Unmappable as exc:
            raise ConfigError(self._unmappable(exc)) from None
        self._obstore = _import_obstore()
        # The store every transfer uses, made now: a config obstore refuses is a ConfigError
        # when the tier is built. The one with a short connect timeout is made on first use.
        self._store = self._make_store(self._config.client)
        self._foreground_store: Any = None
        self._making = threading.Lock()
        self._pool = LazyPool(self.concurrency, "tierstore-obstore")

    # -- construction ------------------------------------------------------------------------
    def _unmappable(self, exc: Unmappable) -> str:
        return (f"backend 'obstore' at {self.describe()}: {exc} (options are written as for "
                f"fsspec's {FSSPEC_NAMES[self.location.kind]} or as obstore's "
                f"{STORE_NAMES[self.location.kind]} config keys; see docs/configuration.md)")

    def _make_store(self, client: dict) -> Any:
        """An obstore store for the tier's bucket and prefix, with ``client`` options and no
        retries of its own."""
        from obstore import store as stores

        loc, cfg = self.location, self._config
        cls = {"s3": stores.S3Store, "gcs": stores.GCSStore, "azure": stores.AzureStore}[loc.kind]
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=self.policy.max_seconds)}
        try:
            return cls(loc.bucket, prefix=loc.prefix or None, config=dict(cfg.config),
                       client_options=dict(client), retry_config=retry)
        except Exception as exc:  # noqa: BLE001 - obstore's refusal, said in the tier's terms
            text = self.redact(str(exc).split("\n\nDebug source:", 1)[0])
            unknown = re.search(r"[Cc]onfiguration key: '([^']+)'|Invalid key: (\w+)", text)
            if unknown:
                name = unknown.group(1) or unknown.group(2)
                where = cfg.origin.get(name) or cfg.origin.get(f"client.{name}") or name
                raise ConfigError(self._unmappable(Unmappable(
                    where, f"is neither an fsspec option this backend maps nor one of "
                           f"obstore's {STORE_NAMES[loc.kind]} config keys"))) from None
            raise ConfigError(f"backend 'obstore' at {self.describe()}: obstore refused the "
                              f"store's options ({type(exc).__name__}: {text})") from None

    def _current_store(self) -> Any:
        """The store for a call made now on this thread: the short-connect-timeout one inside
        calls that can do without the tier, else the one every transfer uses."""
        if not RetryPolicy.in_foreground():
            return self._store
        if self._foreground_store is None:
            with self._making:
                if self._foreground_store is None:
                    self._foreground_store = self._make_store(
                        dict(self._config.client, connect_timeout=_FOREGROUND_CONNECT))
        return self._foreground_store

    # -- helpers -----------------------------------------------------------------------------
    def redact(self, text: str) -> str:
        """``text`` with every credential from the options (and any signature in a URL)
        replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _SIGNED_QUERY.sub(r"\1=***", text)

    def describe(self) -> str:
        url = self.url
        if not url.lower().startswith(("abfs://", "abfss://")):  # container@account: no secret
            url = re.sub(r"//[^/@]*@", "//***@", url)  # user:password@ is a credential
        return self.redact(url)

    def __repr__(self) -> str:
        return f"ObstoreBackend({self.describe()!r})"

    def _key(self, path: str) -> str:
        # Untrusted (from a manifest or a listing): keys never climb out of the tier's prefix
        # (obstore's paths refuse '.' and '..' segments too).
        return confined(path, self.describe()).rstrip("/")

    def _call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (obstore calls), its failure raised as the Python exception it means."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - translated below
            if getattr(exc, _TRANSLATED, False) or isinstance(exc, TierstoreError):
                raise  # an inner call's, said already
            error = _translated(exc, self.redact)
        setattr(error, _TRANSLATED, True)
        # Raised outside the handler: obstore's own message (unredacted) is not its context.
        raise error

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        return with_retries(lambda: self._call(fn), self.policy,
                            f"{what} at {self.describe()}", self.redact)

    def read_pool(self) -> ThreadPoolExecutor:
        """Threads for concurrent ranged reads (obstore's calls release the GIL)."""
        return self._pool.get()

    # -- Backend primitives ------------------------------------------------------------------
    def check_reachable(self) -> str | None:
        # One GET of an object that is never written answers both questions (a missing bucket,
        # credentials it refuses) and writes nothing. Keys are flat: nothing beneath a bucket
        # can be "a file in the way".
        obs = self._obstore
        try:
            self._retry(lambda: obs.get(self._current_store(), _PROBE), "checking the tier")
        except FileNotFoundError as exc:
            if _NO_BUCKET.search(str(exc)):
                return (f"the bucket or container '{self.location.bucket}' does not exist; "
                        f"create it first (tierstore never creates buckets)")
            return None
        except PermissionError as exc:
            return (f"access denied ({exc}); check the credentials in the tier's options")
        except Exception as exc:
            if cannot_connect(exc):
                raise  # a dead server: the store opens with the tier marked unreachable
            return f"{type(exc).__name__}: {exc}"
        return None

    def open_write(self, path: str) -> IO[bytes]:
        return ObjectWriter(self, self._key(path))

    def open_read(self, path: str) -> IO[bytes]:
        size = self.size(path)
        if size is None:
            raise FileNotFoundError(f"{self.describe()}/{path} does not exist")
        return ObjectReader(self, self._key(path), size)

    def open_read_sized(self, path: str, size: int) -> IO[bytes]:
        """A reader of ``path`` trusting ``size`` (the manifest's): no HEAD before the reads. A
        shorter object fails its reads, a longer one its checksum."""
        return ObjectReader(self, self._key(path), size)

    def inventory(self, path: str) -> dict[str, int] | None:
        """Every object under ``path`` with its size, from one paginated listing."""
        return self._objects(path)

    def _objects(self, path: str) -> dict[str, int]:
        """The objects below ``path`` from one paginated listing, by key relative to it, with
        their sizes ({} when the prefix or the bucket holds none)."""
        key = self._key(path) if path else ""
        try:
            return self._retry(lambda: self._listing(key), "listing")
        except FileNotFoundError:
            return {}

    def _listing(self, key: str) -> dict[str, int]:
        """:meth:`_objects` of the (confined) prefix ``key``, asked once."""
        found = self._call(lambda: self._obstore.list(self._current_store(), key or None,
                                                      chunk_size=1000).collect())
        start = f"{key}/" if key else ""
        return {meta["path"][len(start):]: int(meta["size"]) for meta in found
                if meta["path"].startswith(start) and len(meta["path"]) > len(start)}

    def size(self, path: str) -> int | None:
        if not path:
            return None  # the root is a prefix, never an object
        obs, key = self._obstore, self._key(path)
        try:
            meta = self._retry(lambda: obs.head(self._current_store(), key),
                               "reading the size of an object")
        except FileNotFoundError:
            return None
        return int(meta["size"])

    def list(self, path: str) -> list[str]:
        # From the object keys below the prefix (one paginated listing): a "directory" only
        # exists while it holds objects.
        names = {key.split("/", 1)[0] for key in self._objects(path)}
        return sorted(n for n in names if n)

    def makedirs(self, path: str) -> None:
        """Nothing to make: "directories" are key prefixes."""

    def delete(self, path: str) -> None:
        obs, key = self._obstore, self._key(path) if path else ""

        def rm():
            # Listed again after each pass: an object deleted meanwhile by another process
            # stops a batch (GCS deletes one by one, Azure reports each missing blob).
            for _ in range(3):
                try:
                    below = self._listing(key)
                except FileNotFoundError:  # no bucket: nothing to delete
                    below = {}
                children = [f"{key}/{rel}" if key else rel for rel in below]
                if children:
                    try:
                        self._call(lambda: obs.delete(self._current_store(), children))
                    except FileNotFoundError:
                        continue
                break
            if key:
                try:
                    self._call(lambda: obs.delete(self._current_store(), key))
                except FileNotFoundError:
                    pass
        self._retry(rm, "deleting")

    def write_bytes(self, path: str, data: bytes) -> None:
        self._put(self._key(path), bytes(data))

    def _put(self, key: str, data: bytes) -> None:
        """One PUT of a whole small object, retried."""
        obs = self._obstore
        self._retry(lambda: obs.put(self._current_store(), key, data, use_multipart=False),
                    "writing an object")

    def read_bytes(self, path: str) -> bytes:
        obs, key = self._obstore, self._key(path)
        return self._retry(lambda: bytes(obs.get(self._current_store(), key).bytes()),
                           "reading an object")

    # -- bulk transfers (the drain uses them) ------------------------------------------------
    def put_files(self, pairs: list[tuple[str, str]], sizes: dict[str, int]) -> None:
        """Upload local files ``(local path, relative path)`` a quarter of ``concurrency`` at a
        time, each large one as a multipart upload with the rest of ``concurrency`` in parts
        in flight; a retry after a transient failure uploads only the objects that are not
        complete yet. ``sizes``: expected size by relative path."""
        obs = self._obstore
        files = max(1, self.concurrency // 4)
        parts = max(1, self.concurrency // files)
        todo = [(local, self._key(rel), rel) for local, rel in pairs]
        tried = False

        def upload(item: tuple[str, str, str]) -> None:
            local, key, _ = item
            self._call(lambda: obs.put(self._store, key, Path(local), chunk_size=self.part_size,
                                       max_concurrency=parts))

        def attempt():
            nonlocal todo, tried
            if tried:
                todo = [item for item in todo if self._size_or_none(item[2]) != sizes[item[2]]]
            tried = True
            if len(todo) == 1:
                upload(todo[0])
            elif todo:
                with ThreadPoolExecutor(max_workers=min(files, len(todo)),
                                        thread_name_prefix="tierstore-obstore-put") as ex:
                    for done in [ex.submit(upload, item) for item in todo]:
                        done.result()
        self._retry(attempt, f"uploading {len(pairs)} files")

    def _size_or_none(self, path: str) -> int | None:
        try:
            meta = self._call(lambda: self._obstore.head(self._store, self._key(path)))
        except Exception:  # noqa: BLE001 - unknown while the store is unreachable: upload again
            return None
        return int(meta["size"])

    def read_ranges(self, key: str, starts: list[int], ends: list[int]) -> list[memoryview]:
        """Byte ranges ``[starts[i], ends[i])`` of object ``key`` (already confined), fetched
        concurrently, one request each (obstore's ``get_ranges`` would merge adjacent ranges
        into one request), as views of the buffers obstore returned (no copy)."""
        obs = self._obstore

        def fetch() -> list[bytes]:
            store = self._current_store()  # the caller's (the pool's threads are not in
            # foreground when the caller is)

            def one(start: int, end: int) -> memoryview:
                if end <= start:
                    return memoryview(b"")
                return memoryview(obs.get_range(store, key, start=start, end=end))
            if len(starts) == 1:
                return [one(starts[0], ends[0])]
            return list(self.read_pool().map(one, starts, ends))
        return self._retry(fetch, "reading byte ranges")

    # -- ownership of work in progress (no file locks here: leases) --------------------------
    def lock_directory(self, path: str, *, exclusive: bool) -> DirectoryLock | None:
        """Shared: a lease on prefix ``path``, renewed while held (plugins/leases.py).
        Exclusive (gc, keep): granted unless some writer's lease on ``path`` is current."""
        return lock_by_leases(self, self.leases, path, exclusive=exclusive)

    def close(self) -> None:
        self.leases.close()
        self._pool.shutdown()


class ObjectWriter(io.RawIOBase):
    """A new object, written as a stream: up to one part (``part_mib``) it is held here and
    sent in one PUT at ``close()`` (retried); past that it becomes a multipart upload, its
    parts sent as they fill, several at once. Leaving a ``with`` block on an exception
    publishes nothing (the multipart upload is aborted)."""

    def __init__(self, backend: ObstoreBackend, key: str):
        super().__init__()
        self._b, self._key = backend, key
        self._buf = bytearray()
        self._stream: Any = None  # obstore's writer, once the object outgrows one part

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._stream is None:
            self._buf += view
            if len(self._buf) > self._b.part_size:
                b, obs = self._b, self._b._obstore
                self._stream = b._call(lambda: obs.open_writer(
                    b._store, self._key, buffer_size=b.part_size,
                    max_concurrency=max(1, b.concurrency // 4)))
                pending, self._buf = self._buf, bytearray()
                b._call(lambda: self._stream.write(pending))
        else:
            self._b._call(lambda: self._stream.write(view))
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._stream is not None:
                self._b._call(self._stream.close)
            else:
                self._b._put(self._key, bytes(self._buf))
        finally:
            self._buf = bytearray()
            super().close()

    def discard(self) -> None:
        """Close without publishing anything."""
        if self.closed:
            return
        if self._stream is not None:
            try:  # obstore's writer aborts its multipart upload when its block fails
                self._stream.__exit__(RuntimeError, RuntimeError("discarded"), None)
            except Exception as exc:  # noqa: BLE001 - nothing was published either way
                log.debug("aborting the upload of %s: %s", self._key,
                          self._b.redact(str(exc).split("\n\nDebug source:", 1)[0]))
        self._buf = bytearray()
        super().close()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()

    def __del__(self) -> None:
        # A writer dropped without close() was abandoned: publish none of it.
        try:
            self.discard()
        except Exception:  # noqa: BLE001 - at garbage collection
            pass


@hookimpl
def tierstore_register_backends(register):
    register("obstore", ObstoreBackend)
