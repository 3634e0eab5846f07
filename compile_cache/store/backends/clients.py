"""Which client serves a store URL: the one place that chooses.

``s3://`` (and ``s3a://``) goes to the small standard-library client
(:class:`~compile_cache.store.backends.s3.S3Backend`) when :func:`~compile_cache.store.backends.s3_auth.settings`
says it can serve the URL as botocore would (keys in the environment or a profile's credentials
file, and nothing configured that it does not support) and ``COMPILE_CACHE_S3_CLIENT`` is not
``s3fs``; everything else, every other scheme included, goes to
:class:`~compile_cache.store.backends.fsspec_backend.FsspecBackend`, exactly as before the small client existed.
The choice, and why, is logged at debug level (never a credential) and shown by ``doctor``.
"""

from __future__ import annotations

import logging

from ... import config
from .base import ObjectBackend, redact
from .fsspec_backend import PACKAGES, FsspecBackend

__all__ = ["open_backend"]

logger = logging.getLogger("compile_cache")


def open_backend(url: str) -> ObjectBackend:
    """The backend for ``url``: the small S3 client for ``s3://`` when it can serve it (see the
    module docstring), fsspec for everything else."""
    protocol = url.split("://", 1)[0].lower()
    if protocol in ("s3", "s3a"):
        from .s3 import S3Backend  # here: http.client and ssl only for an s3:// store
        from .s3_auth import check_environment, settings

        check_environment()  # a key ending in a newline: a clear error, never its value
        if config.S3_CLIENT.value() == "s3fs":
            chosen, why = None, "COMPILE_CACHE_S3_CLIENT=s3fs"
        else:
            chosen, why = settings(url)
        if chosen is not None:
            backend: ObjectBackend = S3Backend(url, chosen)
            backend.why = ("s3:// with keys the small client can sign with: no s3fs, aiobotocore or "
                           "botocore import")
            logger.debug("compile cache %s: object storage client: %s", redact(url), backend.client)
            return backend
        logger.debug("compile cache %s: object storage client: s3fs (the small S3 client does not "
                     "serve %s)", redact(url), why)
        backend = FsspecBackend(url)
        backend.why = f"the small S3 client declines this store: {why}"
        return backend
    backend = FsspecBackend(url)
    package, extra = PACKAGES.get(protocol, (None, None))
    if package:
        backend.why = (f"{protocol}:// is served by {package} through fsspec (pip install "
                       f"'compile-cache[{extra}]'; the small client is for s3:// only)")
    else:
        backend.why = f"{protocol}:// is served through fsspec (the small client is for s3:// only)"
    return backend
