"""Object storage through fsspec (any protocol it knows: ``s3://`` through s3fs, ``gs://``, ``az://``, ``memory://``).

fsspec and the protocol's package (``pip install compile-cache[s3]``) are imported only when a
URL needs them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import IO, Any

from ...errors import StoreError
from .base import ObjectInfo, RemoteError, RetryingBackend, copy_bounded, redact

__all__ = ["FsspecBackend"]


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
            out[name[len(root):]] = ObjectInfo(int(info.get("size") or 0), mtime_of(info))
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
        from ..pack import CHUNK

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
