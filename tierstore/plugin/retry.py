"""Retries for remote storage: transient failures (5xx, throttling, dropped or refused
connections, timeouts) are retried with exponential backoff and full jitter, bounded in attempts
and in total time; permanent ones (access denied, missing bucket or object, bad arguments) fail
at once."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from tierstore.errors import TierstoreError

__all__ = ["RetryPolicy", "is_transient", "with_retries", "GaveUp"]

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
    out (``GaveUp`` naming ``what``, the attempts and the last cause)."""
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
            wait = policy.delay(attempt)
            if attempt >= policy.max_attempts or elapsed + wait > policy.max_seconds:
                raise GaveUp(
                    f"{what} failed {attempt} times over {elapsed:.1f} s, the last time with "
                    f"{type(exc).__name__}: {redact(str(exc))}; the storage is unreachable or "
                    f"overloaded (retry limits: [tier] max_attempts, retry_seconds)"
                ) from None
            log.warning("%s failed (%s: %s); retry %d in %.2f s", what, type(exc).__name__,
                        redact(str(exc)), attempt, wait)
            time.sleep(wait)
