"""The HTTP pieces every standard-library object storage client shares (S3, GCS, Azure Blob):
one kept-alive connection per thread, a whole-request deadline, bounded reads, paginated
listings, and the object reads (get, a streamed download, a ranged head) built on one
``_object`` request each client signs its own way.

Why one module: the clients differ only in how a request is addressed and signed and how an
error is read; how bytes move, how long a request may take and what a fault is must not differ.

Faults: a timeout, a connection error, a 5xx, 408 or 429 raises :class:`HttpError` with
``retryable`` True (retried by :class:`~.base.RetryingBackend`); any other 4xx cannot succeed by
trying again and raises one with ``retryable`` False (one try, then
:class:`~.base.RemoteError`); a 404 is a missing object (FileNotFoundError). An error names the
status and the service's error code, never a header, a URL's query or a credential.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from typing import IO, Any

from .base import (
    ObjectInfo,
    RetryingBackend,
    TooLargeError,
    copy_bounded,
)

__all__ = ["BoundedHTTPConnection", "BoundedHTTPSConnection", "HttpBackend", "HttpError", "NameLookupError", "Response", "XmlElement", "clean_code", "iso_mtime", "paginate",
           "parse_xml"]

#: Bytes of an error response read for its code.
ERROR_BODY = 64 << 10
#: A request's body may take one more second per this many bytes received (see _Deadline).
MIN_RATE = 64 << 10
#: A listing stops with an error past this many pages or objects (a server that always
#: answers "more" would otherwise loop for ever, growing memory), or when the server repeats
#: a continuation token.
MAX_LIST_PAGES = 5000
MAX_LIST_OBJECTS = 1_000_000
#: Bytes of one listing page read at most (a page of 1,000 keys is about 300 KB).
MAX_PAGE_BYTES = 16 << 20
_CODE_CHARS = re.compile(r"[^A-Za-z0-9 ._-]")


class HttpError(OSError):
    """A response that is a fault: its HTTP status and the service's error code (nothing else).

    ``retryable``: whether trying again can succeed (a 5xx, 408 or 429 by default); a 400, 401,
    403 or 405 cannot, and is not retried.
    """

    def __init__(self, status: int, code: str, what: str, detail: str = "",
                 retryable: bool | None = None) -> None:
        super().__init__(f"HTTP {status} {code} ({what}){detail}")
        self.status = status
        self.code = code
        self.retryable = (status >= 500 or status in (408, 429)) if retryable is None else retryable


def clean_code(code: str | None, status: int) -> str:
    """A server's error code as shown (the status's name if it gave none): a few safe
    characters, so no newline of the server's text reaches a warning."""
    return _CODE_CHARS.sub("", code or http.client.responses.get(status, ""))[:64]


class _Deadline:
    """The time limit of one whole request, not only of each socket read: a server that drips a
    byte now and then never holds a job past it. The server must answer (status and headers)
    within ``seconds``; then the body may take ``seconds`` plus one second per
    :data:`MIN_RATE` bytes received. When the time is up the process's watchdog thread
    (:class:`_Watchdog`) shuts the connection's socket down, which ends any read blocked on it;
    the read then raises :class:`TimeoutError`.
    """

    def __init__(self, conn: http.client.HTTPConnection, seconds: float, start: float | None = None) -> None:
        self._conn = conn
        self._start = time.monotonic() if start is None else start
        self._seconds = seconds
        self.expires = self._start + seconds
        self.fired = False
        self.cancelled = False
        _watchdog().watch(self)

    def due(self, now: float) -> bool:
        """The watchdog's call at the time it was given: ends the request and returns False if
        its time is up, else True (the body made progress meanwhile: watch it to its new time)."""
        if self.cancelled:
            return False
        if now < self.expires - 0.01:
            return True
        self.fired = True
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return False

    def received(self, total: int) -> None:
        """``total`` body bytes have arrived: the deadline grows with them."""
        self.expires = self._start + self._seconds + total / MIN_RATE

    def cancel(self) -> None:
        self.cancelled = True

    def check(self, what: str) -> None:
        """Raise TimeoutError if the deadline ended the request."""
        if self.fired:
            raise TimeoutError(f"{what}: no complete answer within the request's deadline")


class _Watchdog:
    """One daemon thread per process that ends the requests whose deadline passed. A timer
    thread per request would start and end with every request, each time taking the GIL from
    the job's thread (a fresh node's restore makes its requests while the job imports); this
    one starts once, and sleeps until the earliest deadline it was given (a new deadline,
    later than that, does not wake it; a request that ends only marks its deadline cancelled)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, _Deadline]] = []
        self._order = itertools.count()
        self._wakes_at = float("inf")  # when the thread wakes next (inf: when told)
        self._thread: threading.Thread | None = None

    def watch(self, deadline: _Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline.expires, next(self._order), deadline))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="compile-cache-deadlines", daemon=True)
                self._thread.start()
            elif deadline.expires < self._wakes_at:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].cancelled or self._heap[0][0] <= now):
                    _, _, deadline = heapq.heappop(self._heap)
                    if deadline.due(now):
                        heapq.heappush(self._heap, (deadline.expires, next(self._order), deadline))
                self._wakes_at = self._heap[0][0] if self._heap else float("inf")
                self._cond.wait(None if not self._heap else max(0.0, self._wakes_at - now))


_watchdog_of: tuple[int, _Watchdog] | None = None
_watchdog_lock = threading.Lock()


def _watchdog() -> _Watchdog:
    """This process's watchdog (a forked child makes its own: the thread is not copied)."""
    global _watchdog_of
    current = _watchdog_of
    if current is not None and current[0] == os.getpid():
        return current[1]
    with _watchdog_lock:
        if _watchdog_of is None or _watchdog_of[0] != os.getpid():
            _watchdog_of = (os.getpid(), _Watchdog())
        return _watchdog_of[1]


def _new_watchdog_lock_in_child() -> None:
    global _watchdog_lock  # a fork while another thread held it would leave it held
    _watchdog_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_watchdog_lock_in_child)


class NameLookupError(socket.gaierror):
    """The endpoint's host name has no address, or its lookup took longer than a request may."""


class _Lookup:
    """One name lookup asked of the :class:`_Resolver`: its answer or error, once ``done``."""

    __slots__ = ("abandoned", "answer", "done", "error", "host", "port")

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.done = threading.Event()
        self.answer: list[Any] = []
        self.error: BaseException | None = None
        self.abandoned = False


class _Resolver:
    """One daemon thread per process that looks host names up, one after the other: a lookup
    cannot be interrupted, so the request that asked waits for it at most its deadline, and
    goes on without it. One thread, started with the first lookup, not one per connection (see
    :class:`_Watchdog`); a lookup that hangs holds up the ones behind it, each of which ends at
    its own deadline (a resolver that does not answer one name rarely answers the next)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[_Lookup] = []
        self._thread: threading.Thread | None = None

    def lookup(self, host: str, port: int, seconds: float) -> list[Any]:
        """``getaddrinfo(host, port)`` for a TCP connection, waited for at most ``seconds``."""
        asked = _Lookup(host, port)
        with self._cond:
            self._queue.append(asked)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="compile-cache-lookup", daemon=True)
                self._thread.start()
            else:
                self._cond.notify()
        if not asked.done.wait(seconds):
            asked.abandoned = True
            raise NameLookupError(socket.EAI_AGAIN, f"{host}: no address within {seconds:g} s")
        if asked.error is not None:
            raise NameLookupError(socket.EAI_NONAME, f"{host}: the name does not resolve ({asked.error})")
        return asked.answer

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                asked = self._queue.pop(0)
            if asked.abandoned:
                continue
            try:
                asked.answer = socket.getaddrinfo(asked.host, asked.port, 0, socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:
                asked.error = exc
            asked.done.set()


_resolver_of: tuple[int, _Resolver] | None = None


def _lookup(host: str, port: int, seconds: float) -> list[Any]:
    """``getaddrinfo`` of ``host``, waited for at most ``seconds`` (this process's
    :class:`_Resolver`): a resolver that does not answer (a closed network) must not hold a
    request past its deadline, and a socket's timeout does not cover the lookup. An address
    needs no lookup."""
    global _resolver_of
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    current = _resolver_of
    if current is None or current[0] != os.getpid():
        with _watchdog_lock:
            if _resolver_of is None or _resolver_of[0] != os.getpid():
                _resolver_of = (os.getpid(), _Resolver())
            current = _resolver_of
    return current[1].lookup(host, port, seconds)


def _connect(address: tuple[str, int], timeout: float, source_address: Any = None) -> socket.socket:
    """``socket.create_connection`` with one limit, ``timeout``, for the name's lookup and the
    connection together (:func:`_lookup`); the socket keeps ``timeout`` for each later read."""
    host, port = address
    end = time.monotonic() + timeout
    last: OSError | None = None
    for family, kind, proto, _name, where in _lookup(host, port, timeout):
        left = end - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            if source_address:
                sock.bind(source_address)
            sock.connect(where)
            sock.settimeout(timeout)
            return sock
        except OSError as exc:
            last = exc
            sock.close()
    raise last or TimeoutError(f"connecting to {host}:{port}: no connection within {timeout:g} s")


class BoundedHTTPConnection(http.client.HTTPConnection):
    """``http.client``'s connection whose connect bounds the name's lookup too (:func:`_connect`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _connect


class BoundedHTTPSConnection(http.client.HTTPSConnection):
    """:class:`BoundedHTTPConnection` over TLS."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = _connect


class Response:
    """A response whose body the caller reads, on a connection dropped unless read to the end."""

    def __init__(self, backend: HttpBackend, resp: http.client.HTTPResponse, deadline: _Deadline) -> None:
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


def iso_mtime(text: str | None) -> float:
    """A listing's time (ISO 8601, UTC: S3's ``LastModified``, GCS's ``updated``) as a
    timestamp; 0 if unreadable."""
    if not text:
        return 0.0
    try:  # fromisoformat is built in: datetime.strptime imports _strptime on first use
        return datetime.fromisoformat(text[:19]).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return 0.0


class XmlElement:
    """One element of a parsed XML document (:func:`parse_xml`): its local name (any namespace
    dropped), its text and its children: what a listing page needs of ElementTree's API."""

    __slots__ = ("children", "tag", "text")

    def __init__(self, tag: str) -> None:
        self.tag, self.text, self.children = tag, "", []

    def find(self, path: str) -> XmlElement | None:
        """The first element at ``path`` (child names joined by ``/``) below this one, or None."""
        here: XmlElement | None = self
        for name in path.split("/"):
            here = next((c for c in here.children if c.tag == name), None) if here is not None else None
        return here

    def findtext(self, path: str) -> str | None:
        """The text of :meth:`find`'s element ("" if it has none), None if there is none."""
        found = self.find(path)
        return None if found is None else found.text

    def iter(self, tag: str) -> Iterator[XmlElement]:
        """This element and every one below it named ``tag``, in document order."""
        stack = [self]  # no recursion: a hostile page may nest deep
        while stack:
            element = stack.pop()
            if element.tag == tag:
                yield element
            stack.extend(reversed(element.children))


def parse_xml(data: bytes) -> XmlElement:
    """The root of the XML document ``data``, parsed by expat (the C parser under
    ``xml.etree``, whose Python module costs a start's thread 3 ms to import; expat's limits on
    entity expansion apply as they do there). Raises ``pyexpat.ExpatError`` for a document that
    is not well-formed (a fault, retried like any other)."""
    import pyexpat

    parser = pyexpat.ParserCreate(namespace_separator=" ")
    stack: list[XmlElement] = []
    text: list[list[str]] = []
    root: list[XmlElement] = []

    def start(name: str, _attrs: Any) -> None:
        element = XmlElement(name.rpartition(" ")[2])
        (stack[-1].children if stack else root).append(element)
        stack.append(element)
        text.append([])

    def end(_name: str) -> None:
        stack.pop().text = "".join(text.pop())

    def chars(data: str) -> None:
        if text:
            text[-1].append(data)

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler = chars
    parser.Parse(data, True)
    if not root:
        raise pyexpat.ExpatError("no element")
    return root[0]


def paginate(fetch: Callable[[str | None], tuple[dict[str, ObjectInfo], str | None]], what: str,
             max_pages: int = MAX_LIST_PAGES, max_objects: int = MAX_LIST_OBJECTS) -> dict[str, ObjectInfo]:
    """Every page of a listing: ``fetch(token)`` returns a page's objects and the next page's
    token (None at the end). Stops with OSError past ``max_pages`` pages or ``max_objects``
    objects, or when the server repeats a token (a server that always says "more")."""
    import hashlib

    out: dict[str, ObjectInfo] = {}
    token: str | None = None
    seen: set[bytes] = set()  # digests of the tokens given
    for _page in range(max_pages):
        found, token = fetch(token)
        out.update(found)
        if len(out) > max_objects:
            raise OSError(f"{what}: more than {max_objects} objects")
        if not token:
            return out
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        if digest in seen:
            raise OSError(f"{what}: the server repeated a continuation token")
        seen.add(digest)
    raise OSError(f"{what}: more than {max_pages} pages")


class HttpBackend(RetryingBackend):
    """An :class:`~.base.ObjectBackend`'s HTTP transport and object reads; a client adds how a
    request is addressed and signed (:meth:`_object`), listing, writing and deleting."""

    parallel = True
    #: Whether listings come as XML (S3, Azure): :meth:`preload` imports the parser.
    xml_listing = True

    def preload(self) -> None:
        """The modules a request imports on first use: the codec the socket module encodes a
        host name with (``encodings.idna``), the listings' XML parser (:func:`parse_xml`'s
        ``pyexpat``: S3, Azure; not GCS, whose listings are JSON), Azure's date parser
        (``calendar``), and ``ssl`` for https."""
        import calendar  # noqa: F401
        import encodings.idna  # noqa: F401

        if self.xml_listing:
            import pyexpat  # noqa: F401  (parse_xml's; 0.6 ms, xml.etree's module 3 ms more)
        if self._where()[0] == "https":
            import ssl  # noqa: F401

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._local = threading.local()
        #: The bucket (Azure: the container) and the prefix of the URL's objects.
        self.bucket, _, prefix = self.url.split("://", 1)[1].partition("/")
        self.prefix = prefix.strip("/")

    @property
    def endpoint(self) -> str:  # type: ignore[override]
        """Where requests go (``scheme://host[:port]``), as doctor shows it."""
        scheme, where, _ = self._where()
        return f"{scheme}://{where}"

    def _key(self, name: str) -> str:
        """The object key of ``name`` (under the URL's prefix)."""
        return "/".join(p for p in (self.prefix, name) if p)

    # -- what a client says --------------------------------------------------------------------
    def _where(self) -> tuple[str, str, str | None]:
        """(``http`` or ``https``, ``host[:port]``, a CA bundle or None) of the next request."""
        raise NotImplementedError

    def _object(self, method: str, name: str, what: str, *, headers: dict[str, str] | None = None,
                ok: tuple[int, ...] = (200,)) -> Response:
        """One bodiless request on the object ``name``; its response if the status is in ``ok``,
        FileNotFoundError on a 404, :class:`HttpError` else."""
        raise NotImplementedError

    # -- connections ---------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            scheme, where, ca_bundle = self._where()
            host, _, port = where.rpartition(":") if where.count(":") == 1 else (where, "", "")
            host = host or where
            if scheme == "https":
                import ssl

                conn = BoundedHTTPSConnection(host, int(port) if port else None, timeout=self.timeout,
                                        blocksize=1 << 16, context=ssl.create_default_context(cafile=ca_bundle))
            else:
                conn = BoundedHTTPConnection(host, int(port) if port else None, timeout=self.timeout, blocksize=1 << 16)
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

    def _exchange(self, method: str, target: str, headers: dict[str, str],
                  body: bytes | IO[bytes] | None, what: str) -> Response:
        """Send one request (``target``: the encoded path and query) and read its status and
        headers within the deadline. A kept-alive connection the server had closed is replaced
        and the request sent once more, at once."""
        for fresh in (False, True):
            reused = getattr(self._local, "conn", None) is not None and not fresh
            conn = self._conn()
            start, limit = time.monotonic(), self.limit()
            conn.timeout = limit  # the connection's setup and each read (a first request: shorter)
            if conn.sock is None:
                try:
                    conn.connect()  # now, so that the deadline can reach the socket
                except BaseException:
                    self.drop()
                    raise
            else:
                conn.sock.settimeout(limit)
            deadline = _Deadline(conn, limit, start)
            try:
                conn.request(method, target, body=body, headers=headers)
                return Response(self, conn.getresponse(), deadline)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                deadline.cancel()
                self.drop()
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
        raise AssertionError("unreachable")  # pragma: no cover

    def _error_body(self, method: str, resp: Response) -> bytes:
        """The start of an error response's body (its code is in it); the connection is kept
        only if that was all of it."""
        data = resp.resp.read(ERROR_BODY) if method != "HEAD" else b""
        resp.finish(len(data) < ERROR_BODY)
        return data

    def _read_all(self, resp: Response, limit: int) -> bytes:
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

    def _page(self, resp: Response, what: str) -> bytes:
        """A listing page's body, refused past :data:`MAX_PAGE_BYTES`."""
        data = self._read_all(resp, MAX_PAGE_BYTES)
        if len(data) > MAX_PAGE_BYTES:
            raise OSError(f"{what}: a page over {MAX_PAGE_BYTES} bytes")
        return data

    # -- object reads, the same for every client -----------------------------------------------
    def get(self, name: str, limit: int) -> bytes | None:
        """The object ``name`` (at most ``limit`` bytes read), or None if it does not exist."""
        def fetch() -> bytes:
            resp = self._object("GET", name, f"reading {name}")
            if resp.length is not None and resp.length > limit:
                resp.finish(False)
                raise TooLargeError(resp.length)
            return self._read_all(resp, limit)
        return self._bounded_get(name, limit, fetch)

    def download(self, name: str, out: IO[bytes], limit: int) -> int:
        """Stream ``name`` into ``out`` in chunks, refusing more than ``limit`` bytes; returns
        its size. Raises FileNotFoundError if it is gone, :class:`TooLargeError` over the limit,
        RemoteError on a fault."""
        def stream() -> int:
            out.seek(0)
            out.truncate()
            resp = self._object("GET", name, f"downloading {name}")
            complete = False
            try:
                total = copy_bounded(resp.read, out, limit, resp.length)
                complete = True
                return total
            finally:
                resp.finish(complete)
        return self._call(f"downloading {name}", stream)

    def head(self, name: str, n: int) -> bytes:
        """The first ``n`` bytes of ``name`` (one ranged read: a pack's header for a listing).
        An empty object answers a range with 416 (Azure): it reads as b"", not a fault."""
        def fetch() -> bytes:
            if n <= 0:
                return b""
            resp = self._object("GET", name, f"reading {name}", headers={"range": f"bytes=0-{n - 1}"},
                                ok=(200, 206, 416))
            if resp.status == 416:  # an empty object
                resp.finish(False)
                return b""
            return self._read_all(resp, n)[:n]
        return self._call(f"reading {name}", fetch)

    # -- listing -------------------------------------------------------------------------------
    def _list_page(self, base: str, token: str | None, what: str) -> tuple[list[tuple[str, ObjectInfo]], str | None]:
        """One page of the keys that start with ``base``: (key, info) pairs, and the next
        page's token (None at the end). FileNotFoundError if there is no bucket."""
        raise NotImplementedError

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object under ``prefix`` (recursive, page by page): its name relative to the
        store's URL -> its info; empty if there is none (or no bucket)."""
        base = self._key(prefix)
        if base:
            base += "/"
        root = f"{self.prefix}/" if self.prefix else ""
        what = f"listing {prefix or '/'}"

        def page(token: str | None) -> tuple[dict[str, ObjectInfo], str | None]:
            found, token = self._list_page(base, token, what)
            return {key[len(root):]: info for key, info in found
                    if key.startswith(root) and not key.endswith("/")}, token

        def find() -> dict[str, ObjectInfo]:
            try:
                return paginate(page, what, MAX_LIST_PAGES, MAX_LIST_OBJECTS)
            except FileNotFoundError:  # no bucket
                return {}
        return self._call(what, find)

    # -- writes, the same for the clients that implement _upload ------------------------------
    def _upload(self, name: str, body: bytes | IO[bytes], length: int, create: bool = False) -> bool:
        """One upload of ``name``; False when ``create`` and the object is there (another
        node wrote it)."""
        raise NotImplementedError

    def put(self, name: str, data: bytes) -> None:
        """Write ``name`` whole (an object store makes a put atomic: readers see old or new)."""
        data = bytes(data)
        self._call(f"writing {name}", lambda: self._upload(name, data, len(data)))

    def put_file(self, name: str, path: str) -> None:
        """Upload the local file ``path`` as ``name`` (streamed from disk)."""
        def upload() -> None:
            with open(path, "rb") as fh:
                self._upload(name, fh, os.fstat(fh.fileno()).st_size)
        self._call(f"uploading {name}", upload)

    def delete(self, names: Iterable[str]) -> None:
        """Remove objects (a missing one is not an error)."""
        names = list(names)
        if not names:
            return

        def remove() -> None:
            for name in names:
                resp = self._object("DELETE", name, "deleting", ok=(200, 202, 204, 404))
                self._read_all(resp, ERROR_BODY)
        self._call(f"deleting {len(names)} object(s)", remove)

    def _exists(self, name: str) -> bool:
        try:
            resp = self._object("HEAD", name, f"checking {name}")
        except FileNotFoundError:
            return False
        resp.finish(True)
        return True

    def exists(self, name: str) -> bool:
        """Whether the object ``name`` exists."""
        return bool(self._call(f"checking {name}", lambda: self._exists(name)))
