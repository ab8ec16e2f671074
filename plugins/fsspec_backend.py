"""Backend ``fsspec``: any fsspec URL — ``s3://``, ``gs://``, ``memory://``, ``file://``, ...

Built for object stores: nothing is ever renamed (a rename there is a full re-upload); a
checkpoint becomes visible when its manifest object is written, after every data object is
confirmed (commit protocol ``manifest-last``). Many files upload in parallel and large ones in
multipart parts; loads fetch each file with concurrent ranged reads. One filesystem instance
(and its event loop) serves every call. Transient failures are retried with backoff and jitter;
permanent ones fail at once. Credentials given in ``options`` never appear in messages.

A local directory (``file://``, or a path without a protocol) is another tier's directory on
the same machine, open to the same dangers as a ``local`` tier's: whoever can write it could
plant a checkpoint as a symbolic link to another tier's copy, which a ``keep`` here would then
delete. So its files are not handled by fsspec (whose local filesystem follows links when it
lists, reads, writes and deletes) but by the ``local`` backend's own code (:mod:`.safe_fs`,
:mod:`.ownership`): link-free below the root, and the way to the root checked at open and at
every use. Only the commit protocol (``manifest-last``) and the leases stay this backend's.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import known_implementations, registry

from tierstore.plugin import (Backend, cannot_connect, confined, DirectoryLock, hookimpl, Option,
                              RetryPolicy, with_retries)
from tierstore_plugins.leases import LeaseKeeper, lock_by_leases
from tierstore_plugins.local import LocalBackend, local_path_problem
from tierstore_plugins.object_reader import LazyPool, ObjectReader

log = logging.getLogger("tierstore.fsspec")

_SECRET_KEY = re.compile(r"key|secret|token|passw|credential|signature|auth|sas", re.I)
# What a file:// tier copies at a time from another tier's file (put_files).
_COPY_CHUNK = 8 << 20
# Connect timeout (s) of calls that can do without the tier (RetryPolicy.in_foreground(): queries,
# a load's search for copies, the health probe): a server that is there accepts at once.
_FOREGROUND_CONNECT_S = 0.5


def _secrets_in(options: Any) -> list[str]:
    """Values of option keys that look like credentials (any depth)."""
    found: list[str] = []
    if isinstance(options, dict):
        for k, v in options.items():
            if isinstance(v, str) and _SECRET_KEY.search(str(k)) and len(v) >= 4:
                found.append(v)
            else:
                found += _secrets_in(v)
    elif isinstance(options, (list, tuple)):
        for v in options:
            found += _secrets_in(v)
    return found


def _positive(v: Any) -> str | None:
    return None if v > 0 else f"must be positive, got {v}"


def _missing_implementation(protocol: str) -> str | None:
    """Why fsspec cannot serve ``protocol`` here (its package is not installed), found without
    importing that package; None when it can (or when only using it will tell)."""
    if protocol in registry:
        return None
    known = known_implementations.get(protocol)
    if known is None:
        try:
            fsspec.get_filesystem_class(protocol)  # an unknown protocol: fsspec says so
        except (ValueError, ImportError) as exc:
            return str(exc)
        return None
    module = known["class"].split(".", 1)[0]
    if importlib.util.find_spec(module) is None:
        return known.get("err") or f"the package {module} is not installed"
    return None


def _url_problem(url: str) -> str | None:
    """A local path (``file://`` or no protocol) must fit the local limits on names and paths."""
    protocol, path = fsspec.core.split_protocol(url)
    return local_path_problem(path) if protocol in (None, "file", "local") else None


#: the keys every object-store backend takes beside its ``url`` and ``options`` (transfers,
#: retries, leases): ``fsspec`` and ``obstore`` tiers are configured alike
OBJECT_STORE_OPTIONS = (
    Option("concurrency", int, default=16, check=_positive,
           description="objects or ranges transferred at once"),
    Option("part_mib", int, default=16, check=_positive,
           description="multipart part size and ranged-read size in MiB"),
    Option("max_attempts", int, default=6, check=_positive,
           description="tries per operation on transient failures"),
    Option("retry_seconds", (int, float), default=120, check=_positive,
           description="longest time spent retrying one operation"),
    Option("lease_seconds", (int, float), default=120, check=_positive,
           description="how long a writer's lease on a prefix lasts unrenewed: what a "
                       "killed writer left is collected this long (+60 s) after it died"),
)


class FsspecBackend(Backend):
    """A tier on any fsspec filesystem; for object stores, with manifest-last commits."""

    options = (
        Option("url", str, required=True, expand=True, check=_url_problem,
               description="where the tier lives, e.g. s3://bucket/run-7 (may use {node})"),
        Option("options", dict, default={}, secret=True,  # credentials: never echoed
               description="filesystem options (endpoint, credentials: use {env = \"NAME\"})"),
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
        self.url = url or root
        options = dict(options or {})
        # Longest first, so that a secret containing another option value is replaced whole.
        self._secrets = sorted(set(_secrets_in(options)), key=len, reverse=True)
        self.concurrency = concurrency
        self._read_pool = LazyPool(concurrency, "tierstore-fsspec")
        self.part_size = part_mib << 20
        self.policy = RetryPolicy(max_attempts=max_attempts, max_seconds=float(retry_seconds))
        self.leases = LeaseKeeper(float(lease_seconds), self.write_bytes, self.delete)
        protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        foreground_config = None
        if protocol in ("s3", "s3a"):
            # aiobotocore keeps 10 connections per client by default; let transfers use ours.
            # Its own retries (and s3fs's) would multiply ours: one policy, the tier's, governs
            # (botocore's "max_attempts" counts retries after the first: 1 meant two tries).
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("max_pool_connections", max(10, concurrency * 2))
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            config.setdefault("connect_timeout", 10)
            config.setdefault("read_timeout", 60)
            options["config_kwargs"] = config
            # A second client for calls that can do without the tier: the same but for a short
            # connect timeout, so that a dead host (no answer at all) is known in a second.
            foreground_config = dict(config, connect_timeout=min(config["connect_timeout"],
                                                                 _FOREGROUND_CONNECT_S))
        if protocol not in ("file", "local", "memory"):
            # A listing cached by the client may predate objects other processes (or this
            # one, from another thread) wrote since: sizes, existence and commit confirmation
            # must come from the store itself.
            options.setdefault("use_listings_cache", False)
        missing = _missing_implementation(protocol)
        if missing:
            raise ImportError(f"{self.describe()}: {missing}; install the extra for it, e.g. "
                              f"pip install 'tierstore[s3]' or 'tierstore[gcs]'")
        self._protocol, self._options, self._foreground_config = (protocol, options,
                                                                  foreground_config)
        # The filesystems are made on first use: importing an object store's client (s3fs
        # and botocore: about 0.2 s of CPU) and making its session is work a restarting rank
        # that never touches the tier (only one rank checks it and lists it) is spared.
        self._made: tuple[fsspec.AbstractFileSystem, fsspec.AbstractFileSystem | None,
                          str] | None = None
        self._making = threading.Lock()
        self.root = self.url
        self.is_local = protocol in ("file", "local")
        #: a local directory's files, handled as the ``local`` backend handles its own (see the
        #: module docstring); fsync on close, and every new entry fsynced too, since
        #: manifest-last syncs no directory and this backend says it is durable
        self._disk = (LocalBackend(LocalFileSystem._strip_protocol(self.url), fsync=True,
                                   sync_entries=True) if self.is_local else None)

    def _filesystems(self) -> tuple[fsspec.AbstractFileSystem,
                                    fsspec.AbstractFileSystem | None, str]:
        """The filesystem, the short-connect-timeout one (object stores), and the tier's root
        path in them, made on first use (once, whichever thread asks first)."""
        made = self._made
        if made is not None:
            return made
        with self._making:
            if self._made is None:
                options, protocol = self._options, self._protocol
                fs, path = fsspec.core.url_to_fs(self.url, **options)
                foreground = (None if self._foreground_config is None else fsspec.core.url_to_fs(
                    self.url, **dict(options, config_kwargs=self._foreground_config))[0])
                for one in (fs, foreground):
                    if protocol in ("s3", "s3a") and hasattr(one, "retries"):
                        one.retries = 1
                self._made = (fs, foreground, path.rstrip("/"))
            return self._made

    def prepare(self) -> None:
        """Import the object store's client and make its filesystems and session (no
        request), ahead of the first drain's copy."""
        if self._disk is not None:
            return
        fs, foreground, _ = self._filesystems()
        for one in (fs, foreground):
            if one is not None and hasattr(one, "set_session"):  # s3fs: its client, no request
                one.connect()

    @property
    def root_path(self) -> str:
        """The tier's root in its filesystem's terms (``bucket/prefix`` for an object store)."""
        return self._filesystems()[2]

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The filesystem for a call made now on this thread: the short-connect-timeout client
        inside calls that can do without the tier, else the one every transfer uses."""
        fs, foreground, _ = self._filesystems()
        if foreground is not None and RetryPolicy.in_foreground():
            return foreground
        return fs

    # -- helpers ---------------------------------------------------------------------------
    def redact(self, text: str) -> str:
        """``text`` with every credential from the options replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def describe(self) -> str:
        # user:password@ in a URL is a credential too
        return self.redact(re.sub(r"//[^/@]*@", "//***@", self.url))

    def _full(self, path: str) -> str:
        # Untrusted (from a manifest or a listing): keys never climb out of the tier's prefix.
        return f"{self.root_path}/{confined(path, self.describe())}" if path else self.root_path

    def _retry(self, fn, what: str):
        return with_retries(fn, self.policy, f"{what} at {self.describe()}", self.redact)

    # -- Backend primitives ----------------------------------------------------------------
    def check_reachable(self) -> str | None:
        if self._disk is not None:
            return self._disk.check_reachable()  # ownership of the way to the root included
        if "memory" in str(self.fs.protocol):
            return self._check_local_root()
        # An object store: one request, on the bucket, answers both questions (a missing
        # bucket, credentials it refuses). Nothing beneath a bucket can be "a file in the
        # way": keys are flat. (Listing the prefix here would be a LIST per open: the one
        # listing a restart makes is latest()'s.)
        bucket = self.root_path.split("/", 1)[0]
        try:
            info = self._retry(lambda: self.fs.info(bucket), "checking the tier")
        except PermissionError as exc:
            return (f"access denied ({self.redact(str(exc))}); check the credentials in the "
                    f"tier's options")
        except FileNotFoundError:
            return (f"the bucket or container '{bucket}' does not exist; create it first "
                    f"(tierstore never creates buckets)")
        except Exception as exc:  # unreachable endpoint after retries, bad options, ...
            if cannot_connect(exc):
                raise  # a dead server: the store opens with the tier marked unreachable
            return f"{type(exc).__name__}: {self.redact(str(exc))}"
        if info.get("type") == "file":
            return f"{bucket} is a file, so nothing can be stored beneath it"
        return None

    def _check_local_root(self) -> str | None:
        """:meth:`check_reachable` of an in-memory root: its nearest existing directory must
        be a directory."""
        probe = self.root_path
        try:
            while True:
                if self.fs.exists(probe):
                    if self.fs.info(probe).get("type") == "file":
                        return f"{probe} is a file, so nothing can be stored beneath it"
                    return None
                parent = self.fs._parent(probe).rstrip("/")
                if not parent or parent == probe or parent in ("", "/"):
                    return None
                probe = parent
        except Exception as exc:  # noqa: BLE001 - a sentence for the user
            return f"{type(exc).__name__}: {self.redact(str(exc))}"

    def open_write(self, path: str) -> IO[bytes]:
        if self._disk is not None:
            # As an object store does, a write makes the "directories" it needs.
            self._disk.makedirs(os.path.dirname(path.rstrip("/")))
            return self._disk.open_write(path)
        return self.fs.open(self._full(path), "wb", block_size=self.part_size)

    def open_read(self, path: str) -> IO[bytes]:
        if self._disk is not None:
            return self._disk.open_read(path)
        full = self._full(path)
        size = self.size(path)
        if size is None:
            raise FileNotFoundError(f"{self.describe()}/{path} does not exist")
        return ObjectReader(self, full, size)

    def open_read_sized(self, path: str, size: int) -> IO[bytes]:
        """A reader of ``path`` trusting ``size`` (the manifest's): no HEAD before the reads. A
        shorter object fails its reads, a longer one its checksum."""
        if self._disk is not None:
            return self.open_read(path)
        return ObjectReader(self, self._full(path), size)

    def inventory(self, path: str) -> dict[str, int] | None:
        """Every object under ``path`` with its size, from one paginated listing (object
        stores; None for a local filesystem, where a stat per file is cheap)."""
        if self.is_local or "memory" in str(self.fs.protocol):
            return None
        return {key: int(info.get("size") or 0) for key, info in self._objects(path).items()
                if info.get("type") != "directory"}

    def _objects(self, path: str) -> dict[str, dict]:
        """The objects below ``path`` from one paginated listing, by key relative to it (the
        client's cache bypassed: other processes write here)."""
        full = self._full(path).rstrip("/")
        self.fs.invalidate_cache(full)
        try:
            found = self._retry(lambda: self.fs.find(full, withdirs=False, detail=True),
                                "listing")
        except FileNotFoundError:
            return {}
        prefix = self.fs._strip_protocol(full).rstrip("/") + "/"
        return {key[len(prefix):]: info for key, info in found.items() if key.startswith(prefix)}

    def size(self, path: str) -> int | None:
        if self._disk is not None:
            return self._disk.size(path)
        full = self._full(path)
        try:
            info = self._retry(lambda: self.fs.info(full), "reading the size of an object")
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info["size"])

    def list(self, path: str) -> list[str]:
        if self._disk is not None:
            return self._disk.list(path)
        # From the object keys below the prefix (one paginated listing): a "directory" only
        # exists while it holds objects, even on stores that keep empty folders for a while.
        names = {key.split("/", 1)[0] for key in self._objects(path)}
        return sorted(n for n in names if n)

    def makedirs(self, path: str) -> None:
        if self._disk is not None:
            self._disk.makedirs(path)  # each new entry durable (sync_entries)

    def delete(self, path: str) -> None:
        if self._disk is not None:
            self._disk.delete(path)  # a link goes itself; the removal is durable
            return
        full = self._full(path)

        def rm():
            try:
                self.fs.rm(full, recursive=True)
            except FileNotFoundError:
                pass
        self._retry(rm, "deleting")
        self.fs.invalidate_cache(full)

    def sync_dir(self, path: str) -> None:
        if self._disk is not None:
            try:
                self._disk.sync_dir(path)
            except (FileNotFoundError, NotADirectoryError):
                pass  # nothing there to make durable

    def write_bytes(self, path: str, data: bytes) -> None:
        if self._disk is not None:
            with self.open_write(path) as f:  # fsynced, with its directory entry
                f.write(data)
            return
        full = self._full(path)
        self._retry(lambda: self.fs.pipe_file(full, data), "writing an object")

    def read_bytes(self, path: str) -> bytes:
        if self._disk is not None:
            return self._disk.read_bytes(path)
        full = self._full(path)
        # s3fs asks an object's size (a HEAD) before reading it whole, to split a large one
        # into concurrent ranges; the files read whole here are small (manifests, metadata).
        options = {"max_concurrency": 1} if "s3" in str(self.fs.protocol) else {}
        return self._retry(lambda: self.fs.cat_file(full, **options), "reading an object")

    # -- bulk transfers (the drain uses them when it can) -----------------------------------
    def put_files(self, pairs: list[tuple[str, str]], sizes: dict[str, int]) -> None:
        """Upload local files ``(local path, relative path)`` concurrently (s3fs: multipart,
        parts in parallel, for large ones); a retry after a transient failure uploads only the
        objects that are not complete yet. ``sizes``: expected size by relative path."""
        if self._disk is not None:
            self._copy_local_files(pairs)
            return
        todo = list(pairs)
        tried = False

        def attempt():
            nonlocal todo, tried
            if tried:
                todo = [(lp, r) for lp, r in todo if self._size_or_none(r) != sizes[r]]
            tried = True
            if todo:
                self.fs.put([lp for lp, _ in todo], [self._full(r) for _, r in todo],
                            **self._put_options())
        self._retry(attempt, f"uploading {len(pairs)} files")
        for _, rel in pairs:
            self.fs.invalidate_cache(self._full(rel))

    def _copy_local_files(self, pairs: list[tuple[str, str]]) -> None:
        """:meth:`put_files` into a local directory: each file copied into a file written as
        :meth:`open_write` writes one (link-free, fsynced with its entry)."""
        for local, rel in pairs:
            with open(local, "rb", buffering=0) as src, self.open_write(rel) as dst:
                shutil.copyfileobj(src, dst, _COPY_CHUNK)

    def _put_options(self) -> dict:
        """Bound what an upload holds in memory: files in flight x parts in flight x part
        size (s3fs would otherwise buffer 10 parts of 50 MiB for each of many files)."""
        files = max(1, self.concurrency // 4)
        options: dict[str, Any] = {"batch_size": files, "chunksize": self.part_size}
        if "s3" in str(self.fs.protocol):
            options["max_concurrency"] = max(1, self.concurrency // files)
        return options

    def _size_or_none(self, path: str) -> int | None:
        try:
            info = self.fs.info(self._full(path))
        except Exception:  # unknown while the store is unreachable: upload again
            return None
        return int(info.get("size", -1))

    def read_pool(self) -> ThreadPoolExecutor:
        """Threads that fetch the ranges a sequential read wants next (ObjectReader): each
        hands its request to the filesystem's event loop and waits for it."""
        return self._read_pool.get()

    def read_ranges(self, full: str, starts: list[int], ends: list[int]) -> list[bytes]:
        """Several byte ranges of one object, fetched concurrently."""
        def fetch():
            out = self.fs.cat_ranges([full] * len(starts), starts, ends,
                                     batch_size=self.concurrency, on_error="raise")
            return out
        return self._retry(fetch, "reading byte ranges")

    def local_path(self, path: str) -> str | None:
        # The local backend's: refused when a link leads out of the root, or when another
        # user could change the way to the root.
        return self._disk.local_path(path) if self._disk is not None else None

    # -- ownership of work in progress (no file locks here: leases) -------------------------
    def lock_directory(self, path: str, *, exclusive: bool) -> DirectoryLock | None:
        """Shared: a lease on prefix ``path``, renewed while held (plugins/leases.py).
        Exclusive (gc, keep): granted unless some writer's lease on ``path`` is current."""
        return lock_by_leases(self, self.leases, path, exclusive=exclusive)

    def close(self) -> None:
        self.leases.close()
        self._read_pool.shutdown()
        if self._disk is not None:
            self._disk.close()


@hookimpl
def tierstore_register_backends(register):
    register("fsspec", FsspecBackend)
