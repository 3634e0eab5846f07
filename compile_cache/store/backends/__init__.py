"""Object storage backends behind a store URL: one small interface, and the clients that serve it.

``base``            :class:`ObjectBackend` (list, get, download, put, put_if_absent, delete), the
                    bounded retries every client shares (:class:`RetryingBackend`), errors, bounds
``fsspec_backend``  any protocol fsspec knows (``s3://`` through s3fs, ``gs://``, ``az://``...)
``rest``            the HTTP transport the small standard-library clients share (connections, a
                    whole-request deadline, bounded reads, pagination, object reads)
``s3``, ``s3_auth`` the small S3 client and its SigV4 signing and settings
``gcs``             the small GCS client (JSON API; an emulator, a token or the metadata server)
``azure``           the small Azure Blob client (REST API; Shared Key or SAS)
``clients``         :func:`open_backend`: which client serves a URL (the one place that chooses);
                    :func:`diagnose`: what doctor says of it (client, credential sources, endpoint)

Nothing outside this package knows a client: removing one is removing its modules here and its
branch in ``clients``.
"""

from __future__ import annotations

from .base import ObjectBackend, ObjectInfo, RemoteError, TooLargeError, is_url, redact
from .clients import Diagnosis, credential_sources, diagnose, open_backend

__all__ = ["Diagnosis", "ObjectBackend", "ObjectInfo", "RemoteError", "TooLargeError", "credential_sources",
           "diagnose", "is_url", "open_backend", "redact"]
