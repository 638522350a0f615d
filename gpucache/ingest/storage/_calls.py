"""Calls to the storage service, retried: which failures may go away (``transient``: network
errors, timeouts, HTTP 5xx, 429 and S3's SlowDown), the backoff between attempts (full jitter),
``retrying`` (bounded in count, ``RETRIES``, and in time, ``DEADLINE_S``), and ``call``: a
listing or read call retried so, whose failure is then a clear error naming the URL. The fetch
(``_fetch.py``) retries each part of an object by the same rules.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..._errors import ObjectStoreError
from ._client import access_error, describe, error_code, filesystem, redact, strip

T = TypeVar("T")

log = logging.getLogger(__name__)

RETRIES = 5  # retries of a transient failure (6 attempts in all)...
DEADLINE_S = 300.0  # ...within this many seconds of a part's first attempt
BACKOFF_S, BACKOFF_CAP_S = 0.25, 8.0  # full jitter: uniform(0, min(cap, base * 2**attempt))

_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "ServerBusy",
    "OperationTimedOut",
}
_TRANSIENT_NAMES = {  # exception types (by name: no client library is imported for this)
    "ConnectionError",
    "ConnectionResetError",
    "ConnectionRefusedError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "TimeoutError",
    "timeout",
    "IncompleteRead",
    "FSTimeoutError",
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerTimeoutError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ResponseStreamingError",
    "HTTPClientError",
    "ResponseParserError",
    "TransportError",
}


def transient(err: BaseException) -> bool:
    """Whether a failure may go away on retry (network, timeouts, 5xx, throttling)."""
    code, status = error_code(err)
    if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
        return True
    if status or isinstance(err, (PermissionError, FileNotFoundError)):
        return False  # a 4xx: denied, missing, bad request
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in _TRANSIENT_NAMES or isinstance(e, (ConnectionError, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def backoff(attempt: int) -> float:
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_S * 2**attempt))


def retrying(fn: Callable[[], T], stop: threading.Event | None = None) -> T:
    """``fn()``, retried on transient failures (bounded in count and time, jittered backoff)."""
    start, attempt = time.monotonic(), 0
    while True:
        try:
            return fn()
        except Exception as err:
            if (
                not transient(err)
                or attempt >= RETRIES
                or time.monotonic() - start > DEADLINE_S
                or (stop is not None and stop.is_set())
            ):
                raise
            log.debug("gpucache: retrying after %s", describe(err))
        delay = backoff(attempt)
        attempt += 1
        if stop is not None:
            stop.wait(delay)  # a backoff, cut short when the build stops
        else:
            time.sleep(delay)  # a backoff between attempts, bounded by DEADLINE_S


def call(url: str, fn: Callable[[], T], what: str = "list") -> T:
    """``fn()``, retried on transient errors as a GET is (``retrying``). A denied or
    missing bucket is a clear error; a missing object stays a ``FileNotFoundError``; any other
    failure, after its retries, an :class:`ObjectStoreError` naming ``url`` (a listing that
    cannot be had stops the build: a store never lacks what could not be listed)."""
    try:
        return retrying(fn)
    except ObjectStoreError:
        raise
    except Exception as err:
        clear = access_error(url, err, what)
        if clear is not None:
            raise clear from None
        if isinstance(err, FileNotFoundError):
            raise
        tried = f", still failing after {RETRIES + 1} attempts" if transient(err) else ""
        raise ObjectStoreError(
            f"cannot {what} {redact(url)}: {describe(err)}{tried}; no store was published. "
            "Check the endpoint and the service's status, then build again",
            url,
        ) from err


def read_text(url: str, storage_options: dict[str, Any] | None) -> str:
    """A small text object (a CSV list), UTF-8."""
    fs = filesystem(url, storage_options)
    data: bytes = call(url, lambda: fs.cat_file(strip(url)), "read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{redact(url)} is not UTF-8 text ({err}); give a CSV in UTF-8") from None
