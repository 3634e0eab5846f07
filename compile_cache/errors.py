"""The exception hierarchy: everything compile_cache raises on purpose derives from CompileCacheError."""

from __future__ import annotations


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


class CorruptPackError(StoreError):
    """A pack failed its header, checksum or signature check; callers treat it as a miss."""


class UnsafePathError(CorruptPackError):
    """A pack or archive member would write outside its target directory (absolute, '..', link)."""


class LockTimeoutError(CompileCacheError, TimeoutError):
    """A lock could not be taken within its timeout."""


class DistributedSetupError(CompileCacheError, RuntimeError):
    """The job's ``torch.distributed`` setup lacks what the ranks need to coordinate (the c10d store)."""
