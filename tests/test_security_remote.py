"""A hostile or broken object store, and credentials that must never show (issue 31.3, 31.4).

Every server here is a small HTTP server in this process on 127.0.0.1 that answers as a
hostile S3 endpoint would: an error text with newlines, a body dripped a byte at a time, a
listing that never ends. Every test is bounded in time.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from _store_helpers import store_warnings_of

from compile_cache import cli
from compile_cache.errors import ConfigError
from compile_cache.store import Store
from compile_cache.store import _reset as reset_store_warnings
from compile_cache.store.backends import RemoteError

K1 = "e1" * 16
SECRET = "cc-SECRET-key-4b7e"
TOKEN = "cc-SECRET-token-91d0"
PASSWORD = "pa/ss@w-SECRET-3c"


class Hostile(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``status`` and ``body`` (a class attribute per test)."""

    status = 503
    body = b"<Error><Code>SlowDown</Code></Error>"
    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(self.body)

    do_GET = do_PUT = do_HEAD = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith(("AWS_", "COMPILE_CACHE_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COMPILE_CACHE_LOCAL_TIER", str(tmp_path / "tier"))
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_RETRIES", "0")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDSECRETID7")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    (tmp_path / "home" / ".aws").mkdir(parents=True)
    reset_store_warnings()
    return tmp_path


@pytest.fixture
def hostile(env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Hostile]]:
    handler = type("Handler", (Hostile,), {})
    server, endpoint = _serve(handler)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    yield handler
    server.shutdown()
    server.server_close()


def _cli(capsys: pytest.CaptureFixture[str], url: str) -> tuple[dict[str, int], str]:
    codes = {}
    for argv in (["ls"], ["ls", "--json"], ["stats"], ["stats", "--json"], ["verify"],
                 ["doctor"], ["doctor", "--json"]):
        codes[" ".join(argv)] = cli.main([*argv, "--cache-dir", url])
    out = capsys.readouterr()
    return codes, out.out + out.err


# -- 31.4: secrets are never printed ---------------------------------------------------------
@pytest.mark.parametrize("variable", ["AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_a_credential_ending_in_a_newline_is_refused_by_name_never_shown(
    hostile: type[Hostile], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    variable: str,
) -> None:
    value = {"AWS_SESSION_TOKEN": TOKEN, "AWS_ACCESS_KEY_ID": "AKIDSECRETID7",
             "AWS_SECRET_ACCESS_KEY": SECRET}[variable]
    monkeypatch.setenv(variable, value + "\n")  # as a file or a Kubernetes secret leaves it
    with pytest.raises(ConfigError, match=variable) as caught:
        Store("s3://bkt/cache")
    assert value not in str(caught.value) and "newline" in str(caught.value)
    codes, text = _cli(capsys, "s3://bkt/cache")
    assert value not in text and SECRET not in text and TOKEN not in text
    assert variable in text and "Traceback" not in text


def test_a_password_in_the_url_is_never_shown_even_with_a_slash(
    hostile: type[Hostile], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"s3://user:{PASSWORD}@bkt/cache"
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        store = Store(url)
        assert store.load(K1) == []  # the server fails: a miss, one warning
        try:
            stats = json.dumps(store.stats(), default=str)
        except RemoteError as exc:  # unreachable: said so, in one line
            stats = str(exc)
    assert "SECRET" not in stats and "SECRET" not in store.location and "SECRET" not in repr(store)
    assert not any("SECRET" in m for m in store_warnings_of(shown))
    monkeypatch.setenv("COMPILE_CACHE_DIR", url)  # doctor shows the variables' values too
    codes, text = _cli(capsys, url)
    # "-SECRET-": every secret of this file has it; doctor names AWS_SECRET_ACCESS_KEY (a source, no value).
    assert "-SECRET-" not in text, [line for line in text.splitlines() if "-SECRET-" in line]
    assert "Traceback" not in text


def test_a_servers_error_text_reaches_a_warning_on_one_line_without_secrets(
    hostile: type[Hostile], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    hostile.body = (f"<Error><Code>Slow\nDown\r\nX-Injected: {TOKEN}</Code>"
                    f"<Message>{SECRET}\n\n</Message></Error>").encode()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        assert Store("s3://bkt/cache").load(K1) == []
    messages = store_warnings_of(shown)
    assert messages and all("\n" not in m and "\r" not in m for m in messages), messages
    assert not any(TOKEN in m or SECRET in m for m in messages)


# -- 31.3: a deadline per whole request, and a listing that ends ------------------------------
class Drip(http.server.BaseHTTPRequestHandler):
    """Answers slowly, but never slower than a socket timeout: one byte every 0.3 s, of the
    headers (``where="headers"``) or of the body."""

    where = "body"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"x" * 1000
        head = (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nX-Slow: "
                + "y" * 200 + "\r\n\r\n").encode()
        try:
            if self.where == "headers":
                self.wfile.write(head[:20])
                for byte in head[20:]:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.3)
            else:
                self.wfile.write(head)
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.3)
        except OSError:
            pass  # the client gave up: what the test wants

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_server_that_drips_bytes_cannot_hold_a_request_past_its_deadline(
    env: Path, monkeypatch: pytest.MonkeyPatch, where: str,
) -> None:
    from compile_cache.store.backends import open_backend

    handler = type("Handler", (Drip,), {"where": where})
    server, endpoint = _serve(handler)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("COMPILE_CACHE_REMOTE_TIMEOUT", "2")
    try:
        backend = open_backend("s3://bkt/cache")
        start = time.monotonic()
        with pytest.raises(RemoteError):
            backend.get("x", 10_000)  # 1,000 bytes at 0.3 s each: 300 s without a deadline
        assert time.monotonic() - start < 8
        start = time.monotonic()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            assert Store("s3://bkt/cache").load(K1) == []  # a job's restore: a miss, in time
        assert time.monotonic() - start < 15
    finally:
        server.shutdown()
        server.server_close()


class Endless(http.server.BaseHTTPRequestHandler):
    """A listing that always says there is more (``repeat``: with the same token each time)."""

    repeat = False
    pages = 0
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        type(self).pages += 1
        n = type(self).pages
        token = "same" if self.repeat else f"t{n}"
        keys = "".join(f"<Contents><Key>cache/v1/entries/e1/{K1}/used/{n}-{i}</Key><Size>0</Size>"
                       f"</Contents>" for i in range(100))
        body = (f'<?xml version="1.0"?><ListBucketResult><IsTruncated>true</IsTruncated>'
                f"<NextContinuationToken>{token}</NextContinuationToken>{keys}"
                f"</ListBucketResult>").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("repeat", [False, True], ids=["new-token-each-page", "same-token"])
def test_a_listing_that_never_ends_stops_with_an_error(
    env: Path, monkeypatch: pytest.MonkeyPatch, repeat: bool,
) -> None:
    from compile_cache.store.backends import open_backend, rest

    monkeypatch.setattr(rest, "MAX_LIST_PAGES", 50)  # the bound, made small enough to reach fast
    handler = type("Handler", (Endless,), {"repeat": repeat, "pages": 0})
    server, endpoint = _serve(handler)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    try:
        start = time.monotonic()
        with pytest.raises(RemoteError, match="continuation token" if repeat else "pages"):
            open_backend("s3://bkt/cache").list("v1/entries")
        assert time.monotonic() - start < 15
        assert handler.pages == (2 if repeat else 50)
    finally:
        server.shutdown()
        server.server_close()
