"""A small Azure Blob Storage client over ``http.client``: the Blob REST API's calls a store
needs, and nothing else.

Why: adlfs imports the Azure SDK (azure-core, azure-storage-blob, azure-identity) and aiohttp
before its first request (0.7 s of a fresh process on 2 cores), and at interpreter exit the
SDK's executor is shut down before compile_cache's last stats write, which then failed. This
client imports only the standard library.
:func:`~compile_cache.store.backends.clients.open_backend` uses it when :func:`settings` finds,
in adlfs's own variables and order:

- ``AZURE_STORAGE_CONNECTION_STRING`` with an ``AccountKey`` (Shared Key) or a
  ``SharedAccessSignature`` (its ``BlobEndpoint`` too: Azurite's connection string works as it is);
- ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` (Shared Key) or
  ``AZURE_STORAGE_SAS_TOKEN``.

Shared Key is HMAC-SHA256 over the request (standard library); a SAS token is sent as the
query it is. Everything else goes to adlfs, and doctor says why: Azure AD credentials (a
service principal, a managed identity, ``DefaultAzureCredential``), a URL naming its account
(``abfs://container@account.dfs.core.windows.net``), fsspec's ``az`` config.

Requests: List Blobs (``prefix``, paginated), Get Blob (whole, streamed with a size cap, or
ranged for a header; an empty blob answers a range with 416: read as empty), Put Blob
(``If-None-Match: *`` for create-if-absent: 409 or 412 means another node wrote it; objects
written this way are named by their content), Get Blob Properties, Delete Blob. Faults are the
shared ones (:mod:`.rest`): an error names the status and ``x-ms-error-code``, never a header,
the SAS query or the key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Mapping
from typing import IO, NamedTuple
from urllib.parse import parse_qsl, quote, urlsplit

from ...redact import check_credential
from .base import ObjectInfo, RemoteError, redact
from .rest import ERROR_BODY, HttpBackend, HttpError, Response, clean_code, parse_xml

__all__ = ["AzureBackend", "AzureSettings", "credential_sources", "settings", "shared_key"]

#: The REST API version sent (Put Blob takes up to 5000 MiB in one request since 2019-12-12).
API_VERSION = "2021-08-06"
MAX_PUT = 5000 << 20
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
#: The standard headers Shared Key signs, in its order (then x-ms-* headers, then the resource).
_SIGNED = ("content-encoding", "content-language", "content-length", "content-md5", "content-type",
           "date", "if-modified-since", "if-match", "if-none-match", "if-unmodified-since", "range")


class AzureSettings(NamedTuple):
    """Everything the small Azure client needs for one store URL (a named tuple, not a frozen
    dataclass: ~0.7 ms less in a fresh node's restore, which imports this module; the repr
    never shows the key or the SAS)."""

    account: str
    scheme: str  # http or https
    host: str  # host[:port]
    base_path: str  # the endpoint's path ("" on Azure; "/devstoreaccount1" on Azurite)
    #: Where the credentials come from, as shown (a source, never a value).
    source: str
    key: bytes | None = None  # Shared Key, decoded
    sas: str | None = None  # a SAS token's query, without "?"

    def __repr__(self) -> str:
        return f"AzureSettings(account={self.account!r}, host={self.host!r}, source={self.source!r})"


def _connection_string(text: str) -> dict[str, str]:
    """``Name=value;...`` (a value may hold ``=``), names as written."""
    out = {}
    for part in text.strip().split(";"):
        name, sep, value = part.partition("=")
        if sep and name.strip():
            out[name.strip()] = value.strip()
    return out


def credential_sources(env: Mapping[str, str] | None = None) -> list[tuple[str, bool | None]]:
    """The credential sources looked at (this client's, then adlfs's), each with whether it is
    there: names of variables, never a value (what doctor shows)."""
    env = os.environ if env is None else env
    return [(name, bool(env.get(name))) for name in (
        "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_SECRET")] + [
        ("FSSPEC_AZ*/FSSPEC_ABFS*", any(n.startswith(("FSSPEC_AZ", "FSSPEC_ABFS")) for n in env)),
        ("AZURE_CLIENT_ID/AZURE_TENANT_ID (DefaultAzureCredential)",
         bool(env.get("AZURE_CLIENT_ID") and env.get("AZURE_TENANT_ID"))),
    ]


def settings(url: str, env: Mapping[str, str] | None = None) -> tuple[AzureSettings | None, str]:
    """``(settings, "")`` if the small client can serve ``url`` (``az://container/prefix``),
    else ``(None, why not)``: the store then uses adlfs."""
    env = os.environ if env is None else env
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):
        check_credential(name, env.get(name) or None)
    container = url.split("://", 1)[1].split("/", 1)[0]
    if not container or "@" in container:
        return None, "a URL naming its account (container@account...)" if container else "no container in the URL"
    if any(name.startswith(("FSSPEC_AZ", "FSSPEC_ABFS")) for name in env):
        return None, "fsspec's az config is set (FSSPEC_AZ*/FSSPEC_ABFS*)"
    if env.get("AZURE_STORAGE_CONNECTION_STRING"):
        parts = _connection_string(env["AZURE_STORAGE_CONNECTION_STRING"])
        account, key, sas = parts.get("AccountName", ""), parts.get("AccountKey"), parts.get("SharedAccessSignature")
        source = "AZURE_STORAGE_CONNECTION_STRING"
        protocol = parts.get("DefaultEndpointsProtocol", "https")
        endpoint = parts.get("BlobEndpoint") or (
            f"{protocol}://{account}.blob.{parts.get('EndpointSuffix', 'core.windows.net')}" if account else "")
    else:
        account = env.get("AZURE_STORAGE_ACCOUNT_NAME", "")
        key, sas = env.get("AZURE_STORAGE_ACCOUNT_KEY"), env.get("AZURE_STORAGE_SAS_TOKEN")
        source = "AZURE_STORAGE_ACCOUNT_KEY" if key else "AZURE_STORAGE_SAS_TOKEN"
        endpoint = f"https://{account}.blob.core.windows.net" if account else ""
    if not key and not sas:
        return None, "no account key or SAS token (Azure AD credentials: adlfs with azure-identity)"
    if not endpoint:
        return None, "no account name or blob endpoint"
    where = urlsplit(endpoint)
    if where.scheme not in ("http", "https") or not where.hostname or where.query or where.username:
        return None, "a blob endpoint it does not support"
    if not account:  # a SAS connection string with only BlobEndpoint: the account is the host's first label
        account = where.hostname.split(".", 1)[0]
    decoded = None
    if key:
        try:
            decoded = base64.b64decode(key, validate=True)
        except (binascii.Error, ValueError):
            return None, "an account key that is not base64"
        source += " (Shared Key)"
    else:
        source += " (SAS)"
    return AzureSettings(account, where.scheme, where.netloc, where.path.rstrip("/"), source, decoded,
                         (sas or "").lstrip("?") or None), ""


def shared_key(method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str],
               account: str, key: bytes) -> str:
    """The ``Authorization`` header of a request: Shared Key (HMAC-SHA256 of the canonical
    request, Blob service, version 2009-09-19 and later). ``path`` is the encoded URI path,
    ``headers`` the lower-case headers sent."""
    length = headers.get("content-length", "")
    values = [("" if name == "content-length" and length == "0" else headers.get(name, "")) for name in _SIGNED]
    canonical_headers = "".join(f"{n}:{headers[n].strip()}\n" for n in sorted(headers) if n.startswith("x-ms-"))
    resource = f"/{account}{path}" + "".join(f"\n{k.lower()}:{v}" for k, v in sorted(query.items()))
    to_sign = "\n".join([method, *values]) + "\n" + canonical_headers + resource
    signature = base64.b64encode(hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).digest()).decode()
    return f"SharedKey {account}:{signature}"


def _http_date(when: float | None = None) -> str:
    """RFC 1123 in GMT, whatever the locale."""
    t = time.gmtime(when)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def _mtime(text: str | None) -> float:
    """List Blobs' ``Last-Modified`` (RFC 1123, GMT) as a timestamp; 0 if unreadable."""
    import calendar

    try:
        _, day, month, year, clock, _ = (text or "").split()
        hour, minute, second = (int(x) for x in clock.split(":"))
        return float(calendar.timegm((int(year), _MONTHS.index(month) + 1, int(day), hour, minute, second)))
    except ValueError:
        return 0.0


class AzureBackend(HttpBackend):
    """:class:`~compile_cache.store.backends.base.ObjectBackend` over the Azure Blob REST API."""

    #: Blobs per List Blobs page (the API's most).
    page_size = 5000

    def __init__(self, url: str, settings: AzureSettings) -> None:
        super().__init__(url)
        self._s = settings
        self.client = f"small Azure Blob client (stdlib; credentials: {settings.source})"

    def _where(self) -> tuple[str, str, str | None]:
        return self._s.scheme, self._s.host, None

    @property
    def endpoint(self) -> str:  # type: ignore[override]
        """The blob endpoint (``scheme://host[:port]/base``), as doctor shows it."""
        return f"{self._s.scheme}://{self._s.host}{self._s.base_path}"

    def _path(self, key: str | None) -> str:
        """The encoded URI path of the container (``key`` None) or of a blob."""
        path = f"{self._s.base_path}/{quote(self.bucket, safe='')}"
        return path if key is None else f"{path}/{quote(key, safe='/-_.~')}"

    def _request(self, method: str, key: str | None, what: str, *, query: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, body: bytes | IO[bytes] | None = None,
                 length: int = 0, ok: tuple[int, ...] = (200,)) -> Response:
        """One signed request on the container or blob ``key``; its response if the status is
        in ``ok``, FileNotFoundError on a 404, :class:`~.rest.HttpError` else."""
        query = dict(query or {})
        path = self._path(key)
        sent = {k.lower(): v for k, v in (headers or {}).items()}
        sent.update({"host": self._s.host, "x-ms-date": _http_date(), "x-ms-version": API_VERSION})
        if method in ("PUT", "POST"):
            sent["content-length"] = str(length)
        if self._s.key is not None:
            sent["authorization"] = shared_key(method, path, query, sent, self._s.account, self._s.key)
        else:
            query.update(parse_qsl(self._s.sas or "", keep_blank_values=True))
        target = path + ("?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in query.items())
                         if query else "")
        out = self._exchange(method, target, sent, body, what)
        if out.status in ok:
            return out
        data = self._error_body(method, out)
        code = out.resp.getheader("x-ms-error-code")
        if not code and b"<Code>" in data:
            code = data.split(b"<Code>", 1)[1].split(b"</Code>", 1)[0][:100].decode("ascii", "replace")
        code = clean_code(code, out.status)
        if out.status == 404:
            raise FileNotFoundError(f"{redact(self.url)}: {what}: {code or 'not found'}")
        raise HttpError(out.status, code, what)

    def _object(self, method: str, name: str, what: str, *, headers: dict[str, str] | None = None,
                ok: tuple[int, ...] = (200,)) -> Response:
        return self._request(method, self._key(name), what, headers=headers, ok=ok)

    # -- the interface -------------------------------------------------------------------------
    def _list_page(self, base: str, token: str | None, what: str) -> tuple[list[tuple[str, ObjectInfo]], str | None]:
        """One List Blobs page (``marker``: the token)."""
        query = {"restype": "container", "comp": "list", "maxresults": str(self.page_size)}
        if base:
            query["prefix"] = base
        if token:
            query["marker"] = token
        tree = parse_xml(self._page(self._request("GET", None, what, query=query), what))
        found = [(blob.findtext("Name") or "",
                  ObjectInfo(int(blob.findtext("Properties/Content-Length") or 0),
                             _mtime(blob.findtext("Properties/Last-Modified")))) for blob in tree.iter("Blob")]
        return found, tree.findtext("NextMarker") or None

    def _upload(self, name: str, body: bytes | IO[bytes], length: int, create: bool = False) -> bool:
        """One Put Blob; False when ``create`` and the blob is there (409 or 412)."""
        if length > MAX_PUT:
            raise RemoteError(f"{redact(self.url)}/{name}: {length} bytes is over a single Put Blob's limit")
        headers = {"x-ms-blob-type": "BlockBlob", "content-type": "application/octet-stream"}
        if create:
            headers["if-none-match"] = "*"
        resp = self._request("PUT", self._key(name), f"writing {name}", headers=headers, body=body,
                             length=length, ok=(201, 409, 412) if create else (201,))
        self._read_all(resp, ERROR_BODY)
        return resp.status == 201

    def put_if_absent(self, name: str, data: bytes) -> bool:
        """Write ``name`` unless it exists; False if it did (``If-None-Match: *``: 409/412)."""
        data = bytes(data)
        return self._call(f"writing {name}", lambda: self._upload(name, data, len(data), create=True))
