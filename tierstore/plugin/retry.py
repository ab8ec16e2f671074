"""Retries for remote storage: transient failures (5xx, throttling, dropped or refused
connections, timeouts) are retried with exponential backoff and full jitter, bounded in attempts
and in total time; permanent ones (access denied, missing bucket or object, bad arguments) fail
at once.

Calls that can do without their storage (``TierHealth.ask``: queries, a load's search for
copies; and its probe) run inside :func:`foreground`: there a storage that cannot be connected
to at all (refused, connect timeout, no route, unknown host) is given up on after one retry
(:data:`FOREGROUND`), so a dead server costs the caller a fraction of a second, not the tier's
whole budget; a server that answers, even with errors or throttling, keeps the tier's policy.
Everything else (a save into the tier, a drain to it) keeps the tier's policy in full."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from tierstore.errors import TierstoreError

__all__ = ["RetryPolicy", "is_transient", "with_retries", "GaveUp", "FOREGROUND", "foreground",
           "cannot_connect"]

log = logging.getLogger("tierstore.plugin.retry")
T = TypeVar("T")

_PERMANENT = (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError,
              NotADirectoryError, ValueError, TypeError, KeyError, NotImplementedError)
# Exception type names (anywhere in the class hierarchy) of client libraries that mean "try
# again": botocore's connection errors are not OSErrors, aiohttp's and requests' are wrapped.
_TRANSIENT_NAMES = ("EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError",
                    "ReadTimeoutError", "ResponseStreamingError", "ServerDisconnectedError",
                    "ClientConnectorError", "ClientOSError", "ClientPayloadError",
                    "TransportError", "ConnectionError")
_TRANSIENT_WORDS = ("slowdown", "slow down", "throttl", "too many requests", "503", "500", "502",
                    "504", "internalerror", "service unavailable", "timed out", "timeout",
                    "connection reset", "connection refused", "temporarily")
# Failures before any byte reached the server (nothing there to answer): aiohttp's, botocore's
# (a refused or timed-out connect becomes EndpointConnectionError / ConnectTimeoutError),
# requests'/urllib3's.
_NO_CONNECTION_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                        "ConnectionTimeoutError", "ConnectTimeout", "NewConnectionError")


class GaveUp(TierstoreError, OSError):
    """A transient failure that outlasted the retry policy (an OSError too, so code that
    falls back on I/O errors treats it as one)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep trying: at most ``max_attempts`` calls and ``max_seconds`` in all;
    waits grow from ``base_delay`` by doubling up to ``max_delay``, each drawn uniformly below
    that bound (full jitter, so many ranks retrying do not stampede together)."""

    max_attempts: int = 6
    max_seconds: float = 120.0
    base_delay: float = 0.2
    max_delay: float = 10.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))

    @staticmethod
    def in_foreground() -> bool:
        """Whether the calling thread runs calls that can do without their storage
        (:func:`foreground`): a backend may then use a shorter connect timeout."""
        return getattr(_mode, "foreground", 0) > 0


#: The budget inside :func:`foreground` for a storage that cannot be connected to (beside the
#: tier's own, whichever ends first): one retry, soon (a server that is there accepts at once).
FOREGROUND = RetryPolicy(max_attempts=2, max_seconds=1.0, base_delay=0.1, max_delay=0.2)

_mode = threading.local()


@contextlib.contextmanager
def foreground() -> Iterator[None]:
    """Calls made by this thread inside the block can do without their storage (the caller
    goes on without the tier): one that cannot connect is given up on per :data:`FOREGROUND`
    instead of the tier's policy. Other threads (drains) are not affected."""
    _mode.foreground = getattr(_mode, "foreground", 0) + 1
    try:
        yield
    finally:
        _mode.foreground -= 1


def cannot_connect(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it wraps) says no connection to the storage could be made."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ConnectionRefusedError, socket.gaierror)):
            return True
        if {cls.__name__ for cls in type(exc).__mro__}.intersection(_NO_CONNECTION_NAMES):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying."""
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError, GaveUp)):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names.intersection(_TRANSIENT_NAMES):
        return True
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(code, int):
        return code == 429 or code >= 500
    text = str(exc).lower()
    if isinstance(exc, OSError) or "HttpError" in names:
        return any(word in text for word in _TRANSIENT_WORDS) or isinstance(exc, OSError)
    return False


def with_retries(fn: Callable[[], T], policy: RetryPolicy, what: str,
                 redact: Callable[[str], str] = lambda s: s) -> T:
    """Call ``fn`` until it succeeds, a permanent error occurs (raised as is) or the policy runs
    out (``GaveUp`` naming ``what``, the attempts and the last cause); inside
    :func:`foreground`, a failure to connect at all ends it per :data:`FOREGROUND`."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except BaseException as exc:
            if not isinstance(exc, Exception) or not is_transient(exc):
                raise
            attempt += 1
            elapsed = time.monotonic() - started
            quick = RetryPolicy.in_foreground() and cannot_connect(exc)
            wait = (FOREGROUND if quick else policy).delay(attempt)
            if any(attempt >= p.max_attempts or elapsed + wait > p.max_seconds
                   for p in ((policy, FOREGROUND) if quick else (policy,))):
                raise GaveUp(
                    f"{what} failed {attempt} times over {elapsed:.1f} s, the last time with "
                    f"{type(exc).__name__}: {redact(str(exc))}; "
                    + ("the storage cannot be connected to (a call that can do without it "
                       "does not wait for it)" if quick else
                       "the storage is unreachable or overloaded (retry limits: [tier] "
                       "max_attempts, retry_seconds)")
                ) from exc
            log.warning("%s failed (%s: %s); retry %d in %.2f s", what, type(exc).__name__,
                        redact(str(exc)), attempt, wait)
            time.sleep(wait)
