"""A real S3 endpoint on 127.0.0.1 for the object-storage tests: moto's standalone server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

#: The secret the tests give the S3 client: it must never show in a log, a pack or doctor.
SECRET = "cc-test-SECRET-7d1e9a4b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``python -m moto.server`` on a free port of 127.0.0.1 (its own process group)."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: see {log}") from None
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """The environment an S3 client needs for this server (credentials from the env chain)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


def make_bucket(server: S3Server, name: str) -> None:
    """Create bucket ``name`` (a PUT on the bucket: moto needs no signature check for it)."""
    req = urllib.request.Request(f"{server.endpoint}/{name}", method="PUT")
    urllib.request.urlopen(req, timeout=10).close()
