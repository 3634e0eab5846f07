"""Object storage through fsspec (any protocol it knows: ``s3://`` through s3fs, ``gs://`` through
gcsfs, ``az://`` through adlfs, ``memory://``).

fsspec and the protocol's package (``pip install 'compile-cache[s3]'``, ``[gcs]``, ``[azure]``)
are imported only when a URL needs them. Endpoints and credentials come from the package's own
configuration, as a user sets it: the environment (``STORAGE_EMULATOR_HOST``,
``AZURE_STORAGE_CONNECTION_STRING``, ...) or fsspec's config (``FSSPEC_GCS_TOKEN=anon``,
``~/.config/fsspec/*.json``); nothing here sets one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

from ...errors import StoreError
from .base import ObjectInfo, RetryingBackend, copy_bounded, redact

__all__ = ["FsspecBackend", "PACKAGES"]

#: The package fsspec serves each protocol with, and the extra that installs it.
PACKAGES = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"),
            "gcs": ("gcsfs", "gcs"), "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"),
            "abfss": ("adlfs", "azure")}


def mtime_of(info: dict[str, Any]) -> float:
    for field in ("LastModified", "mtime", "created", "last_modified", "updated"):
        value = info.get(field)
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


class FsspecBackend(RetryingBackend):
    """:class:`ObjectBackend` over fsspec (any protocol it knows)."""

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
                             "s3://, 'compile-cache[gcs]' (gcsfs) for gs://, 'compile-cache[azure]' "
                             "(adlfs) for az://)") from None
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
        path = self._path(name)

        def conditional() -> bool:
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
