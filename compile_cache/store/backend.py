"""Object storage under a store URL (``s3://bucket/prefix``, ``gs://``, ``az://``, ``memory://``).

One small interface, :class:`ObjectBackend` (list, get, download, put, put_if_absent, delete),
with two implementations: :class:`FsspecBackend`, over fsspec for any protocol, and for ``s3://``
with plain keys in the environment or a profile, :class:`~compile_cache.store.s3.S3Backend`, a
small standard-library client (no s3fs, aiobotocore or botocore import: a fresh node's first
request is 0.6 to 0.8 s sooner). :func:`~compile_cache.store.clients.open_backend` is the one
place that chooses, and says so in the debug log. fsspec and its protocol package (``s3fs``, ``gcsfs``, ``adlfs``:
``pip install compile-cache[s3]``) are imported only when a URL needs them, so the base install
stays small.

Every call gets a bounded retry with backoff (``COMPILE_CACHE_REMOTE_RETRIES``, a timeout of
``COMPILE_CACHE_REMOTE_TIMEOUT`` per request where the protocol has one); a call that still
fails raises :class:`RemoteError`, and for a short while after that every call fails at once (a
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
from typing import IO, Any, Protocol, TypeVar

from .. import config
from ..errors import StoreError
from ..redact import one_line, redact

__all__ = [
    "FsspecBackend", "ObjectBackend", "ObjectInfo", "RemoteError", "RetryingBackend", "TooLargeError", "is_url",
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

    def list(self, prefix: str) -> dict[str, ObjectInfo]: ...
    def get(self, name: str, limit: int) -> bytes | None: ...
    def download(self, name: str, out: IO[bytes], limit: int) -> int: ...
    def head(self, name: str, n: int) -> bytes: ...
    def put(self, name: str, data: bytes) -> None: ...
    def put_file(self, name: str, path: str) -> None: ...
    def put_if_absent(self, name: str, data: bytes) -> bool: ...
    def delete(self, names: Iterable[str]) -> None: ...


def _mtime(info: dict[str, Any]) -> float:
    for field in ("LastModified", "mtime", "created", "last_modified", "updated"):
        value = info.get(field)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


class RetryingBackend:
    """The fault semantics every backend shares: bounded retries with backoff, then
    :class:`RemoteError`, then fail-fast for :data:`DOWN_FOR` seconds."""

    client = "?"

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
                logger.debug("compile cache %s: %s failed (try %d of %d): %s: %s", redact(self.url),
                             what, attempt + 1, self.attempts, type(exc).__name__, exc)
                if attempt + 1 < self.attempts:
                    time.sleep(delay)
                    delay *= 2
        self._down_until = time.monotonic() + DOWN_FOR
        raise RemoteError(f"{redact(self.url)}: {what} failed after {self.attempts} tries: "
                          f"{type(last).__name__}: {one_line(last)}") from None


class FsspecBackend(RetryingBackend):
    """:class:`ObjectBackend` over fsspec (any protocol it knows)."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise StoreError(
                f"compile cache {redact(url)}: object storage needs fsspec and the protocol's "
                "package: pip install 'compile-cache[s3]' (gcsfs for gs://, adlfs for az://)"
            ) from None
        super().__init__(url)
        protocol = self.url.split("://", 1)[0].lower()
        self.client = "s3fs" if protocol in ("s3", "s3a") else f"fsspec ({protocol})"
        options: dict[str, Any] = {}
        if protocol in ("s3", "s3a"):
            # Our retries, not also the client's (a down store would cost retries squared).
            options = {"config_kwargs": {
                "connect_timeout": self.timeout, "read_timeout": self.timeout,
                "retries": {"max_attempts": 1}}}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except ImportError as exc:
            raise StoreError(f"compile cache {redact(url)}: {exc} (pip install 'compile-cache[s3]' for "
                             "s3://, gcsfs for gs://, adlfs for az://)") from None
        except (ValueError, TypeError) as exc:
            raise StoreError(f"compile cache {redact(url)}: not a usable store URL: {exc}") from None
        self.root = self.root.rstrip("/")
        if isinstance(getattr(self.fs, "retries", None), int):
            self.fs.retries = 1  # s3fs's own retry loop (ours is above it)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    # -- the interface -------------------------------------------------------------------------
    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object under ``prefix`` (recursive): its name (relative to the store's URL,
        like every name here) -> its info; empty if there is none."""
        base = self._path(prefix)

        def find() -> dict[str, Any]:
            try:
                return self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
        self.fs.invalidate_cache()
        found = self._call(f"listing {prefix or '/'}", find)
        out: dict[str, ObjectInfo] = {}
        root = self.root.lstrip("/") + "/"
        for path, info in found.items():
            name = path.lstrip("/")
            if info.get("type", "file") != "file" or not name.startswith(root):
                continue
            out[name[len(root):]] = ObjectInfo(int(info.get("size") or 0), _mtime(info))
        return out

    def get(self, name: str, limit: int) -> bytes | None:
        """The object ``name`` (at most ``limit`` bytes read), or None if it does not exist."""
        try:
            data = self._call(f"reading {name}", lambda: self.fs.cat_file(self._path(name), start=0, end=limit + 1))
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise RemoteError(f"{redact(self.url)}/{name} is larger than {limit} bytes")
        return bytes(data)

    def download(self, name: str, out: IO[bytes], limit: int) -> int:
        """Stream ``name`` into ``out`` in chunks, refusing more than ``limit`` bytes; returns
        its size. Raises FileNotFoundError if it is gone, :class:`TooLargeError` over the limit,
        RemoteError on a fault."""
        from .pack import CHUNK

        def stream() -> int:
            out.seek(0)
            out.truncate()
            with self.fs.open(self._path(name), "rb", block_size=CHUNK, cache_type="none") as fh:
                return copy_bounded(fh.read, out, limit, getattr(fh, "size", None))
        return self._call(f"downloading {name}", stream)

    def head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of ``name`` (one ranged read: a pack's header for a listing)."""
        return bytes(self._call(f"reading {name}", lambda: self.fs.cat_file(self._path(name), start=0, end=n)))

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (object stores make a put atomic: readers see old or new)."""
        self._call(f"writing {name}", lambda: self.fs.pipe_file(self._path(name), bytes(data)))

    def put_file(self, name: str, path: str) -> None:
        """Upload the local file ``path`` as ``name`` (streamed, multipart when large)."""
        self._call(f"uploading {name}", lambda: self.fs.put_file(path, self._path(name)))

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Write ``name`` unless it exists; False if it did. Uses a conditional put
        (``If-None-Match: *``) where the backend has one; elsewhere a check then a put, which is
        enough: the objects written this way are named by their content."""
        path = self._path(name)

        def conditional() -> bool:
            try:
                self.fs.pipe_file(path, bytes(data), mode="create")
                return True
            except FileExistsError:
                return False
            except (TypeError, NotImplementedError, ValueError):
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, bytes(data))
                return True
        self.fs.invalidate_cache()
        return self._call(f"writing {name}", conditional)

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache()
        return bool(self._call(f"checking {name}", lambda: self.fs.exists(self._path(name))))

    def delete(self, names: Iterable[str]) -> None:
        """Remove objects (a missing one is not an error)."""
        paths = [self._path(n) for n in names]
        if not paths:
            return

        def remove() -> None:
            for path in paths:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass
        self._call(f"deleting {len(paths)} object(s)", remove)


class TooLargeError(Exception):
    """An object over the pack size limit: refused before (or while) it is read."""

    def __init__(self, size: int) -> None:
        super().__init__(f"object of {size} bytes is over the pack size limit")


def copy_bounded(read: Callable[[int], bytes], out: IO[bytes], limit: int, size: int | None) -> int:
    """Copies an object's body from ``read`` into ``out`` chunk by chunk; returns its length.
    :class:`TooLargeError` once it passes ``limit`` bytes (or when its announced ``size`` does),
    OSError when it ends before ``size``: both backends' downloads, one rule."""
    from .pack import CHUNK

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
