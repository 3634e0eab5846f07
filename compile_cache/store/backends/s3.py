"""A small S3 client over ``http.client``: the :class:`~compile_cache.store.backends.base.ObjectBackend`
operations a store needs, and nothing else.

Why: s3fs imports aiobotocore and botocore and builds a client from botocore's service model,
0.6 to 0.8 s of a fresh process on 2 cores before its first request, which is most of what a
restore from ``s3://`` costs over one from a directory. This client imports only the standard
library. :func:`~compile_cache.store.backends.clients.open_backend` uses it when
:func:`~compile_cache.store.backends.s3_auth.settings` says it can serve the URL (plain keys from the
environment or a profile); everything else goes to s3fs.

Requests: ListObjectsV2 (paginated), GET (whole, or streamed with a size cap), a ranged GET for a
header, PUT (``If-None-Match: *`` for a conditional put: 412 means it exists, and 409
``ConditionalRequestConflict``, a concurrent conditional write AWS documents, means another node
is writing it: neither is a fault, objects put this way are named by their content), HEAD and
DELETE; path-style addressing against a configured endpoint, virtual-hosted against AWS.

Faults are the shared ones (:class:`~compile_cache.store.backends.base.RetryingBackend`): a
timeout, a connection error, a 5xx or a 429 raises :class:`S3Error` (the status and S3's error
code, never a header), which is retried, then becomes
:class:`~compile_cache.store.backends.base.RemoteError`. A 4xx that cannot succeed by trying
again (400, 403, 405...: ``S3Error.retryable`` is False) becomes one at once; a 404 is a missing
object. A bucket in another region than the one configured answers with a redirect naming its
region (``x-amz-bucket-region``, or ``<Region>`` in the body): the request is signed for that
region and sent once more (to that region's AWS host), and the client keeps it; a second
redirect is an error that names the bucket's region. One connection per thread, kept alive,
dropped after any error: the transport, listing and reads are :mod:`.rest`'s, shared with the
GCS and Azure clients.
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime, timezone
from typing import IO

from .base import ObjectInfo, RemoteError, redact
from .rest import (
    ERROR_BODY,
    HttpBackend,
    HttpError,
    Response,
    clean_code,
    iso_mtime,
    parse_xml,
)
from .s3_auth import EMPTY_SHA256, S3Settings, sign

__all__ = ["S3Backend", "S3Error"]

#: Largest single PUT S3 accepts; a larger upload would need multipart (packs are far smaller).
MAX_PUT = 5 << 30
_CODE_RE = re.compile(rb"<Code>([^<]{1,100})</Code>")


#: Error codes S3 answers with a 4xx that a later try can succeed with.
_RETRYABLE_CODES = frozenset({"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException",
                              "RequestTimeTooSkewed", "OperationAborted", "InternalError"})
_REGION_RE = re.compile(rb"<Region>([a-z0-9-]{1,40})</Region>")
_REGION_CHARS = re.compile(r"[a-z0-9-]{1,40}")


class S3Error(HttpError):
    """An S3 response that is a fault: its HTTP status and S3's error code (nothing else).

    ``retryable``: whether trying again can succeed (a 5xx, 408, 429, or a 4xx whose code says
    so); a 400, 403 or 405 cannot, and is not retried.
    """

    def __init__(self, status: int, code: str, what: str, detail: str = "") -> None:
        super().__init__(status, code, what, detail,
                         status >= 500 or status in (408, 429) or code in _RETRYABLE_CODES)


class S3Backend(HttpBackend):
    """:class:`~compile_cache.store.backends.base.ObjectBackend` over S3's REST API."""

    def __init__(self, url: str, settings: S3Settings) -> None:
        super().__init__(url)
        self._s = settings
        self.client = f"small S3 client (stdlib; credentials: {settings.credentials.source})"

    # -- requests ----------------------------------------------------------------------------
    def _where(self) -> tuple[str, str, str | None]:
        return self._s.scheme, self._s.host, self._s.ca_bundle

    def _object(self, method: str, name: str, what: str, *, headers: dict[str, str] | None = None,
                ok: tuple[int, ...] = (200,)) -> Response:
        return self._request(method, self._key(name), what, headers=headers, ok=ok)

    def _request(self, method: str, key: str, what: str, *, query: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, body: bytes | IO[bytes] | None = None,
                 length: int = 0, sha256: str = EMPTY_SHA256, ok: tuple[int, ...] = (200,)) -> Response:
        """Send one signed request; returns the response (its body unread) if its status is in
        ``ok``; raises FileNotFoundError on 404 (unless ``ok`` has it), :class:`S3Error` else.
        A redirect to the bucket's region is followed once (see the module docstring)."""
        try:
            return self._send(method, key, what, query, headers, body, length, sha256, ok)
        except _RegionRedirect as moved:
            region = moved.region
        self.follow_region(region)
        if body is not None and not isinstance(body, bytes):
            body.seek(0)
        try:
            return self._send(method, key, what, query, headers, body, length, sha256, ok)
        except _RegionRedirect as again:
            raise S3Error(again.status, "PermanentRedirect", what,
                          f": the bucket {self.bucket!r} is in region {again.region!r} "
                          f"(set AWS_REGION={again.region})") from None

    def follow_region(self, region: str) -> None:
        """Sign for ``region`` from now on (and, on AWS's own endpoint, talk to its host)."""
        host = self._s.host
        if self._s.endpoint is None:
            host = (f"s3.{region}.amazonaws.com" if self._s.path_style
                    else f"{self.bucket}.s3.{region}.amazonaws.com")
        self._s = self._s._replace(region=region, host=host)
        self.drop()

    @property
    def host(self) -> str:
        """The host requests go to."""
        return self._s.host

    @property
    def region(self) -> str:
        """The region requests are signed for (the configured one, or the bucket's after a redirect)."""
        return self._s.region

    def _send(self, method: str, key: str, what: str, query: dict[str, str] | None,
              headers: dict[str, str] | None, body: bytes | IO[bytes] | None, length: int,
              sha256: str, ok: tuple[int, ...]) -> Response:
        query = query or {}
        path = f"/{self.bucket}/{key}" if self._s.path_style else f"/{key}"
        signed = {"host": self._s.host, **(headers or {})}
        amz_date = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        sent = sign(method, path, query, signed, sha256, self._s.credentials, self._s.region, amz_date)
        if method in ("PUT", "POST"):
            sent["content-length"] = str(length)
        from urllib.parse import quote

        target = quote(path, safe="/-_.~")
        if query:
            target += "?" + "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))
        out = self._exchange(method, target, sent, body, what)
        if out.status in ok:
            return out
        data = self._error_body(method, out)
        found = _CODE_RE.search(data)
        code = clean_code(found.group(1).decode("ascii", "replace") if found else None, out.status)
        if out.status in (301, 307, 400):
            region = _bucket_region(out.resp.getheader("x-amz-bucket-region"), data)
            if region is not None and region != self._s.region:
                raise _RegionRedirect(out.status, region)
            if region is not None:  # signed for the region it names, and still sent elsewhere
                raise S3Error(out.status, code, what, f": the bucket {self.bucket!r} is in region "
                              f"{region!r} (set AWS_REGION={region})")
        if out.status == 404:
            raise FileNotFoundError(f"{redact(self.url)}: {what}: {code or 'not found'}")
        raise S3Error(out.status, code, what)

    # -- the interface -------------------------------------------------------------------------
    def _list_page(self, base: str, token: str | None, what: str) -> tuple[list[tuple[str, ObjectInfo]], str | None]:
        """One ListObjectsV2 page (``continuation-token``: the token)."""
        query = {"list-type": "2", "prefix": base, "max-keys": str(self.page_size)}
        if token:
            query["continuation-token"] = token
        tree = parse_xml(self._page(self._request("GET", "", what, query=query), what))
        found = [(item.findtext("Key") or "", ObjectInfo(int(item.findtext("Size") or 0),
                                                         iso_mtime(item.findtext("LastModified"))))
                 for item in tree.iter("Contents")]
        token = tree.findtext("NextContinuationToken")
        return found, (token if (tree.findtext("IsTruncated") or "").lower() == "true" else None)

    #: Keys per ListObjectsV2 page (S3's most).
    page_size = 1000

    def _put(self, name: str, body: bytes | IO[bytes], length: int, sha256: str,
             headers: dict[str, str] | None = None) -> bool:
        """One PUT; False when a conditional one (``If-None-Match``) finds the object there
        (412) or being written by another node (409 ``ConditionalRequestConflict``)."""
        if length > MAX_PUT:
            raise RemoteError(f"{redact(self.url)}/{name}: {length} bytes is over a single PUT's limit")
        conditional = bool(headers and "if-none-match" in headers)
        resp = self._request("PUT", self._key(name), f"writing {name}", headers=headers, body=body,
                             length=length, sha256=sha256,
                             ok=(200, 201, 204, 409, 412) if conditional else (200, 201, 204))
        self._read_all(resp, ERROR_BODY)
        return resp.status not in (409, 412)

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (object stores make a put atomic: readers see old or new)."""
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        self._call(f"writing {name}", lambda: self._put(name, data, len(data), digest))

    def put_file(self, name: str, path: str) -> None:
        """Upload the local file ``path`` as ``name`` (streamed from disk, its hash read first)."""
        def upload() -> None:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
                size = fh.tell()
                fh.seek(0)
                self._put(name, fh, size, digest.hexdigest())
        self._call(f"uploading {name}", upload)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Write ``name`` unless it exists; False if it did (``If-None-Match: *``, 412). A server
        that does not implement the header (501) gets a check then a put, which is enough: the
        objects written this way are named by their content."""
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()

        def conditional() -> bool:
            try:
                return self._put(name, data, len(data), digest, {"if-none-match": "*"})
            except S3Error as exc:
                if exc.status != 501:
                    raise
            if self._exists(name):
                return False
            return self._put(name, data, len(data), digest)
        return self._call(f"writing {name}", conditional)


class _RegionRedirect(Exception):
    """A bucket's answer that it lives in ``region`` (followed once by :meth:`S3Backend._request`)."""

    def __init__(self, status: int, region: str) -> None:
        super().__init__(region)
        self.status, self.region = status, region


def _bucket_region(header: str | None, body: bytes) -> str | None:
    """The region a redirect names: ``x-amz-bucket-region``, else ``<Region>`` in its body."""
    if header and _REGION_CHARS.fullmatch(header.strip()):
        return header.strip()
    found = _REGION_RE.search(body)
    return found.group(1).decode("ascii") if found else None
