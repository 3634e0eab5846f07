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
dropped after any error.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import socket
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import IO

from .base import ObjectInfo, RemoteError, RetryingBackend, TooLargeError, copy_bounded, redact
from .s3_auth import EMPTY_SHA256, S3Settings, sign

__all__ = ["S3Backend", "S3Error"]

#: Largest single PUT S3 accepts; a larger upload would need multipart (packs are far smaller).
MAX_PUT = 5 << 30
#: Bytes of an error response read for its code.
_ERROR_BODY = 64 << 10
#: A request's body may take one more second per this many bytes received (see _Deadline).
MIN_RATE = 64 << 10
#: A listing stops with an error past this many pages or objects (a server that always
#: answers "more" would otherwise loop for ever, growing memory), or when the server repeats
#: a continuation token.
MAX_LIST_PAGES = 5000
MAX_LIST_OBJECTS = 1_000_000
#: Bytes of one listing page read at most (a page of 1,000 keys is about 300 KB).
MAX_PAGE_BYTES = 16 << 20
_CODE_RE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_CODE_CHARS = re.compile(r"[^A-Za-z0-9 ._-]")


#: Error codes S3 answers with a 4xx that a later try can succeed with.
_RETRYABLE_CODES = frozenset({"RequestTimeout", "SlowDown", "Throttling", "ThrottlingException",
                              "RequestTimeTooSkewed", "OperationAborted", "InternalError"})
_REGION_RE = re.compile(rb"<Region>([a-z0-9-]{1,40})</Region>")
_REGION_CHARS = re.compile(r"[a-z0-9-]{1,40}")


class S3Error(OSError):
    """An S3 response that is a fault: its HTTP status and S3's error code (nothing else).

    ``retryable``: whether trying again can succeed (a 5xx, 408, 429, or a 4xx whose code says
    so); a 400, 403 or 405 cannot, and is not retried.
    """

    def __init__(self, status: int, code: str, what: str, detail: str = "") -> None:
        super().__init__(f"HTTP {status} {code} ({what}){detail}")
        self.status = status
        self.code = code
        self.retryable = status >= 500 or status in (408, 429) or code in _RETRYABLE_CODES


class _Deadline:
    """The time limit of one whole request, not only of each socket read: a server that drips a
    byte now and then never holds a job past it. The server must answer (status and headers)
    within ``seconds``; then the body may take ``seconds`` plus one second per
    :data:`MIN_RATE` bytes received. When the time is up a timer thread shuts the connection's
    socket down, which ends any read blocked on it; the read then raises :class:`TimeoutError`.
    """

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self._conn = conn
        self._start = time.monotonic()
        self._seconds = seconds
        self.expires = self._start + seconds
        self.fired = False
        self._timer: threading.Timer | None = None
        self._arm()

    def _arm(self) -> None:
        self._timer = threading.Timer(max(0.0, self.expires - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        if self._timer is None:
            return  # cancelled
        if time.monotonic() < self.expires - 0.01:
            self._arm()  # the body made progress meanwhile: its deadline moved
            return
        self.fired = True
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def received(self, total: int) -> None:
        """``total`` body bytes have arrived: the deadline grows with them."""
        self.expires = self._start + self._seconds + total / MIN_RATE

    def cancel(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def check(self, what: str) -> None:
        """Raise TimeoutError if the deadline ended the request."""
        if self.fired:
            raise TimeoutError(f"{what}: no complete answer within the request's deadline")


class _Response:
    """A response whose body the caller reads, on a connection dropped unless read to the end."""

    def __init__(self, backend: S3Backend, resp: http.client.HTTPResponse, deadline: _Deadline) -> None:
        self._backend, self.resp, self.status = backend, resp, resp.status
        self._deadline = deadline
        self._total = 0
        length = resp.getheader("Content-Length")
        self.length = int(length) if length and length.isdigit() else None

    def read(self, n: int) -> bytes:
        try:
            data = self.resp.read(n)
        except (OSError, http.client.HTTPException):
            self._deadline.check("reading the answer")
            raise
        self._deadline.check("reading the answer")
        self._total += len(data)
        self._deadline.received(self._total)
        return data

    def finish(self, complete: bool) -> None:
        """Keep the connection if the body was read to its end, else drop it."""
        self._deadline.cancel()
        if complete and not self._deadline.fired:
            try:
                self.resp.read()  # nothing left: marks the response done
                return
            except (OSError, http.client.HTTPException):
                pass
        self._backend.drop()


class S3Backend(RetryingBackend):
    """:class:`~compile_cache.store.backends.base.ObjectBackend` over S3's REST API."""

    def __init__(self, url: str, settings: S3Settings) -> None:
        super().__init__(url)
        rest = self.url.split("://", 1)[1]
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/")
        self._s = settings
        self.client = f"small S3 client (stdlib; credentials: {settings.credentials.source})"
        self._local = threading.local()

    # -- requests ----------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, name) if p)

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            host, _, port = self._s.host.rpartition(":") if self._s.host.count(":") == 1 else (self._s.host, "", "")
            host = host or self._s.host
            if self._s.scheme == "https":
                import ssl

                conn = http.client.HTTPSConnection(host, int(port) if port else None, timeout=self.timeout, blocksize=1 << 16,
                                                   context=ssl.create_default_context(cafile=self._s.ca_bundle))
            else:
                conn = http.client.HTTPConnection(host, int(port) if port else None, timeout=self.timeout,
                                              blocksize=1 << 16)
            self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def drop(self) -> None:
        """Close this thread's connection (the next request opens a new one)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def _request(self, method: str, key: str, what: str, *, query: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, body: bytes | IO[bytes] | None = None,
                 length: int = 0, sha256: str = EMPTY_SHA256, ok: tuple[int, ...] = (200,)) -> _Response:
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
        import dataclasses

        host = self._s.host
        if self._s.endpoint is None:
            host = (f"s3.{region}.amazonaws.com" if self._s.path_style
                    else f"{self.bucket}.s3.{region}.amazonaws.com")
        self._s = dataclasses.replace(self._s, region=region, host=host)
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
              sha256: str, ok: tuple[int, ...]) -> _Response:
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
        for fresh in (False, True):
            reused = getattr(self._local, "conn", None) is not None and not fresh
            conn = self._conn()
            if conn.sock is None:
                conn.connect()  # now, so that the deadline can reach the socket
            deadline = _Deadline(conn, self.timeout)
            try:
                conn.request(method, target, body=body, headers=sent)
                resp = conn.getresponse()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                deadline.cancel()
                self.drop()  # a kept-alive connection the server had closed: once more, at once
                deadline.check(what)
                if not reused:
                    raise
                if body is not None and not isinstance(body, bytes):
                    body.seek(0)
            except BaseException:
                deadline.cancel()
                self.drop()
                deadline.check(what)
                raise
        out = _Response(self, resp, deadline)
        if out.status in ok:
            return out
        data = resp.read(_ERROR_BODY) if method != "HEAD" else b""
        out.finish(len(data) < _ERROR_BODY)
        found = _CODE_RE.search(data)
        code = found.group(1).decode("ascii", "replace") if found else http.client.responses.get(out.status, "")
        code = _CODE_CHARS.sub("", code)[:64]  # the server's text: no newline reaches a warning
        if out.status in (301, 307, 400):
            region = _bucket_region(resp.getheader("x-amz-bucket-region"), data)
            if region is not None and region != self._s.region:
                raise _RegionRedirect(out.status, region)
            if region is not None:  # signed for the region it names, and still sent elsewhere
                raise S3Error(out.status, code, what, f": the bucket {self.bucket!r} is in region "
                              f"{region!r} (set AWS_REGION={region})")
        if out.status == 404:
            raise FileNotFoundError(f"{redact(self.url)}: {what}: {code or 'not found'}")
        raise S3Error(out.status, code, what)

    def _read_all(self, resp: _Response, limit: int) -> bytes:
        """The body, at most ``limit`` + 1 bytes of it (then the connection is dropped)."""
        chunks, total = [], 0
        while total <= limit:
            chunk = resp.read(min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        data = b"".join(chunks)
        if resp.length is not None and total <= limit and total != resp.length:
            resp.finish(False)
            raise OSError(f"short read: {total} of {resp.length} bytes")
        resp.finish(total <= limit)
        return data

    # -- the interface -------------------------------------------------------------------------
    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object under ``prefix`` (recursive; ListObjectsV2, page by page): its name
        relative to the store's URL -> its info; empty if there is none (or no bucket)."""
        base = self._key(prefix)
        if base:
            base += "/"
        root = f"{self.prefix}/" if self.prefix else ""

        def find() -> dict[str, ObjectInfo]:
            import xml.etree.ElementTree as ET

            out: dict[str, ObjectInfo] = {}
            token: str | None = None
            seen: set[bytes] = set()  # digests of the tokens given
            for _page in range(MAX_LIST_PAGES):
                query = {"list-type": "2", "prefix": base, "max-keys": str(self.page_size)}
                if token:
                    query["continuation-token"] = token
                try:
                    resp = self._request("GET", "", f"listing {prefix or '/'}", query=query)
                except FileNotFoundError:
                    return {}
                page = self._read_all(resp, MAX_PAGE_BYTES)
                if len(page) > MAX_PAGE_BYTES:
                    raise OSError(f"listing {prefix or '/'}: a page over {MAX_PAGE_BYTES} bytes")
                tree = ET.fromstring(page)
                ns = tree.tag[: tree.tag.index("}") + 1] if tree.tag.startswith("{") else ""
                for item in tree.iter(f"{ns}Contents"):
                    key = item.findtext(f"{ns}Key") or ""
                    if not key.startswith(root) or key.endswith("/"):
                        continue
                    out[key[len(root):]] = ObjectInfo(int(item.findtext(f"{ns}Size") or 0),
                                                      _mtime(item.findtext(f"{ns}LastModified")))
                if len(out) > MAX_LIST_OBJECTS:
                    raise OSError(f"listing {prefix or '/'}: more than {MAX_LIST_OBJECTS} objects")
                token = tree.findtext(f"{ns}NextContinuationToken")
                if (tree.findtext(f"{ns}IsTruncated") or "").lower() != "true" or not token:
                    return out
                digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
                if digest in seen:
                    raise OSError(f"listing {prefix or '/'}: the server repeated a continuation token")
                seen.add(digest)
            raise OSError(f"listing {prefix or '/'}: more than {MAX_LIST_PAGES} pages")
        return self._call(f"listing {prefix or '/'}", find)

    #: Keys per ListObjectsV2 page (S3's most).
    page_size = 1000

    def get(self, name: str, limit: int) -> bytes | None:
        """The object ``name`` (at most ``limit`` bytes read), or None if it does not exist."""
        def fetch() -> bytes:
            resp = self._request("GET", self._key(name), f"reading {name}")
            if resp.length is not None and resp.length > limit:
                resp.finish(False)
                raise TooLargeError(resp.length)
            return self._read_all(resp, limit)
        try:
            data = self._call(f"reading {name}", fetch)
        except FileNotFoundError:
            return None
        except TooLargeError:
            raise RemoteError(f"{redact(self.url)}/{name} is larger than {limit} bytes") from None
        if len(data) > limit:
            raise RemoteError(f"{redact(self.url)}/{name} is larger than {limit} bytes")
        return data

    def download(self, name: str, out: IO[bytes], limit: int) -> int:
        """Stream ``name`` into ``out`` in chunks, refusing more than ``limit`` bytes; returns
        its size. Raises FileNotFoundError if it is gone, :class:`TooLargeError` over the limit,
        RemoteError on a fault."""
        def stream() -> int:
            out.seek(0)
            out.truncate()
            resp = self._request("GET", self._key(name), f"downloading {name}")
            complete = False
            try:
                total = copy_bounded(resp.read, out, limit, resp.length)
                complete = True
                return total
            finally:
                resp.finish(complete)
        return self._call(f"downloading {name}", stream)

    def head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of ``name`` (one ranged read: a pack's header for a listing)."""
        def fetch() -> bytes:
            if n <= 0:
                return b""
            resp = self._request("GET", self._key(name), f"reading {name}", headers={"range": f"bytes=0-{n - 1}"},
                                 ok=(200, 206, 416))
            if resp.status == 416:  # an empty object
                resp.finish(False)
                return b""
            return self._read_all(resp, n)[:n]
        return self._call(f"reading {name}", fetch)

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
        self._read_all(resp, _ERROR_BODY)
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

    def _exists(self, name: str) -> bool:
        try:
            resp = self._request("HEAD", self._key(name), f"checking {name}")
        except FileNotFoundError:
            return False
        resp.finish(True)
        return True

    def exists(self, name: str) -> bool:
        return bool(self._call(f"checking {name}", lambda: self._exists(name)))

    def delete(self, names: Iterable[str]) -> None:
        """Remove objects (a missing one is not an error)."""
        keys = [self._key(n) for n in names]
        if not keys:
            return

        def remove() -> None:
            for key in keys:
                resp = self._request("DELETE", key, "deleting", ok=(200, 204, 404))
                self._read_all(resp, _ERROR_BODY)
        self._call(f"deleting {len(keys)} object(s)", remove)


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


def _mtime(text: str | None) -> float:
    """ListObjectsV2's ``LastModified`` (ISO 8601, UTC) as a timestamp; 0 if unreadable."""
    if not text:
        return 0.0
    try:
        return datetime.strptime(text[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return 0.0
