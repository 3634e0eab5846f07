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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Protocol, TypeVar

from ... import config
from ...errors import StoreError
from ...redact import one_line, redact

__all__ = [
    "ObjectBackend", "ObjectInfo", "RemoteError", "RetryingBackend", "TooLargeError", "is_url",
    "redact",
]

logger = logging.getLogger("compile_cache")

_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
#: Seconds every call fails at once after one has failed all its retries.
DOWN_FOR = 30.0
#: First backoff; doubled after each failed try.
BACKOFF = 0.2
T = TypeVar("T")


class RemoteError(StoreError):
    """The object store could not be reached or refused us (timeout, 5xx, auth), after retries."""


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
    :class:`RemoteError`, then fail-fast for :data:`DOWN_FOR` seconds."""

    client = "?"
    why = ""
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
        self._down_until = 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url)!r})"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` with bounded retries and backoff; a missing object is not retried."""
        if time.monotonic() < self._down_until:
            raise RemoteError(f"{redact(self.url)} is unreachable (a recent {what} failed); skipped")
        delay = BACKOFF
        for attempt in range(self.attempts):
            try:
                return fn()
            except (FileNotFoundError, TooLargeError):
                raise
            except Exception as exc:  # timeouts, 5xx, auth errors: every backend raises its own
                last = exc
                if getattr(exc, "retryable", True) is False:  # a 400/403: no later try succeeds
                    logger.debug("compile cache %s: %s failed, not retried: %s: %s", redact(self.url),
                                 what, type(exc).__name__, exc)
                    raise RemoteError(f"{redact(self.url)}: {what} failed: {type(exc).__name__}: "
                                      f"{one_line(exc)}") from None
                logger.debug("compile cache %s: %s failed (try %d of %d): %s: %s", redact(self.url),
                             what, attempt + 1, self.attempts, type(exc).__name__, exc)
                if attempt + 1 < self.attempts:
                    time.sleep(delay)
                    delay *= 2
        self._down_until = time.monotonic() + DOWN_FOR
        raise RemoteError(f"{redact(self.url)}: {what} failed after {self.attempts} tries: "
                          f"{type(last).__name__}: {one_line(last)}") from None

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
