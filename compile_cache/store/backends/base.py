"""Object storage under a store URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://``).

One small interface, :class:`ObjectBackend` (list, get, download, put, put_if_absent, delete),
each implementation a :class:`RetryingBackend`: :class:`~.fsspec_backend.FsspecBackend`, over
fsspec for any protocol, and small standard-library clients (:mod:`.rest`) for ``s3://`` with
plain keys (:class:`~compile_cache.store.backends.s3.S3Backend`), ``gs://`` with an emulator, a
token or the metadata server (:mod:`.gcs`) and ``az://`` with a key or SAS (:mod:`.azure`): no
s3fs/botocore, gcsfs/google-auth or adlfs/Azure SDK import, a fresh node's first request 0.6
to 0.8 s sooner. :func:`~compile_cache.store.backends.clients.open_backend` is the one
place that chooses, and says so in the debug log. fsspec and its protocol package (``s3fs``, ``gcsfs``, ``adlfs``:
``pip install compile-cache[s3]``) are imported only when a URL needs them, so the base install
stays small.

Every call gets a bounded retry with backoff (``COMPILE_CACHE_REMOTE_RETRIES``, a timeout of
``COMPILE_CACHE_REMOTE_TIMEOUT`` per request where the protocol has one), except an error whose
``retryable`` attribute is False (a 400 or 403: no later try succeeds), raised at once; a call
that still fails raises :class:`RemoteError`, and for a short while after that every call fails at once (a
store that is down does not cost each of a job's calls a timeout). A missing object is not a
fault: :meth:`get` returns None. Credentials come from the protocol's usual chain (environment,
profile, instance role); nothing here reads, logs or stores them, and :func:`redact` drops any
``user:password@`` part of a URL before it is shown.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any, Protocol, TypeVar

from ... import config
from ...errors import StoreError
from ...redact import one_line, redact

__all__ = [
    "ClientStartError", "ObjectBackend", "ObjectInfo", "RemoteError", "RetryingBackend", "TooLargeError",
    "describe_fault", "is_url", "out_of_reach", "redact", "run_within",
]

logger = logging.getLogger("compile_cache")

_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: Seconds every call fails at once after one has failed all its retries.
DOWN_FOR = 30.0
#: First backoff; doubled after each failed try.
BACKOFF = 0.2
T = TypeVar("T")


class RemoteError(StoreError):
    """The object store could not be reached or refused us (timeout, 5xx, auth), after retries.

    ``answered``: whether the endpoint answered the last try (any HTTP status: True; no such
    name, refused, no answer in time: False; None when no request went out: the client could not
    start, or the store failed a moment ago). ``fault``: that try's fault in a few words, as
    doctor shows it (:func:`describe_fault`)."""

    def __init__(self, message: str, *, answered: bool | None = None, fault: str = "") -> None:
        super().__init__(message)
        self.answered = answered
        self.fault = fault


class ClientStartError(Exception):
    """The store's client could not be made (a protocol package that refuses its configuration,
    as adlfs without credentials): no request went out, and none will; not retried."""

    retryable = False


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps (``__cause__``, ``__context__``, and the ``os_error`` or
    ``error`` attribute aiohttp's and botocore's connection errors keep), a few levels deep."""
    out, todo = [], [exc]
    while todo and len(out) < 8:
        here = todo.pop(0)
        if here is None or any(here is seen for seen in out) or not isinstance(here, BaseException):
            continue
        out.append(here)
        todo.extend([here.__cause__, here.__context__, getattr(here, "os_error", None),
                     getattr(here, "error", None)])
    return out


def _timeout(cause: BaseException) -> bool:
    return isinstance(cause, (TimeoutError, socket.timeout)) or type(cause).__name__ in (
        "TimeoutError", "ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError", "FSTimeoutError",
        "ConnectTimeout", "ReadTimeout")


#: A protocol package's "no credentials anywhere" errors (botocore, google-auth): no retry finds any.
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"})


def out_of_reach(exc: BaseException) -> bool:
    """Whether a failed try says the endpoint is out of reach rather than passing trouble: no
    such name, nothing listening, no answer in time, a client that cannot start or that has
    no credentials."""
    return isinstance(exc, ClientStartError) or any(
        isinstance(c, (socket.gaierror, ConnectionRefusedError)) or _timeout(c)
        or type(c).__name__ in _NO_CREDENTIALS for c in _causes(exc))


def describe_fault(exc: BaseException, seconds: float) -> tuple[bool | None, str]:
    """(whether the endpoint answered, the fault in a few words) of a failed try: what doctor
    shows of a store that does not work. ``seconds``: the try's time limit."""
    if isinstance(exc, ClientStartError):
        return None, str(exc)
    for cause in _causes(exc):
        status = getattr(cause, "status", None) or getattr(cause, "status_code", None) or getattr(cause, "code", None)
        if isinstance(status, int) and 100 <= status < 600:
            code = getattr(cause, "code", None)
            return True, f"HTTP {status}" + (f" {one_line(code, 64)}" if isinstance(code, str) and code else "")
        response = getattr(cause, "response", None)  # botocore's ClientError
        if isinstance(response, dict) and isinstance(response.get("ResponseMetadata"), dict):
            code = (response.get("Error") or {}).get("Code")
            return True, (f"HTTP {response['ResponseMetadata'].get('HTTPStatusCode', '?')}"
                          + (f" {one_line(code, 64)}" if isinstance(code, str) and code else ""))
    for cause in _causes(exc):
        if isinstance(cause, socket.gaierror):
            return False, "its host name does not resolve"
        if isinstance(cause, ConnectionRefusedError):
            return False, "the connection was refused (nothing listens there)"
    for cause in _causes(exc):
        if _timeout(cause):
            return False, f"no answer within {seconds:g} s"
        if isinstance(cause, (ConnectionError, OSError)) and not isinstance(cause, FileNotFoundError):
            return False, f"no connection: {type(cause).__name__}: {one_line(cause, 200)}"
    return None, f"{type(exc).__name__}: {one_line(exc, 200)}"


def run_within(fn: Callable[[], T], seconds: float, what: str) -> T:
    """``fn()`` on a daemon thread, waited for at most ``seconds``: TimeoutError after that (the
    thread is left to end on its own; what it does then is not used). For a client whose calls
    have no deadline of their own (a protocol package's retry loop, its credential lookups)."""
    box: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # raised in the caller's thread below
            box.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="compile-cache-bounded", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"{what}: no answer within {seconds:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def is_url(location: object) -> bool:
    """Whether ``location`` names object storage (``scheme://...``) rather than a directory."""
    return isinstance(location, str) and _URL_RE.match(location.strip()) is not None


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its size and, where the backend says, its modification time."""

    size: int
    mtime: float = 0.0


class ObjectBackend(Protocol):
    """What the store needs from object storage; names are relative to the store's URL."""

    url: str
    #: Which client serves the URL, as doctor and the debug log show it.
    client: str
    #: Why that client (set by :func:`~.clients.open_backend`; doctor shows it).
    why: str

    def list(self, prefix: str) -> dict[str, ObjectInfo]: ...
    def get(self, name: str, limit: int) -> bytes | None: ...
    def download(self, name: str, out: IO[bytes], limit: int) -> int: ...
    def head(self, name: str, n: int) -> bytes: ...
    def put(self, name: str, data: bytes) -> None: ...
    def put_file(self, name: str, path: str) -> None: ...
    def put_if_absent(self, name: str, data: bytes) -> bool: ...
    def delete(self, names: Iterable[str]) -> None: ...


class RetryingBackend:
    """The fault semantics every backend shares: bounded retries with backoff, then
    :class:`RemoteError`, then fail-fast for :data:`DOWN_FOR` seconds.

    Before the endpoint has answered once (any HTTP status) in this process, a try that finds
    it out of reach (:func:`out_of_reach`: no such name, refused, no answer in time, a client
    that cannot start) is not tried again: a store that is misconfigured or out of reach costs
    a job's start one ``COMPILE_CACHE_REMOTE_FIRST_TIMEOUT`` (:meth:`limit`), not (1 + retries)
    timeouts and their backoff. Once it has answered, a fault is retried as configured (a store
    that works has passing faults)."""

    client = "?"
    why = ""
    #: Where requests go, as shown (never a credential): set by each client.
    endpoint = "?"
    #: Whether a store may call it from several threads at once (a fetch's pack downloads side
    #: by side): the standard-library clients, whose calls import nothing and hold one
    #: connection per thread; not fsspec's (a protocol package may import on first use).
    parallel = False

    def preload(self) -> None:
        """Import now what a request may import on first use, so that a thread making requests
        later imports nothing (only for a backend that is :attr:`parallel`)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.attempts = 1 + int(config.REMOTE_RETRIES.value())
        self.timeout = float(config.REMOTE_TIMEOUT.value())
        #: The limit of a try before the endpoint has answered (``COMPILE_CACHE_REMOTE_FIRST_TIMEOUT``).
        self.first_timeout = float(config.REMOTE_FIRST_TIMEOUT.value())
        #: Whether the endpoint has answered a request of this process (see the class docstring).
        self.answered = False
        self._down_until = 0.0
        self._down_fault: tuple[bool | None, str] = (None, "")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"

    def limit(self) -> float:
        """The seconds a try may take now: ``COMPILE_CACHE_REMOTE_TIMEOUT``, and before the
        endpoint has answered this process at most ``COMPILE_CACHE_REMOTE_FIRST_TIMEOUT`` (a
        job's start waits that long for a store that is not there, then compiles)."""
        return self.timeout if self.answered else min(self.timeout, self.first_timeout)

    def _attempt(self, fn: Callable[[], T]) -> T:
        """One try of a call (a client whose calls have no deadline of their own bounds it here)."""
        return fn()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` with bounded retries and backoff; a missing object is not retried."""
        if time.monotonic() < self._down_until:
            answered, fault = self._down_fault
            raise RemoteError(f"{redact(self.url)} is unreachable (a call failed less than "
                              f"{DOWN_FOR:g} s ago: {fault}); {what} skipped", answered=answered, fault=fault)
        delay = BACKOFF
        for attempt in range(self.attempts):
            seconds = self.limit()
            try:
                result = self._attempt(fn)
                self.answered = True
                return result
            except (FileNotFoundError, TooLargeError):
                self.answered = True
                raise
            except Exception as exc:  # timeouts, 5xx, auth errors: every backend raises its own
                last = exc
                answered, fault = describe_fault(exc, seconds)
                self.answered = self.answered or bool(answered)
                if getattr(exc, "retryable", True) is False:  # a 400/403: no later try succeeds
                    logger.debug("compile cache %s: %s failed, not retried: %s: %s", redact(self.url),
                                 what, type(exc).__name__, exc)
                    raise RemoteError(f"{redact(self.url)}: {what} failed: {type(exc).__name__}: "
                                      f"{one_line(exc)}", answered=answered, fault=fault) from None
                logger.debug("compile cache %s: %s failed (try %d of %d): %s: %s", redact(self.url),
                             what, attempt + 1, self.attempts, type(exc).__name__, exc)
                if not self.answered and out_of_reach(exc):  # not worth another timeout (class docstring)
                    break
                if attempt + 1 < self.attempts:
                    time.sleep(delay)
                    delay *= 2
        self._down_until = time.monotonic() + DOWN_FOR
        self._down_fault = (answered, fault)
        if attempt + 1 < self.attempts:
            tries = "at its first try, not retried: the store has not answered this process yet"
        else:
            tries = f"after {attempt + 1} tries" if attempt else "at its only try"
        raise RemoteError(f"{redact(self.url)}: {what} failed {tries}: "
                          f"{type(last).__name__}: {one_line(last)}", answered=answered, fault=fault) from None

    def _bounded_get(self, name: str, limit: int, fetch: Callable[[], bytes]) -> bytes | None:
        """``fetch()`` (the object ``name``, at most ``limit`` + 1 bytes of it) with retries:
        None if it does not exist, :class:`RemoteError` if it is over ``limit`` (every
        backend's ``get``, one rule)."""
        try:
            data: bytes | None = self._call(f"reading {name}", fetch)
        except FileNotFoundError:
            return None
        except TooLargeError:
            data = None
        if data is None or len(data) > limit:
            raise RemoteError(f"{redact(self.url)}/{name} is larger than {limit} bytes")
        return bytes(data)


class TooLargeError(Exception):
    """An object over the pack size limit: refused before (or while) it is read."""

    def __init__(self, size: int) -> None:
        super().__init__(f"object of {size} bytes is over the pack size limit")


def copy_bounded(read: Callable[[int], bytes], out: IO[bytes], limit: int, size: int | None) -> int:
    """Copies an object's body from ``read`` into ``out`` chunk by chunk; returns its length.
    :class:`TooLargeError` once it passes ``limit`` bytes (or when its announced ``size`` does),
    OSError when it ends before ``size``: both backends' downloads, one rule."""
    from ..pack import CHUNK

    if size is not None and size > limit:
        raise TooLargeError(size)
    total = 0
    while True:
        chunk = read(CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > limit:
            raise TooLargeError(total)
        out.write(chunk)
    if size is not None and total != size:
        raise OSError(f"short read: {total} of {size} bytes")
    return total
