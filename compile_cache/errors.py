"""The exception hierarchy: everything compile_cache raises on purpose derives from CompileCacheError."""

from __future__ import annotations

import errno as _errno


class CompileCacheError(Exception):
    """Base class of every error compile_cache raises on purpose."""


class BackendUnavailableError(CompileCacheError, ImportError):
    """The native fingerprint backend was asked for (COMPILE_CACHE_BACKEND=native) but cannot load."""


class ConfigError(CompileCacheError, ValueError):
    """A setting (argument or environment variable) has a value that cannot be used."""


class StoreError(CompileCacheError):
    """The on-disk store cannot be used as asked (bad location, unsafe permissions, read-only)."""


class UnsafeStoreError(StoreError):
    """The store directory could be written by other users: its packs would run their code here."""


class UnsafeStorePathError(UnsafeStoreError, OSError):
    """A path inside the store is a symlink, not the kind of file expected (a FIFO where a pack
    should be), outside the store, or not trusted: refused at use, never followed.

    An ``OSError`` too, so that every handler of a failed store operation (a miss, a skipped
    record, a counted error) treats it as one. ``reason``: ``"link"``, ``"type"``, ``"outside"``
    or ``"trust"``.
    """

    def __init__(self, message: str, reason: str = "link", path: str | None = None) -> None:
        OSError.__init__(self, _errno.ELOOP if reason == "link" else _errno.EINVAL, message, path)
        self.reason = reason

    def __str__(self) -> str:
        return str(self.strerror)


class CorruptPackError(StoreError):
    """A pack failed its header, checksum or signature check; callers treat it as a miss."""


class UnsafePathError(CorruptPackError):
    """A pack or archive member would write outside its target directory (absolute, '..', link)."""


class LockTimeoutError(CompileCacheError, TimeoutError):
    """A lock could not be taken within its timeout."""


class PrecompileDeclined(CompileCacheError):
    """A region's Dynamo guards cannot be saved faithfully, so it does not use precompile.

    Raised from inside the guard filter while Dynamo traces; compile_cache catches it, compiles
    the region without precompile (every default guard) and warns. It never reaches the user.
    """


class DistributedSetupError(CompileCacheError, RuntimeError):
    """The job's ``torch.distributed`` setup lacks what the ranks need to coordinate (the c10d store)."""
