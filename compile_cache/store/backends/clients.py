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
from typing import Any

from ... import config
from .base import ObjectBackend, redact
from .fsspec_backend import PACKAGES, FsspecBackend

__all__ = ["open_backend"]

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
