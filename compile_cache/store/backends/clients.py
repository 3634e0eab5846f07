"""Which client serves a store URL: the one place that chooses.

``s3://`` (and ``s3a://``), ``gs://`` (``gcs://``) and ``az://`` (``abfs://``, ``abfss://``) go
to a small standard-library client (:mod:`.s3`, :mod:`.gcs`, :mod:`.azure`) when its
``settings`` says it can serve the URL with the credentials configured (S3: keys in the
environment or a profile; GCS: an emulator, a token, or the metadata server; Azure: a key or a
SAS token) and ``COMPILE_CACHE_REMOTE_CLIENT`` is not ``fsspec`` (nor, for ``s3://``,
``COMPILE_CACHE_S3_CLIENT`` ``s3fs``); everything else goes to
:class:`~compile_cache.store.backends.fsspec_backend.FsspecBackend` (s3fs, gcsfs, adlfs), exactly
as before the small clients existed. The choice, and why, is logged at debug level (never a
credential) and shown by ``doctor``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NamedTuple

from ... import config
from ...errors import CompileCacheError
from ...redact import one_line
from .base import ObjectBackend, RemoteError, redact
from .fsspec_backend import PACKAGES, FsspecBackend

__all__ = ["Diagnosis", "credential_sources", "diagnose", "open_backend"]

logger = logging.getLogger("compile_cache")

#: What the small client of each scheme saves a fresh node (the packages it does not import).
_SAVES = {"s3": "no s3fs, aiobotocore or botocore import", "gs": "no gcsfs, aiohttp or google-auth import",
          "az": "no adlfs, aiohttp or Azure SDK import"}
_NAME = {"s3": "S3", "gs": "GCS", "az": "Azure Blob"}
_FAMILY = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}


def _small_client(family: str, url: str) -> tuple[Any, str]:
    """(the small client of ``family`` for ``url``, "") or (None, why it declines)."""
    if config.REMOTE_CLIENT.value() == "fsspec":
        return None, "COMPILE_CACHE_REMOTE_CLIENT=fsspec"
    if family == "s3":
        from .s3 import S3Backend  # here: http.client and ssl only for a store that needs them
        from .s3_auth import check_environment
        from .s3_auth import settings as s3_settings

        check_environment()  # a key ending in a newline: a clear error, never its value
        if config.S3_CLIENT.value() == "s3fs":
            return None, "COMPILE_CACHE_S3_CLIENT=s3fs"
        chosen, why = s3_settings(url)
        return (S3Backend(url, chosen), "s3:// with keys the small client can sign with: "
                + _SAVES[family]) if chosen is not None else (None, why)
    if family == "gs":
        from .gcs import GcsBackend
        from .gcs import settings as gcs_settings

        found, why = gcs_settings(url)
        return (GcsBackend(url, found), f"gs:// with credentials the small client can use "
                f"({found.source}): " + _SAVES[family]) if found is not None else (None, why)
    from .azure import AzureBackend
    from .azure import settings as azure_settings

    found_az, why = azure_settings(url)
    return (AzureBackend(url, found_az), f"az:// with {found_az.source}: " + _SAVES[family]) \
        if found_az is not None else (None, why)


def open_backend(url: str) -> ObjectBackend:
    """The backend for ``url``: the scheme's small client when it can serve it (see the module
    docstring), fsspec for everything else."""
    protocol = url.split("://", 1)[0].lower()
    family = _FAMILY.get(protocol)
    package, extra = PACKAGES.get(protocol, (None, None))
    if family is None:
        backend = FsspecBackend(url)
        backend.why = f"{protocol}:// is served through fsspec (no small client for it)"
        return backend
    chosen, why = _small_client(family, url)
    if chosen is not None:
        chosen.why = why
        logger.debug("compile cache %s: object storage client: %s", redact(url), chosen.client)
        return chosen
    logger.debug("compile cache %s: object storage client: %s (the small client does not serve %s)",
                 redact(url), package, why)
    backend = FsspecBackend(url)
    backend.why = (f"the small {_NAME[family]} client declines this store: {why}; served by {package} "
                   f"through fsspec (pip install 'compile-cache[{extra}]')")
    return backend


def credential_sources(url: str) -> list[tuple[str, bool | None]]:
    """The credential sources the clients of ``url``'s scheme look at, each with whether it is
    there (None: only a request could tell); names, never a value. Empty for another scheme."""
    family = _FAMILY.get(url.split("://", 1)[0].lower())
    if family == "s3":
        from .s3_auth import credential_sources as sources
    elif family == "gs":
        from .gcs import credential_sources as sources
    elif family == "az":
        from .azure import credential_sources as sources
    else:
        return []
    return sources(os.environ)


class Diagnosis(NamedTuple):
    """What doctor says of a store on object storage, each fact in one line's worth."""

    #: Which client serves the URL.
    client: str
    #: Why that client: the small client's reason, or why it declined.
    why: str
    #: The credential sources looked at, and those found (names, never a value).
    looked_at: tuple[str, ...]
    found: tuple[str, ...]
    #: Where requests go, as shown.
    endpoint: str
    #: Whether the endpoint answered (any HTTP status); None when no request went out.
    answered: bool | None
    #: The probe's fault in a few words ("" when the listing worked).
    fault: str
    #: The probe's error, one line (None when the listing worked).
    error: str | None


def diagnose(backend: ObjectBackend, prefix: str, seconds: float) -> Diagnosis:
    """One listing of ``prefix`` through ``backend``, one try of at most ``seconds`` (a doctor
    must answer in seconds when the store cannot), and what it tells: see :class:`Diagnosis`.
    The backend is the caller's own: its tries and time limit are changed for this."""
    backend.attempts = 1  # type: ignore[attr-defined]
    backend.first_timeout = min(float(getattr(backend, "first_timeout", seconds)), seconds)  # type: ignore[attr-defined]
    error: str | None = None
    answered: bool | None = True
    fault = ""
    try:
        backend.list(prefix)
    except RemoteError as exc:
        error, answered, fault = one_line(exc, 400), exc.answered, exc.fault
    except CompileCacheError as exc:
        error, answered, fault = one_line(exc, 400), None, one_line(exc, 200)
    sources = credential_sources(backend.url)
    return Diagnosis(backend.client, backend.why, tuple(n for n, _ in sources),
                     tuple(n for n, there in sources if there), getattr(backend, "endpoint", "?"),
                     answered, fault, error)
