"""Object storage through fsspec (any protocol it knows: ``s3://`` through s3fs, ``gs://`` through
gcsfs, ``az://`` through adlfs, ``memory://``).

fsspec and the protocol's package (``pip install 'compile-cache[s3]'``, ``[gcs]``, ``[azure]``)
are imported only when a URL needs them. Endpoints and credentials come from the package's own
configuration, as a user sets it: the environment (``STORAGE_EMULATOR_HOST``,
``AZURE_STORAGE_CONNECTION_STRING``, ...) or fsspec's config (``FSSPEC_GCS_TOKEN=anon``,
``~/.config/fsspec/*.json``); nothing here sets one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any, TypeVar

from ...errors import StoreError
from ...redact import one_line
from .base import ClientStartError, ObjectInfo, RetryingBackend, copy_bounded, redact, run_within

__all__ = ["FALLBACK_LOGGERS", "FsspecBackend", "PACKAGES", "quiet_fallback_loggers"]

T = TypeVar("T")

#: The package fsspec serves each protocol with, and the extra that installs it.
PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"),
            "gcs": ("gcsfs", "gcs"), "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"),
            "abfss": ("adlfs", "azure")}
#: The loggers of the protocol packages and what they use. Their retry loops log a traceback
#: per failed try (gcsfs: dozens for a bucket it cannot reach); with no handler configured,
#: Python's last-resort handler would print each to the terminal.
FALLBACK_LOGGERS = ("fsspec", "s3fs", "aiobotocore", "botocore", "gcsfs", "google", "google.auth",
                    "aiohttp", "adlfs", "azure", "urllib3")
_quieted = False


def quiet_fallback_loggers() -> None:
    """Keep the protocol packages' log lines (:data:`FALLBACK_LOGGERS`) off a terminal that
    nobody configured: a logger without a handler gets a ``NullHandler``, which only stops
    Python's last-resort output; a handler the user configured (on the root logger, or on the
    package's) still receives every record. The CLI's ``-v`` shows them."""
    global _quieted
    if _quieted:
        return
    for name in FALLBACK_LOGGERS:
        log = logging.getLogger(name)
        if not log.handlers:
            log.addHandler(logging.NullHandler())
    _quieted = True


def _endpoint(protocol: str) -> str:
    """Where the protocol package will send requests, as far as its own variables say (shown,
    never a credential)."""
    env = os.environ
    if protocol in ("s3", "s3a"):
        chosen = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "").strip()
        return redact(chosen) if chosen else "AWS's (s3.<region>.amazonaws.com)"
    if protocol in ("gs", "gcs"):
        chosen = (env.get("STORAGE_EMULATOR_HOST") or env.get("FSSPEC_GCS_ENDPOINT_URL") or "").strip()
        return redact(chosen) if chosen else "https://storage.googleapis.com"
    if protocol in ("az", "abfs", "abfss"):
        account = (env.get("AZURE_STORAGE_ACCOUNT_NAME") or "").strip()
        return (f"https://{account}.blob.core.windows.net" if account
                else "the account's blob endpoint (no account named)")
    return f"{protocol}'s"


def mtime_of(info: dict[str, Any]) -> float:
    for field in ("LastModified", "mtime", "created", "last_modified", "updated"):
        value = info.get(field)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


class FsspecBackend(RetryingBackend):
    """:class:`ObjectBackend` over fsspec (any protocol it knows).

    The protocol's package is imported when the backend is made (a missing one raises
    :class:`StoreError` naming the extra to install), but its filesystem is made at the first
    call: making it looks for credentials, and may ask the network (gcsfs asks Google's
    metadata server; adlfs refuses to start without credentials). A filesystem that cannot be
    made fails that call and every later one at once (:class:`~.base.ClientStartError`: a
    miss, not a store that cannot be opened). Until the endpoint has answered, a call is
    bounded as a whole (:meth:`~.base.RetryingBackend.limit`, :func:`~.base.run_within`): the
    package's own retry loop and credential lookups have no limit of their own."""

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError:
            raise StoreError(
                f"compile cache {redact(url)}: object storage needs fsspec and the protocol's "
                "package: pip install 'compile-cache[s3]' (gcsfs for gs://: [gcs], adlfs for "
                "az://: [azure])"
            ) from None
        super().__init__(url)
        protocol = self.url.split("://", 1)[0].lower()
        package = PACKAGES.get(protocol, (None, None))[0]
        self.client = package or f"fsspec ({protocol})"
        self.endpoint = _endpoint(protocol)
        self._options: dict[str, Any] = {}
        if protocol in ("s3", "s3a"):
            # Our retries, not also the client's (a down store would cost retries squared).
            self._options = {"config_kwargs": {
                "connect_timeout": self.timeout, "read_timeout": self.timeout,
                "retries": {"max_attempts": 1}}}
        try:
            fsspec.get_filesystem_class(protocol)  # the package's import: here, not in a call
        except ImportError as exc:
            raise StoreError(f"compile cache {redact(url)}: {exc} (pip install 'compile-cache[s3]' for "
                             "s3://, 'compile-cache[gcs]' (gcsfs) for gs://, 'compile-cache[azure]' "
                             "(adlfs) for az://)") from None
        except (ValueError, TypeError) as exc:
            raise StoreError(f"compile cache {redact(url)}: not a usable store URL: {exc}") from None
        quiet_fallback_loggers()
        self._fs: Any = None
        self.root = ""
        self._start_error: ClientStartError | None = None
        self._open_lock = threading.Lock()

    @property
    def fs(self) -> Any:
        """The protocol's filesystem, made at first use (see the class docstring)."""
        if self._fs is None:
            with self._open_lock:
                if self._start_error is not None:
                    raise self._start_error
                if self._fs is None:
                    self._open()
        return self._fs

    def _open(self) -> None:
        import fsspec

        try:
            fs, root = fsspec.core.url_to_fs(self.url, **self._options)
        except Exception as exc:  # the package's own refusal (adlfs: no credentials), whatever its type
            self._start_error = ClientStartError(f"{self.client} could not start: {type(exc).__name__}: "
                                                 f"{one_line(exc, 300)}")
            raise self._start_error from None
        self.root = root.rstrip("/")
        if isinstance(getattr(fs, "retries", None), int):
            fs.retries = 1  # s3fs's own retry loop (ours is above it)
        self._fs = fs

    def _attempt(self, fn: Callable[[], T]) -> T:
        """One try; bounded as a whole until the endpoint has answered (class docstring)."""
        if self.answered:
            return fn()
        return run_within(fn, self.limit(), f"{redact(self.url)}: {self.client}")

    def _path(self, name: str) -> str:
        if self._fs is None:
            self._fs = self.fs  # made now: the root comes with it
        return f"{self.root}/{name}" if name else self.root

    # -- the interface -------------------------------------------------------------------------
    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object under ``prefix`` (recursive): its name (relative to the store's URL,
        like every name here) -> its info; empty if there is none."""
        def find() -> dict[str, Any]:
            self.fs.invalidate_cache()
            try:
                return self.fs.find(self._path(prefix), detail=True)
            except FileNotFoundError:
                return {}
        found = self._call(f"listing {prefix or '/'}", find)
        out: dict[str, ObjectInfo] = {}
        root = self.root.lstrip("/") + "/"
        for path, info in found.items():
            name = path.lstrip("/")
            if info.get("type", "file") != "file" or not name.startswith(root):
                continue
            out[name[len(root):]] = ObjectInfo(int(info.get("size") or 0), mtime_of(info))
        return out

    def get(self, name: str, limit: int) -> bytes | None:
        """The object ``name`` (at most ``limit`` bytes read), or None if it does not exist."""
        return self._bounded_get(name, limit, lambda: self._ranged(self._path(name), limit + 1))

    def download(self, name: str, out: IO[bytes], limit: int) -> int:
        """Stream ``name`` into ``out`` in chunks, refusing more than ``limit`` bytes; returns
        its size. Raises FileNotFoundError if it is gone, :class:`TooLargeError` over the limit,
        RemoteError on a fault."""
        from ..pack import CHUNK

        def stream() -> int:
            out.seek(0)
            out.truncate()
            with self.fs.open(self._path(name), "rb", block_size=CHUNK, cache_type="none") as fh:
                return copy_bounded(fh.read, out, limit, getattr(fh, "size", None))
        return self._call(f"downloading {name}", stream)

    def head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of ``name`` (one ranged read: a pack's header for a listing)."""
        return bytes(self._call(f"reading {name}", lambda: self._ranged(self._path(name), n)))

    def _ranged(self, path: str, end: int) -> bytes:
        """Bytes ``[0, end)`` of ``path``. Azure answers a range on an empty blob with 416
        InvalidRange, where S3 and GCS return nothing: an empty object is b"", not a fault (a
        fault would take the store down for :data:`~.base.DOWN_FOR` seconds)."""
        try:
            return self.fs.cat_file(path, start=0, end=end)
        except FileNotFoundError:
            raise
        except Exception as exc:
            status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
            if (status == 416 or "InvalidRange" in str(exc)) and self.fs.size(path) == 0:
                return b""
            raise

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (object stores make a put atomic: readers see old or new)."""
        self._call(f"writing {name}", lambda: self.fs.pipe_file(self._path(name), bytes(data)))

    def put_file(self, name: str, path: str) -> None:
        """Upload the local file ``path`` as ``name`` (streamed, multipart when large)."""
        self._call(f"uploading {name}", lambda: self.fs.put_file(path, self._path(name)))

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Write ``name`` unless it exists; False if it did. A check, then a conditional put
        (``If-None-Match: *`` on S3, ``ifGenerationMatch=0`` on GCS, ``overwrite=False`` on
        Azure) where the package has one, else a plain put. The check first: a store (or an
        emulator: gcp-storage-emulator ignores ``ifGenerationMatch``) that does not enforce the
        condition still keeps the first writer's object, and the upload is saved; two nodes
        racing past the check write the same bytes, as the objects written this way are named
        by their content (entry.json: either node's is right)."""
        def conditional() -> bool:
            path = self._path(name)
            self.fs.invalidate_cache()
            if self.fs.exists(path):
                return False
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
        return self._call(f"writing {name}", conditional)

    def exists(self, name: str) -> bool:
        def check() -> bool:
            self.fs.invalidate_cache()
            return bool(self.fs.exists(self._path(name)))
        return bool(self._call(f"checking {name}", check))

    def delete(self, names: Iterable[str]) -> None:
        """Remove objects (a missing one is not an error)."""
        names = list(names)
        if not names:
            return

        def remove() -> None:
            for path in [self._path(n) for n in names]:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    pass
        self._call(f"deleting {len(names)} object(s)", remove)
