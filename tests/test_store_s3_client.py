"""The small S3 client (compile_cache.store.backends.s3, .s3_auth): SigV4 against AWS's published test
vectors and botocore, ListObjectsV2 pagination, conditional put, faults as misses, and the
choice between it and s3fs (compile_cache.store.backends.open_backend).

Requests go to moto's standalone server on 127.0.0.1 (tests/_s3_server.py), or, for faults, to a
tiny HTTP server in this process that answers every request with one status.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _s3_server import SECRET, S3Server, make_bucket
from _store_helpers import store_warnings_of

from compile_cache.store import Store
from compile_cache.store import _reset as reset_store_warnings
from compile_cache.store.backends import RemoteError, open_backend
from compile_cache.store.backends.fsspec_backend import FsspecBackend
from compile_cache.store.backends.s3 import S3Backend, S3Error
from compile_cache.store.backends.s3_auth import EMPTY_SHA256, Credentials, settings, sign

K1 = "e1" * 16
MEMBERS = {"inductor/fxgraph/ab/xyz": b"graph" * 100}
AWS_EXAMPLE = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("moto") / "server.log")
    yield server
    server.stop()


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No AWS_* or COMPILE_CACHE_* variables, an empty HOME, a private local tier."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "COMPILE_CACHE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    (tmp_path / "home" / ".aws").mkdir(parents=True)
    reset_store_warnings()
    return tmp_path / "home"


@pytest.fixture
def bucket(s3: S3Server, clean_env: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    name = "c-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    make_bucket(s3, name)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return name


# -- signing ---------------------------------------------------------------------------------
def test_signature_matches_aws_published_examples() -> None:
    """The GET Object and ListObjects examples of AWS's "Signature Calculations for the
    Authorization Header" (S3 SigV4) page."""
    get = sign("GET", "/test.txt", {}, {"host": "examplebucket.s3.amazonaws.com", "range": "bytes=0-9"},
               EMPTY_SHA256, AWS_EXAMPLE, "us-east-1", "20130524T000000Z")
    assert get["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
    listing = sign("GET", "/", {"max-keys": "2", "prefix": "J"}, {"host": "examplebucket.s3.amazonaws.com"},
                   EMPTY_SHA256, AWS_EXAMPLE, "us-east-1", "20130524T000000Z")
    assert listing["authorization"].endswith(
        "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7")


def test_signature_matches_botocore_with_a_token_and_odd_names() -> None:
    botocore = pytest.importorskip("botocore")
    from urllib.parse import quote, urlencode

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCredentials

    path, query = "/bkt/pre fix/ä+x=1~y.pack", {"list-type": "2", "prefix": "a b/c", "continuation-token": "x/y=="}
    request = AWSRequest(method="PUT", url=f"http://127.0.0.1:9000{quote(path)}?{urlencode(query, quote_via=quote)}",
                         headers={"If-None-Match": "*", "X-Amz-Content-SHA256": EMPTY_SHA256})
    S3SigV4Auth(BotoCredentials("AKIDEXAMPLE", SECRET, "a-session/token+="), "s3", "eu-west-3").add_auth(request)
    ours = sign("PUT", path, query, {"host": "127.0.0.1:9000", "if-none-match": "*"}, EMPTY_SHA256,
                Credentials("AKIDEXAMPLE", SECRET, "a-session/token+="), "eu-west-3", request.headers["X-Amz-Date"])
    assert ours["authorization"] == request.headers["Authorization"]
    assert botocore is not None


# -- requests against moto ------------------------------------------------------------------
def test_listing_is_paginated(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = open_backend(f"s3://{bucket}/cache")
    assert isinstance(backend, S3Backend)
    names = {f"v1/entries/{i:03d}/entry.json" for i in range(11)} | {"v1/stats/x.json"}
    for name in names:
        backend.put(name, name.encode())
    pages = []
    real = backend._request

    def counting(method: str, key: str, what: str, **kw):  # type: ignore[no-untyped-def]
        if method == "GET" and "list-type" in (kw.get("query") or {}):
            pages.append(kw["query"].get("continuation-token"))
        return real(method, key, what, **kw)

    monkeypatch.setattr(backend, "_request", counting)
    monkeypatch.setattr(backend, "page_size", 4)
    listed = backend.list("v1/entries")
    assert set(listed) == {n for n in names if n.startswith("v1/entries/")}
    assert all(info.size == len(n) and info.mtime > 0 for n, info in listed.items())
    assert len(pages) == 3 and pages[0] is None and all(pages[1:])
    assert set(backend.list("")) == names
    assert backend.list("v1/nothing") == {}
    assert open_backend(f"s3://no-such-bucket-{bucket}/x").list("") == {}


def test_get_download_head_and_delete(bucket: str, tmp_path: Path) -> None:
    import io

    backend = open_backend(f"s3://{bucket}/deep/cache/")
    assert isinstance(backend, S3Backend)
    data = os.urandom(300_000)
    (tmp_path / "f").write_bytes(data)
    backend.put_file("packs/a b.pack", str(tmp_path / "f"))
    backend.put("empty", b"")
    assert backend.get("packs/a b.pack", len(data)) == data
    with pytest.raises(RemoteError, match="larger than"):
        backend.get("packs/a b.pack", len(data) - 1)
    assert backend.get("missing", 10) is None and backend.get("empty", 10) == b""
    assert backend.head("packs/a b.pack", 10) == data[:10] and backend.head("empty", 10) == b""
    out = io.BytesIO()
    assert backend.download("packs/a b.pack", out, len(data)) == len(data) and out.getvalue() == data
    with pytest.raises(FileNotFoundError):
        backend.download("missing", out, 10)
    assert backend.exists("empty") and not backend.exists("missing")
    backend.delete(["empty", "missing"])
    assert set(backend.list("")) == {"packs/a b.pack"}


def test_requests_start_no_thread_of_their_own(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's deadline is kept by the process's one watchdog thread, started with the first
    request: none per request (a thread's start and end each take the GIL from the job's thread,
    and a fresh node's restore makes its requests while the job imports)."""
    import threading

    backend = open_backend(f"s3://{bucket}/cache")
    backend.put("a", b"x" * 1000)
    started: list[str] = []
    real = threading.Thread.start

    def counting(self: threading.Thread) -> None:
        started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", counting)
    for _ in range(5):
        assert backend.get("a", 1000) == b"x" * 1000
    assert set(backend.list("")) == {"a"} and backend.get("missing", 10) is None
    assert started == []
    assert [t.name for t in threading.enumerate()].count("compile-cache-deadlines") == 1


def test_conditional_put_conflict_is_412_and_keeps_the_first(bucket: str) -> None:
    backend = open_backend(f"s3://{bucket}/cache")
    assert isinstance(backend, S3Backend)
    assert backend.put_if_absent("v1/entries/k/entry.json", b"first") is True
    assert backend.put_if_absent("v1/entries/k/entry.json", b"second") is False
    assert backend.get("v1/entries/k/entry.json", 100) == b"first"


def test_a_store_round_trip_through_the_small_client(bucket: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(f"s3://{bucket}/cache")
    assert isinstance(store.remote.backend, S3Backend)
    info = store.publish(K1, MEMBERS, compile_seconds=1.0)
    assert info is not None
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier-2"))  # a fresh node's tier
    reader = Store(f"s3://{bucket}/cache")
    packs = reader.load(K1)
    assert [dict((n, p.members[n]) for n in p.members) for p in packs] == [MEMBERS]
    for p in packs:
        p.close()
    stats = reader.stats()
    moved = reader.remote.listing()[K1].packs[info.name]  # compressed on the wire (issue 39)
    assert stats["remote_downloads"] == 1 and stats["bytes_downloaded"] == moved and stats["remote_errors"] == 0
    assert 0 < moved < info.size and reader.layout.pack_paths(K1)[0].stat().st_size == info.size


# -- faults ----------------------------------------------------------------------------------
class _Always(http.server.BaseHTTPRequestHandler):
    status = 503
    code = "SlowDown"
    seen: list[str] = []
    #: Answer only conditional puts with ``status``; listings are empty, other puts succeed.
    conflict_only = False

    def _answer(self) -> None:
        type(self).seen.append(self.headers.get("Authorization", ""))
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = f"<Error><Code>{self.code}</Code><Message>no</Message></Error>".encode()
        status = self.status
        if self.conflict_only and not (self.command == "PUT" and self.headers.get("If-None-Match")):
            status = 200 if self.command in ("PUT", "DELETE") else 404
            if "list-type=2" in self.path:
                status, body = 200, b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


def _fake_s3(base: type, monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[type]:
    """A fresh subclass of ``base`` (its own ``seen`` list) serving on 127.0.0.1, with the S3
    client pointed at it and ``env`` set."""
    handler = type("Handler", (base,), {"seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield handler
    server.shutdown()
    server.server_close()


@pytest.fixture
def failing(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Always]]:
    yield from _fake_s3(_Always, monkeypatch, COMPILE_CACHE_REMOTE_RETRIES="2")


def test_a_5xx_is_retried_then_a_miss_with_one_warning(failing: type[_Always]) -> None:
    store = Store("s3://bkt/cache")
    assert isinstance(store.remote.backend, S3Backend)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert store.load(K1) == []
        assert store.load(K1) == []  # fails at once now: no more requests
    messages = store_warnings_of(shown)
    assert len(messages) == 1 and "treated as a miss" in messages[0] and "503" in messages[0], messages
    assert SECRET not in messages[0]
    assert len(failing.seen) == 3 and all(a.startswith("AWS4-HMAC-SHA256 Credential=testing/") for a in failing.seen)
    assert Store(store.root).stats()["remote_errors"] >= 1


@pytest.mark.parametrize("status", [429, 403, 500, 400])
def test_throttling_auth_and_server_errors_are_faults(failing: type[_Always], status: int) -> None:
    """A 429 or 5xx is retried (3 tries); a 400 or 403 cannot succeed later: one try (issue 39)."""
    failing.status = status
    failing.code = {403: "AccessDenied", 400: "InvalidArgument"}.get(status, failing.code)
    backend = open_backend("s3://bkt/cache")
    with pytest.raises(RemoteError, match=f"HTTP {status}") as caught:
        backend.get("x", 10)
    assert SECRET not in str(caught.value) and SECRET not in repr(backend)
    assert len(failing.seen) == (1 if status in (400, 403) else 3)
    assert isinstance(S3Error(status, "X", "y"), OSError)


def test_a_403_is_not_retried_and_a_job_goes_on(failing: type[_Always]) -> None:
    failing.status, failing.code = 403, "AccessDenied"
    store = Store("s3://bkt/cache")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert store.load(K1) == []
    messages = store_warnings_of(shown)
    assert len(messages) == 1 and "403 AccessDenied" in messages[0] and "treated as a miss" in messages[0]
    assert len(failing.seen) == len(set(failing.seen))  # no request sent twice: no retry
    assert S3Error(400, "RequestTimeout", "x").retryable and not S3Error(400, "InvalidArgument", "x").retryable


def test_a_5xx_before_any_answer_is_still_retried(failing: type[_Always]) -> None:
    """A store that answers, even with an error, is in reach: the first-try rule (issue 57)
    leaves its faults the retries they always had."""
    with pytest.raises(RemoteError, match="after 3 tries: S3Error: HTTP 503") as caught:
        open_backend("s3://bkt/cache").list("")
    assert len(failing.seen) == 3 and caught.value.answered is True


def test_a_store_out_of_reach_costs_one_first_timeout_then_fails_at_once(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch, black_hole: Any) -> None:
    """issue 57: a port that accepts and never answers costs the first request
    COMPILE_CACHE_REMOTE_FIRST_TIMEOUT, not (1 + retries) x COMPILE_CACHE_REMOTE_TIMEOUT; it
    is not retried (the store never answered), and the next call fails at once."""
    import time

    monkeypatch.setenv("AWS_ENDPOINT_URL", black_hole.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_RETRIES", "2")
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_FIRST_TIMEOUT", "1")
    backend = open_backend("s3://bkt/cache")
    start = time.monotonic()
    with pytest.raises(RemoteError, match="not retried") as caught:
        backend.list("")
    assert time.monotonic() - start < 4
    assert caught.value.answered is False and caught.value.fault == "no answer within 1 s"
    start = time.monotonic()
    with pytest.raises(RemoteError, match="unreachable"):
        backend.get("x", 10)
    assert time.monotonic() - start < 0.5


def test_a_name_lookup_that_hangs_ends_at_the_requests_deadline(
        clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 57: a resolver that does not answer (a closed network) holds no request past its
    deadline (a socket's timeout does not cover the lookup); the fault says so."""
    import socket
    import time

    real = socket.getaddrinfo

    def hanging(host: Any, *args: Any, **kwargs: Any) -> Any:
        if str(host).endswith(".invalid"):
            time.sleep(8)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.lookup-hangs.invalid:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_FIRST_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        open_backend("s3://bkt/cache").list("")
    assert time.monotonic() - start < 4
    assert caught.value.answered is False and caught.value.fault == "its host name does not resolve"
    assert "s3.lookup-hangs.invalid: no address within 1 s" in str(caught.value)


def test_a_409_on_a_conditional_put_means_another_node_wrote_it(failing: type[_Always]) -> None:
    """AWS answers a conditional put racing another with 409 ConditionalRequestConflict: the
    object (named by its content) is being written by another node; not a fault, not retried."""
    failing.status, failing.code = 409, "ConditionalRequestConflict"
    backend = open_backend("s3://bkt/cache")
    assert backend.put_if_absent("entries/x.pack", b"data") is False
    assert len(failing.seen) == 1
    with pytest.raises(RemoteError, match="HTTP 409"):  # an unconditional put: an error
        backend.put("entries/y.pack", b"data")
    # Through a publish (the listing is empty, every conditional put a 409): the pack counts
    # as another node's, with no remote error and no warning.
    failing.conflict_only = True
    store = Store("s3://bkt/cache")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert store.publish(K1, MEMBERS, compile_seconds=1.0) is not None
    assert store_warnings_of(shown) == [] and store.stats()["remote_errors"] == 0
    assert store.stats()["remote_uploads"] == 0


class _Regional(http.server.BaseHTTPRequestHandler):
    """A bucket in eu-west-1: a request signed for another region gets S3's 301
    PermanentRedirect naming it (header and body); one signed for eu-west-1 gets its object."""

    region = "eu-west-1"
    seen: list[str] = []
    always_redirect = False

    def do_GET(self) -> None:
        auth = self.headers.get("Authorization", "")
        type(self).seen.append(auth)
        if self.always_redirect or f"/{self.region}/s3/" not in auth:
            body = (b"<Error><Code>PermanentRedirect</Code><Message>wrong region</Message>"
                    b"<Region>" + self.region.encode() + b"</Region></Error>")
            self.send_response(301)
            self.send_header("x-amz-bucket-region", self.region)
        else:
            body = b"the object"
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def regional(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[_Regional]]:
    yield from _fake_s3(_Regional, monkeypatch, AWS_REGION="us-east-1")


def test_a_region_redirect_is_followed_once_and_kept(regional: type[_Regional]) -> None:
    backend = open_backend("s3://bkt/cache")
    assert isinstance(backend, S3Backend) and backend.region == "us-east-1"
    assert backend.get("x", 100) == b"the object"
    assert [a.split("/")[2] for a in regional.seen] == ["us-east-1", "eu-west-1"]
    assert backend.region == "eu-west-1"
    assert backend.get("x", 100) == b"the object"  # signed for the bucket's region at once
    assert len(regional.seen) == 3


def test_a_second_redirect_is_an_error_naming_the_region(regional: type[_Regional]) -> None:
    regional.always_redirect = True
    backend = open_backend("s3://bkt/cache")
    with pytest.raises(RemoteError, match="in region 'eu-west-1' \\(set AWS_REGION=eu-west-1\\)"):
        backend.get("x", 100)
    assert len(regional.seen) == 2  # followed once, not retried
    assert SECRET not in str(regional.seen)  # (the signature, never the secret)


def test_the_aws_host_follows_the_region() -> None:
    from compile_cache.store.backends.s3_auth import S3Settings

    creds = Credentials("a", "b")
    virtual = S3Backend("s3://bkt/p", S3Settings(creds, "us-east-1", "https", "bkt.s3.us-east-1.amazonaws.com",
                                                 False, None))
    virtual.follow_region("ap-south-1")  # what a redirect does
    assert (virtual.region, virtual.host) == ("ap-south-1", "bkt.s3.ap-south-1.amazonaws.com")
    path = S3Backend("s3://b.k/p", S3Settings(creds, "us-east-1", "https", "s3.us-east-1.amazonaws.com",
                                              True, None))
    path.follow_region("eu-central-1")
    assert path.host == "s3.eu-central-1.amazonaws.com"


# -- which client ----------------------------------------------------------------------------
def test_keys_from_a_profile_use_the_small_client(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (clean_env / ".aws" / "credentials").write_text(
        f"[default]\naws_access_key_id = AKID\naws_secret_access_key = {SECRET}\n"
        f"[team]\naws_access_key_id = TEAM\naws_secret_access_key = {SECRET}\naws_session_token = tok\n")
    (clean_env / ".aws" / "config").write_text("[profile team]\nregion = eu-west-1\n")
    chosen, _ = settings("s3://bkt/p")
    assert chosen is None  # no region, no endpoint: s3fs (it follows the bucket's region)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    chosen, _ = settings("s3://bkt/p")
    assert chosen is not None and chosen.credentials.access_key == "AKID" and chosen.region == "us-east-1"
    assert chosen.path_style and chosen.host == "127.0.0.1:9"
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_PROFILE", "team")
    chosen, _ = settings("s3://bkt/p")
    assert chosen is not None and chosen.credentials.token == "tok" and chosen.region == "eu-west-1"
    assert chosen.host == "bkt.s3.eu-west-1.amazonaws.com" and not chosen.path_style
    assert SECRET not in repr(chosen) and "TEAM" not in repr(chosen)
    assert open_backend("s3://bkt/p").client == "small S3 client (stdlib; credentials: profile 'team' (credentials file))"
    monkeypatch.setenv("AWS_CA_BUNDLE", str(clean_env / "ca.pem"))
    chosen, _ = settings("s3://bkt/p")
    assert chosen is not None and chosen.ca_bundle == str(clean_env / "ca.pem")


def test_keys_in_the_environment_and_no_config_file_import_no_configparser(clean_env: Path) -> None:
    """A fresh node with its keys in the environment and no ~/.aws files reads no file, and its
    start imports no configparser (5 ms); a config file that exists is still read."""
    import subprocess
    import sys

    code = ("import sys\nfrom compile_cache.store.backends.s3_auth import settings\n"
            "chosen, why = settings('s3://bkt/p')\nassert chosen is not None, why\n"
            "print(chosen.region, 'configparser' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "COMPILE_CACHE_"))}
    env.update(AWS_ACCESS_KEY_ID="AKID", AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="eu-west-3",
               HOME=str(clean_env), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    run = functools.partial(subprocess.run, [sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    assert run().stdout.split() == ["eu-west-3", "False"]
    (clean_env / ".aws" / "config").write_text("[default]\nregion = eu-north-1\n")
    env.pop("AWS_DEFAULT_REGION")
    assert run().stdout.split() == ["eu-north-1", "True"]


@pytest.mark.parametrize("setup", ["nothing", "role", "process", "web identity", "proxy", "forced"])
def test_anything_else_falls_back_to_s3fs(clean_env: Path, monkeypatch: pytest.MonkeyPatch, setup: str) -> None:
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    if setup == "role":
        (clean_env / ".aws" / "config").write_text("[default]\nrole_arn = arn:aws:iam::1:role/x\nsource_profile = a\n")
    elif setup == "process":
        (clean_env / ".aws" / "credentials").write_text("[default]\ncredential_process = /bin/true\n")
    elif setup == "web identity":
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(clean_env / "token"))
    elif setup in ("proxy", "forced"):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        monkeypatch.setenv("HTTP_PROXY" if setup == "proxy" else "COMPILE_CACHE_S3_CLIENT",
                           "http://127.0.0.1:3128" if setup == "proxy" else "s3fs")
    backend = open_backend("s3://bkt/p")
    assert isinstance(backend, FsspecBackend) and backend.client == "s3fs"
    assert backend.why.startswith("the small S3 client declines this store: ")  # doctor shows it


def test_the_fallback_really_serves_the_store(s3: S3Server, bucket: str, clean_env: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys from a credential process (which only botocore runs): s3fs reads and writes."""
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    script = clean_env / "creds.sh"
    script.write_text('#!/bin/sh\necho \'{"Version": 1, "AccessKeyId": "testing", "SecretAccessKey": "x"}\'\n')
    script.chmod(0o700)
    (clean_env / ".aws" / "config").write_text(f"[default]\ncredential_process = {script}\n")
    import s3fs

    # fsspec keeps one S3FileSystem per set of arguments; the endpoint (from the environment)
    # is not among them, so none made for another server may serve this test, or outlive it.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        store = Store(f"s3://{bucket}/cache")
        assert isinstance(store.remote.backend, FsspecBackend)
        assert store.publish(K1, MEMBERS, compile_seconds=1.0) is not None
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        assert isinstance(open_backend(f"s3://{bucket}/cache"), FsspecBackend)  # the profile still has it
        (clean_env / ".aws" / "config").unlink()
        small = open_backend(f"s3://{bucket}/cache")
        assert isinstance(small, S3Backend) and set(small.list("")) == set(store.remote.backend.list(""))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
