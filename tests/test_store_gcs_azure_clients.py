"""The small ``gs://`` and ``az://`` clients (compile_cache.store.backends.gcs, .azure) against a
tiny HTTP server in this process that answers with the status a test sets: a conflict on
create is "another node wrote it", a 403 is not retried, a 5xx is, and no credential (a bearer
token, an account key, a SAS signature) reaches an error, a repr, doctor's text or the log.
Also which configurations each client takes and which it leaves to gcsfs / adlfs, and why.
(Round trips against the emulators: tests/test_store_remote_emulators.py.)
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from compile_cache.store.backends import RemoteError, open_backend
from compile_cache.store.backends import azure as azure_client
from compile_cache.store.backends import gcs as gcs_client
from compile_cache.store.backends.gcs import GcsBackend, GcsSettings

TOKEN = "ya29.secret-bearer-token-value"
KEY = base64.b64encode(b"secret-account-key-bytes-0123456").decode()
SIG = "c2VjcmV0LXNhcy1zaWduYXR1cmU%3D"


class _Fake(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``status`` (and the service's error body), except: a GCS
    metadata check (404, the object is not there), the metadata server's token, and, with
    ``conflict_only``, anything but a conditional put (200/201)."""

    protocol_version = "HTTP/1.1"
    status = 503
    conflict_only = False
    seen: list[tuple[str, str, dict[str, str]]] = []
    tokens = 0
    unauthorized = 0

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        cls = type(self)
        cls.seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
        query = parse_qs(urlsplit(self.path).query)
        if self.path.startswith(gcs_client.TOKEN_PATH):
            cls.tokens += 1
            return self._send(200, json.dumps({"access_token": TOKEN, "expires_in": 3600}).encode())
        conditional = "ifGenerationMatch" in query or self.headers.get("If-None-Match") == "*"
        status = cls.status
        if cls.unauthorized:  # the next few requests: the token has expired early
            cls.unauthorized -= 1
            return self._send(401, b'{"error": {"code": 401, "errors": [{"reason": "authError"}]}}')
        if cls.conflict_only and not conditional:
            status = 404 if self.command in ("GET", "HEAD") else 201 if self.path.count("/") > 1 else 200
        if self.path.startswith("/upload/") and status == 201:
            status = 200
        body = (json.dumps({"error": {"code": status, "message": f"no {TOKEN}",
                                      "errors": [{"reason": "forbidden" if status == 403 else "backendError"}]}})
                if "/storage/v1/" in self.path else
                f"<Error><Code>{'AuthorizationFailure' if status == 403 else 'ServerBusy'}</Code></Error>")
        self._send(status, body.encode() if status >= 300 else b"{}")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        code = {403: "AuthorizationFailure", 409: "BlobAlreadyExists", 412: "ConditionNotMet"}.get(status)
        if code and "/storage/v1/" not in self.path:  # Azure's error code header (5xx: in the body)
            self.send_header("x-ms-error-code", code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[type[_Fake], str]]:
    """The fake server (its own handler class) and its ``host:port``; a clean environment."""
    for name in list(os.environ):
        if name.startswith(("COMPILE_CACHE_", "AZURE_", "GOOGLE_", "STORAGE_EMULATOR", "FSSPEC_", "GCE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_RETRIES", "2")
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    handler = type("Handler", (_Fake,), {"seen": [], "tokens": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _backend(scheme: str, host: str, monkeypatch: pytest.MonkeyPatch, sas: bool = False):
    """A small client of ``scheme`` pointed at ``host``, with a credential to keep secret."""
    if scheme == "gs":  # a user's token (the emulator variable would make it anonymous)
        return GcsBackend("gs://bkt/cache", GcsSettings("http", host, "token", "GOOGLE_OAUTH_ACCESS_TOKEN", TOKEN))
    credential = f"SharedAccessSignature=sv=2021-08-06&sp=rw&sig={SIG}" if sas else f"AccountKey={KEY}"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       f"DefaultEndpointsProtocol=http;AccountName=acct;{credential};BlobEndpoint=http://{host}/acct;")
    backend = open_backend("az://bkt/cache")
    assert isinstance(backend, azure_client.AzureBackend)
    return backend


def _secrets_absent(*texts: str) -> None:
    for text in texts:
        for secret in (TOKEN, KEY, SIG, "sig="):
            assert secret not in text, text


@pytest.mark.parametrize("scheme", ["gs", "az"])
@pytest.mark.parametrize("status", [403, 503])
def test_a_403_is_not_retried_a_5xx_is_and_no_credential_is_shown(
    fake: tuple[type[_Fake], str], scheme: str, status: int, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler, host = fake
    handler.status = status
    backend = _backend(scheme, host, monkeypatch)
    caplog.set_level(logging.DEBUG, logger="compile_cache")
    with pytest.raises(RemoteError, match=f"HTTP {status}") as caught:
        backend.get("x", 10)
    assert len(handler.seen) == (1 if status == 403 else 3)  # 2 retries of a 5xx, none of a 403
    code = {"gs": {403: "forbidden", 503: "backendError"}, "az": {403: "AuthorizationFailure", 503: "ServerBusy"}}
    assert code[scheme][status] in str(caught.value)
    _secrets_absent(str(caught.value), repr(caught.value), repr(backend), backend.client, backend.why, caplog.text)
    auth = handler.seen[0][2]["authorization"]
    assert auth == f"Bearer {TOKEN}" if scheme == "gs" else auth.startswith("SharedKey acct:")


@pytest.mark.parametrize(("scheme", "status"), [("gs", 412), ("az", 409), ("az", 412)])
def test_a_conflict_on_create_means_another_node_wrote_it(
    fake: tuple[type[_Fake], str], scheme: str, status: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GCS answers a create (``ifGenerationMatch=0``) that finds the object with 412; Azure
    (``If-None-Match: *``) with 409 BlobAlreadyExists or 412: not a fault, not retried, and
    no object written over; a plain put is unconditional."""
    handler, host = fake
    handler.status, handler.conflict_only = status, True
    backend = _backend(scheme, host, monkeypatch)
    assert backend.put_if_absent("entries/x.pack", b"data") is False
    puts = [(m, p, h) for m, p, h in handler.seen if m in ("PUT", "POST")]
    assert len(puts) == 1
    if scheme == "gs":  # checked first (a server that ignores the condition keeps the first)
        assert handler.seen[0][0] == "GET" and parse_qs(urlsplit(puts[0][1]).query)["ifGenerationMatch"] == ["0"]
    else:  # Azure enforces the condition: no check first
        assert len(handler.seen) == 1 and puts[0][2]["if-none-match"] == "*"
    backend.put("entries/y.pack", b"data")
    assert "if-none-match" not in handler.seen[-1][2] and "ifGenerationMatch" not in handler.seen[-1][1]


def test_a_sas_token_travels_in_the_query_and_is_never_shown(
    fake: tuple[type[_Fake], str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    handler, host = fake
    handler.status = 403
    backend = _backend("az", host, monkeypatch, sas=True)
    assert backend.client == "small Azure Blob client (stdlib; credentials: AZURE_STORAGE_CONNECTION_STRING (SAS))"
    caplog.set_level(logging.DEBUG, logger="compile_cache")
    with pytest.raises(RemoteError, match="HTTP 403 AuthorizationFailure") as caught:
        backend.list("v1")
    method, path, headers = handler.seen[0]
    assert "authorization" not in headers
    assert parse_qs(urlsplit(path).query)["sig"] == ["c2VjcmV0LXNhcy1zaWduYXR1cmU="]
    _secrets_absent(str(caught.value), repr(backend), caplog.text)


def test_the_metadata_server_token_is_asked_once_and_sent(
    fake: tuple[type[_Fake], str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On GCE/GKE (``GCE_METADATA_HOST``) the client asks the metadata server for the
    instance's token once, sends it as a bearer token, and never shows it."""
    handler, host = fake
    handler.status, handler.conflict_only = 412, True
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    found, why = gcs_client.settings("gs://bkt/cache")
    assert found is not None and found.auth == "metadata" and why == ""
    backend = GcsBackend("gs://bkt/cache", GcsSettings("http", host, "metadata", found.source, metadata_host=host))
    assert backend.get("a", 10) is None and backend.get("b", 10) is None
    assert handler.tokens == 1
    assert [h["authorization"] for m, p, h in handler.seen if "/storage/v1/" in p] == [f"Bearer {TOKEN}"] * 2
    assert handler.seen[0][2]["metadata-flavor"] == "Google"
    _secrets_absent(repr(backend), backend.client)
    # A 401 (the token revoked or expired early): a new token, and the request once more.
    handler.unauthorized = 1
    assert backend.get("c", 10) is None
    assert handler.tokens == 2 and [m for m, p, h in handler.seen[-3:]] == ["GET"] * 3


@pytest.mark.parametrize(("env", "why"), [
    ({"GOOGLE_APPLICATION_CREDENTIALS": "/keys/sa.json"}, "RSA"),
    ({}, "no emulator, GOOGLE_OAUTH_ACCESS_TOKEN or metadata server"),
    ({"FSSPEC_GCS_TOKEN": "cloud"}, "fsspec's gcs config"),
])
def test_what_the_small_gcs_client_leaves_to_gcsfs(env: dict[str, str], why: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gcs_client, "_on_google_cloud", lambda env: False)  # whatever machine runs this
    found, reason = gcs_client.settings("gs://bkt/cache", {"HOME": str(tmp_path), **env})
    assert found is None and why in reason
    token, _ = gcs_client.settings("gs://bkt/cache", {"HOME": str(tmp_path), "GOOGLE_OAUTH_ACCESS_TOKEN": TOKEN})
    assert token is not None and token.auth == "token" and TOKEN not in repr(token)


@pytest.mark.parametrize(("env", "url", "why"), [
    ({"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_CLIENT_SECRET": "s"}, "az://c/p", "Azure AD"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": KEY}, "abfs://c@acct.dfs.core.windows.net/p",
     "naming its account"),
    ({"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": "not base64!"}, "az://c/p", "not base64"),
])
def test_what_the_small_azure_client_leaves_to_adlfs(env: dict[str, str], url: str, why: str) -> None:
    found, reason = azure_client.settings(url, env)
    assert found is None and why in reason
    ok, _ = azure_client.settings("az://c/p", {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_ACCOUNT_KEY": KEY})
    assert ok is not None and ok.host == "acct.blob.core.windows.net" and ok.scheme == "https"
    assert KEY not in repr(ok) and ok.source == "AZURE_STORAGE_ACCOUNT_KEY (Shared Key)"


def test_shared_key_matches_the_azure_sdk() -> None:
    """The Shared Key signature of a request is the Azure SDK's (azure-storage-blob, a test
    dependency through adlfs) for the same request."""
    from azure.core.pipeline.transport import HttpRequest
    from azure.storage.blob._shared.authentication import SharedKeyCredentialPolicy

    headers = {"x-ms-date": "Thu, 03 Dec 2026 16:00:00 GMT", "x-ms-version": azure_client.API_VERSION,
               "x-ms-blob-type": "BlockBlob", "content-type": "application/octet-stream",
               "content-length": "4", "if-none-match": "*"}
    url = "http://127.0.0.1:10000/devstoreaccount1/bkt/cache/v1/a%20b.pack?comp=list&restype=container"
    request = HttpRequest("PUT", url, headers=dict(headers))

    class _Pipeline:
        http_request = request
        context = type("Context", (), {"transport": None})()

    SharedKeyCredentialPolicy("devstoreaccount1", KEY).on_request(_Pipeline())  # type: ignore[arg-type]
    ours = azure_client.shared_key("PUT", "/devstoreaccount1/bkt/cache/v1/a%20b.pack",
                                   {"restype": "container", "comp": "list"}, headers, "devstoreaccount1",
                                   base64.b64decode(KEY))
    assert ours == request.headers["Authorization"]


def test_listing_times_parse_without_strptime_and_gcs_preloads_no_xml() -> None:
    """A listing's ISO 8601 time (S3's LastModified, GCS's updated) is read with the built-in
    ``fromisoformat`` (``strptime`` imports ``_strptime`` on first use: not on a download
    thread, and not worth 1-2 ms of a start); GCS's JSON listings need no XML parser, so its
    ``preload`` (on the start's thread) does not import one; S3 and Azure do."""
    import calendar
    import subprocess
    import sys

    from compile_cache.store.backends.rest import iso_mtime

    expected = calendar.timegm((2026, 12, 3, 23, 43, 54))
    assert iso_mtime("2026-12-03T23:43:54.123Z") == expected == iso_mtime("2026-12-03T23:43:54Z")
    assert iso_mtime("2026-12-03T23:43:54.000+00:00") == expected
    assert iso_mtime("yesterday") == 0.0 and iso_mtime(None) == 0.0 and iso_mtime("") == 0.0
    code = ("import sys\n"
            "from compile_cache.store.backends.gcs import GcsBackend, GcsSettings\n"
            "from compile_cache.store.backends.azure import AzureBackend\n"
            "GcsBackend('gs://b/p', GcsSettings('http', '127.0.0.1:1', 'none', 'test')).preload()\n"
            "print('xml.etree.ElementTree' in sys.modules, '_strptime' in sys.modules)\n"
            "print(GcsBackend.xml_listing, AzureBackend.xml_listing)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "False", "False", "True"], done.stdout + done.stderr


def test_xml_listings_parse_with_expat_and_no_client_preloads_elementtree() -> None:
    """S3's and Azure's listing pages are parsed by expat directly (:func:`parse_xml`): the
    namespace dropped, entities decoded, a page that is not XML a fault; no client's ``preload``
    (on a start's thread; Azure's is S3's, :class:`~.rest.HttpBackend`'s) imports ``xml.etree`` (3 ms)."""
    import pyexpat
    import subprocess
    import sys

    from compile_cache.store.backends.rest import parse_xml

    page = parse_xml(b'<?xml version="1.0"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                     b"<IsTruncated>true</IsTruncated><Contents><Key>a/b&amp;c</Key><Size>12</Size></Contents>"
                     b"<Contents><Key>d</Key></Contents><NextContinuationToken>t==</NextContinuationToken>"
                     b"</ListBucketResult>")
    assert page.tag == "ListBucketResult" and page.findtext("IsTruncated") == "true"
    assert [(c.findtext("Key"), c.findtext("Size")) for c in page.iter("Contents")] == [("a/b&c", "12"), ("d", None)]
    assert page.findtext("NextContinuationToken") == "t==" and page.findtext("NextMarker") is None
    blobs = parse_xml(b"<EnumerationResults><Blobs><Blob><Name>n</Name><Properties><Content-Length>5"
                      b"</Content-Length></Properties></Blob></Blobs><NextMarker/></EnumerationResults>")
    assert [(b.findtext("Name"), b.findtext("Properties/Content-Length")) for b in blobs.iter("Blob")] == [("n", "5")]
    assert blobs.findtext("NextMarker") == ""
    for bad in (b"<a><b></a>", b"", b"not xml"):
        with pytest.raises(pyexpat.ExpatError):
            parse_xml(bad)
    assert list(parse_xml(b"<a>" * 50_000 + b"</a>" * 50_000).iter("Contents")) == []  # no recursion
    code = ("import sys\n"
            "from compile_cache.store.backends.s3 import S3Backend\n"
            "from compile_cache.store.backends.s3_auth import Credentials, S3Settings\n"
            "s3 = S3Settings(Credentials('a', 'b'), 'us-east-1', 'http', '127.0.0.1:1', True, 'http://127.0.0.1:1')\n"
            "S3Backend('s3://b/p', s3).preload()\n"
            "print('xml.etree.ElementTree' in sys.modules, 'pyexpat' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr
