"""A small Google Cloud Storage client over ``http.client``: the JSON API's object calls a store
needs, and nothing else.

Why: gcsfs imports aiohttp, google-auth and their dependencies before its first request (0.8 s
of a fresh process on 2 cores, most of what a restore from ``gs://`` cost over one from a
directory). This client imports only the standard library.
:func:`~compile_cache.store.backends.clients.open_backend` uses it when :func:`settings` finds
credentials it can use without signing:

- ``STORAGE_EMULATOR_HOST``: an emulator (or a test server), anonymous, as gcsfs and Google's
  client libraries read it;
- ``GOOGLE_OAUTH_ACCESS_TOKEN``: an OAuth 2 access token the user provides (``gcloud auth
  print-access-token``), sent as it is;
- on Google Compute Engine, GKE or Cloud Run (``GCE_METADATA_HOST``, or a Google machine by its
  DMI product name, read without a request): the metadata server's token for the instance's
  service account, renewed before it expires.

Everything else goes to gcsfs, and doctor says why: a key file in
``GOOGLE_APPLICATION_CREDENTIALS`` (a service account's key signs a JWT with RSA, which the
standard library cannot do), gcloud's application-default credentials, fsspec's ``gcs`` config.

Requests: objects list (``prefix``, paginated), media download (whole, streamed with a size
cap, or ranged for a header), media upload (``uploadType=media``; create-if-absent checks the
object first, then puts with ``ifGenerationMatch=0``: a 412 means another node wrote it; the
check keeps the first writer's object on a server that ignores the condition, as
gcp-storage-emulator does, and the objects written this way are named by their content), and
delete. Faults are the shared ones (:mod:`.rest`): an error names the status and the JSON
error's ``reason``, never the token or the server's message.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, NamedTuple
from urllib.parse import quote, urlencode, urlsplit

from ...redact import check_credential
from .base import ObjectInfo, RemoteError, redact
from .rest import (
    ERROR_BODY,
    BoundedHTTPConnection,
    HttpBackend,
    HttpError,
    Response,
    clean_code,
    iso_mtime,
)

__all__ = ["GcsBackend", "GcsSettings", "credential_sources", "settings"]

#: GCS's own endpoint.
GOOGLE = "https://storage.googleapis.com"
#: The metadata server's token path (GCE, GKE, Cloud Run).
TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"
#: A token is renewed this many seconds before the expiry the metadata server gave.
RENEW_BEFORE = 60.0
#: Largest single media upload (GCS's object limit; packs are far smaller).
MAX_PUT = 5 << 40
_BOUNDARY = "compile-cache-empty-object"


class GcsSettings(NamedTuple):
    """Everything the small GCS client needs for one store URL (a named tuple, not a frozen
    dataclass: ~0.7 ms less in a fresh node's restore, which imports this module; the repr
    never shows the token)."""

    scheme: str  # http or https
    host: str  # host[:port]
    #: ``none`` (anonymous), ``token`` (GOOGLE_OAUTH_ACCESS_TOKEN) or ``metadata``.
    auth: str
    #: Where the credentials come from, as shown (a source, never a value).
    source: str
    token: str | None = None
    metadata_host: str = "metadata.google.internal"

    def __repr__(self) -> str:
        return f"GcsSettings(host={self.host!r}, auth={self.auth!r}, source={self.source!r})"


def _on_google_cloud(env: Mapping[str, str]) -> bool:
    """Whether a metadata server is there, known without a request: ``GCE_METADATA_HOST``, or
    the machine's DMI product name (as google-auth checks on Linux)."""
    if env.get("GCE_METADATA_HOST"):
        return True
    try:
        return Path("/sys/class/dmi/id/product_name").read_text().strip().startswith("Google")
    except OSError:
        return False


def _gcloud_adc(env: Mapping[str, str]) -> Path:
    base = env.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    return Path(base) / "application_default_credentials.json"


def credential_sources(env: Mapping[str, str] | None = None) -> list[tuple[str, bool | None]]:
    """The credential sources looked at (this client's, then gcsfs's), each with whether it is
    there: names of variables and files, never a value (what doctor shows)."""
    env = os.environ if env is None else env
    adc = _gcloud_adc(env)
    shown = (f"$CLOUDSDK_CONFIG/{adc.name}" if env.get("CLOUDSDK_CONFIG")
             else f"~/.config/gcloud/{adc.name}")
    return [
        ("STORAGE_EMULATOR_HOST", bool((env.get("STORAGE_EMULATOR_HOST") or "").strip())),
        ("GOOGLE_OAUTH_ACCESS_TOKEN", bool(env.get("GOOGLE_OAUTH_ACCESS_TOKEN"))),
        ("GOOGLE_APPLICATION_CREDENTIALS", bool(env.get("GOOGLE_APPLICATION_CREDENTIALS"))),
        ("FSSPEC_GCS_*", any(n.startswith(("FSSPEC_GCS", "FSSPEC_GS")) for n in env)),
        (shown, adc.exists()),
        ("the metadata server (GCE_METADATA_HOST or a Google machine)", _on_google_cloud(env)),
    ]


def settings(url: str, env: Mapping[str, str] | None = None) -> tuple[GcsSettings | None, str]:
    """``(settings, "")`` if the small client can serve ``url`` (``gs://bucket/prefix``), else
    ``(None, why not)``: the store then uses gcsfs."""
    env = os.environ if env is None else env
    if not url.split("://", 1)[1].split("/", 1)[0]:
        return None, "no bucket in the URL"
    emulator = (env.get("STORAGE_EMULATOR_HOST") or "").strip()
    if emulator:
        parts = urlsplit(emulator if "://" in emulator else f"http://{emulator}")
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") \
                or parts.query or parts.username or parts.password:
            return None, "a STORAGE_EMULATOR_HOST it does not support"
        return GcsSettings(parts.scheme, parts.netloc, "none",
                           f"none (STORAGE_EMULATOR_HOST {redact(emulator)})"), ""
    default = urlsplit(GOOGLE)
    token = env.get("GOOGLE_OAUTH_ACCESS_TOKEN") or None
    if token:
        check_credential("GOOGLE_OAUTH_ACCESS_TOKEN", token)
        return GcsSettings(default.scheme, default.netloc, "token", "GOOGLE_OAUTH_ACCESS_TOKEN", token), ""
    if env.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return None, ("GOOGLE_APPLICATION_CREDENTIALS names a key file (a service account's key "
                      "signs with RSA, which the standard library cannot)")
    if any(name.startswith(("FSSPEC_GCS", "FSSPEC_GS")) for name in env):
        return None, "fsspec's gcs config is set (FSSPEC_GCS_*)"
    if _gcloud_adc(env).exists():
        return None, "gcloud's application-default credentials (a refresh token gcsfs exchanges)"
    if _on_google_cloud(env):
        return GcsSettings(default.scheme, default.netloc, "metadata",
                           "the metadata server (the instance's service account)",
                           metadata_host=env.get("GCE_METADATA_HOST") or "metadata.google.internal"), ""
    return None, "no emulator, GOOGLE_OAUTH_ACCESS_TOKEN or metadata server"


def _error_code(data: bytes) -> str | None:
    """The JSON error's first ``reason`` (``notFound``, ``forbidden``...), never its message."""
    try:
        error = json.loads(data)["error"]
        errors = error.get("errors") or [{}]
        return str(errors[0].get("reason") or error.get("status") or "") or None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


class GcsBackend(HttpBackend):
    """:class:`~compile_cache.store.backends.base.ObjectBackend` over the GCS JSON API."""

    #: Objects per listing page (the API's most).
    page_size = 1000
    xml_listing = False  # the JSON API

    def __init__(self, url: str, settings: GcsSettings) -> None:
        super().__init__(url)
        self._s = settings
        self.client = f"small GCS client (stdlib; credentials: {settings.source})"
        self._token_lock = threading.Lock()
        self._token: tuple[str, float] | None = None  # (token, renew after), from the metadata server

    def __repr__(self) -> str:
        return f"GcsBackend({redact(self.url)!r})"

    def _where(self) -> tuple[str, str, str | None]:
        return self._s.scheme, self._s.host, None

    # -- credentials ---------------------------------------------------------------------------
    def _bearer(self) -> str | None:
        if self._s.auth == "token":
            return self._s.token
        if self._s.auth != "metadata":
            return None
        with self._token_lock:
            if self._token is None or time.monotonic() >= self._token[1]:
                self._token = self._metadata_token()
            return self._token[0]

    def _metadata_token(self) -> tuple[str, float]:
        """A token from the metadata server, and when to renew it."""
        conn = BoundedHTTPConnection(self._s.metadata_host, timeout=self.limit())
        try:
            conn.request("GET", TOKEN_PATH, headers={"Metadata-Flavor": "Google"})
            resp = conn.getresponse()
            data = resp.read(ERROR_BODY)
        finally:
            conn.close()
        if resp.status != 200:
            raise HttpError(resp.status, clean_code(None, resp.status), "asking the metadata server for a token")
        try:
            answer = json.loads(data)
            token, expires = str(answer["access_token"]), float(answer.get("expires_in", 300))
        except (ValueError, KeyError, TypeError):
            raise OSError("the metadata server's token answer is not readable") from None
        check_credential("the metadata server's access token", token)
        return token, time.monotonic() + max(0.0, expires - RENEW_BEFORE)

    # -- requests ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, what: str, *, query: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, body: bytes | IO[bytes] | None = None,
                 length: int = 0, ok: tuple[int, ...] = (200,)) -> Response:
        """One request (``path`` already encoded); its response if the status is in ``ok``,
        FileNotFoundError on a 404, :class:`~.rest.HttpError` else."""
        sent = {"host": self._s.host, **(headers or {})}
        bearer = self._bearer()
        if bearer:
            sent["authorization"] = f"Bearer {bearer}"
        if method in ("PUT", "POST"):
            sent["content-length"] = str(length)
        target = path + ("?" + urlencode(sorted(query.items()), quote_via=quote) if query else "")
        out = self._exchange(method, target, sent, body, what)
        if out.status in ok:
            return out
        data = self._error_body(method, out)
        code = clean_code(_error_code(data), out.status)
        if out.status == 401 and self._s.auth == "metadata":
            with self._token_lock:
                self._token = None  # expired early: a new one, and a retry, may succeed
            raise HttpError(out.status, code, what, retryable=True)
        if out.status == 404:
            raise FileNotFoundError(f"{redact(self.url)}: {what}: {code or 'not found'}")
        raise HttpError(out.status, code, what)

    def _object_path(self, name: str) -> str:
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self._key(name), safe='')}"

    def _object(self, method: str, name: str, what: str, *, headers: dict[str, str] | None = None,
                ok: tuple[int, ...] = (200,)) -> Response:
        if method == "HEAD":  # the object's metadata: a small JSON answer
            return self._request("GET", self._object_path(name), what, query={"fields": "name"}, ok=ok)
        return self._request(method, self._object_path(name), what,
                             query={"alt": "media"} if method == "GET" else None, headers=headers, ok=ok)

    def _exists(self, name: str) -> bool:
        try:
            resp = self._object("HEAD", name, f"checking {name}")
        except FileNotFoundError:
            return False
        self._read_all(resp, ERROR_BODY)
        return True

    # -- the interface -------------------------------------------------------------------------
    def _list_page(self, base: str, token: str | None, what: str) -> tuple[list[tuple[str, ObjectInfo]], str | None]:
        """One page of the objects list (``pageToken``: the token)."""
        query = {"prefix": base, "maxResults": str(self.page_size),
                 "fields": "items(name,size,updated),nextPageToken"}
        if token:
            query["pageToken"] = token
        path = f"/storage/v1/b/{quote(self.bucket, safe='')}/o"
        answer = json.loads(self._page(self._request("GET", path, what, query=query), what))
        found = [(str(item.get("name") or ""), ObjectInfo(int(item.get("size") or 0), iso_mtime(item.get("updated"))))
                 for item in answer.get("items") or []]
        return found, answer.get("nextPageToken") or None

    def _upload(self, name: str, body: bytes | IO[bytes], length: int, create: bool = False) -> bool:
        """One media upload; False when ``create`` and the object is there (412)."""
        if length > MAX_PUT:
            raise RemoteError(f"{redact(self.url)}/{name}: {length} bytes is over a single upload's limit")
        query = {"uploadType": "media", "name": self._key(name)}
        headers = {"content-type": "application/octet-stream"}
        if length == 0:  # an empty object as a multipart upload (an emulator cannot take an empty media body)
            query["uploadType"] = "multipart"
            headers["content-type"] = f"multipart/related; boundary={_BOUNDARY}"
            body = (f"--{_BOUNDARY}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
                    f"{json.dumps({'name': self._key(name)})}\r\n--{_BOUNDARY}\r\n"
                    f"Content-Type: application/octet-stream\r\n\r\n\r\n--{_BOUNDARY}--\r\n").encode()
            length = len(body)
        if create:
            query["ifGenerationMatch"] = "0"
        resp = self._request("POST", f"/upload/storage/v1/b/{quote(self.bucket, safe='')}/o", f"writing {name}",
                             query=query, headers=headers, body=body, length=length,
                             ok=(200, 412) if create else (200,))
        self._read_all(resp, ERROR_BODY)
        return resp.status != 412

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Write ``name`` unless it exists; False if it did (see the module docstring)."""
        data = bytes(data)

        def conditional() -> bool:
            if self._exists(name):
                return False
            return self._upload(name, data, len(data), create=True)
        return self._call(f"writing {name}", conditional)
