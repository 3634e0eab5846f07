"""GCS and Azure Blob endpoints on 127.0.0.1 for the object-storage tests: gcp-storage-emulator
(a test extra) and Azurite's blob service (``make install`` puts it under ``<venv>/azurite``).

Each runs in its own process group on a free port, in memory, and is killed by :meth:`stop`.
:meth:`env` is the configuration a user would set to point gcsfs or adlfs at such an endpoint
(the packages' own environment variables, nothing of compile_cache's).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from _s3_server import free_port

#: Azurite's well-known development account (public: documented by Microsoft for the emulator).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")


class _Server:
    """A server process in its own process group, waited for until it answers HTTP."""

    name = "?"

    def _start(self, argv: list[str], log: Path, timeout: float = 60.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([a.format(port=self.port) for a in argv],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(log.parent))
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except urllib.error.HTTPError:  # it answered (Azurite: 400 for the bare root)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    tail = log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{self.name} did not start on {self.endpoint} within "
                                       f"{timeout:.0f} s (exit {self.proc.returncode}); its log "
                                       f"{log}:\n{tail}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


class GcsEmulator(_Server):
    """``gcp-storage-emulator start --in-memory`` on a free port of 127.0.0.1."""

    name = "gcp-storage-emulator"

    def __init__(self, log: Path) -> None:
        exe = Path(sys.executable).with_name("gcp-storage-emulator")
        if not exe.exists():
            raise RuntimeError(f"gcp-storage-emulator is not installed beside {sys.executable}: "
                               "pip install -e '.[test]' (or make install)")
        self._start([str(exe), "start", "--host", "127.0.0.1", "--port", "{port}", "--in-memory",
                     "--quiet"], log)

    def env(self) -> dict[str, str]:
        """gcsfs's own settings for this endpoint: no credentials (``token="anon"`` through
        fsspec's config variables), and the plain GCS client (gcsfs's experimental one asks a
        gRPC control API the emulator lacks, 60 s per call)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "FSSPEC_GCS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (the JSON API's bucket insert)."""
        req = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=test", method="POST",
                                     data=b'{"name": "%s"}' % name.encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists
                raise


def azurite_blob() -> str:
    """Azurite's blob service, as ``make install`` puts it (``<venv>/azurite``), else on PATH."""
    local = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    found = str(local) if local.exists() else shutil.which("azurite-blob")
    if not found:
        raise RuntimeError(f"Azurite is not installed: {local} is missing (make install runs "
                           "npm install --prefix .venv/azurite azurite@<pinned>)")
    return found


class AzuriteServer(_Server):
    """Azurite's blob service, in memory, on a free port of 127.0.0.1 (no telemetry)."""

    name = "Azurite"

    def __init__(self, log: Path) -> None:
        self._start([azurite_blob(), "--blobHost", "127.0.0.1", "--blobPort", "{port}",
                     "--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry",
                     "--silent"], log)

    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};")

    def env(self) -> dict[str, str]:
        """adlfs's own setting for this endpoint: the emulator's connection string."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def make_container(self, name: str) -> None:
        """Create container ``name`` (through azure-storage-blob, as adlfs would)."""
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        client = BlobServiceClient.from_connection_string(self.connection_string())
        try:
            client.create_container(name)
        except ResourceExistsError:
            pass


class BlackHole:
    """A port on 127.0.0.1 that accepts every connection and never answers (a firewall that
    swallows requests, a server that hangs): what a client's deadline must end. Its thread holds
    what it accepted until :meth:`close`."""

    def __init__(self) -> None:
        import socket
        import threading

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="black-hole", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            self._held.append(conn)

    def close(self) -> None:
        self._sock.close()
        for conn in self._held:
            conn.close()


#: The ways a store on object storage is misconfigured that doctor and a job must survive.
MISCONFIGURED = ("no-credentials", "unresolvable", "black-hole")
#: The variables of the cloud clients a test's child must not inherit.
_CLOUD_PREFIXES = ("AWS_", "GOOGLE_", "GCE_", "GCLOUD", "CLOUDSDK_", "AZURE_", "STORAGE_EMULATOR_HOST",
                   "FSSPEC_", "GCSFS_", "NO_GCE_CHECK")


def misconfigured(scheme: str, case: str, hole: BlackHole, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(a store URL, ``env`` with the cloud variables a user would have set) for a store on
    ``scheme`` (s3, gs, az) that is misconfigured as ``case`` (:data:`MISCONFIGURED`). Every
    address is 127.0.0.1 or a name under ``.invalid`` (RFC 6761: it never resolves): nothing
    leaves the machine (but for google-auth's lookup of ``metadata.google.internal``, a name
    only Google's machines resolve). ``no-credentials`` keeps the clients off the instance
    metadata services where it can, and points the requests a client without credentials still
    makes (gcsfs, anonymously; google-auth's probe of the metadata server's address) at the
    black hole."""
    env = {k: v for k, v in env.items() if not k.startswith(_CLOUD_PREFIXES)}
    env.update(AWS_EC2_METADATA_DISABLED="true", NO_GCE_CHECK="True")
    url = f"{scheme}://bucket-x/cc-{case}"
    nowhere = {"s3": "http://s3.bucket-x.invalid:9000", "gs": "http://storage.bucket-x.invalid:4443",
               "az": "http://blob.bucket-x.invalid:10000"}[scheme]
    endpoint = hole.endpoint if case == "black-hole" else nowhere
    if case == "no-credentials":
        if scheme == "s3":
            env.update(AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=hole.endpoint)
        elif scheme == "gs":  # google-auth's probe of the metadata server's address, too
            env.update(FSSPEC_GCS_ENDPOINT_URL=hole.endpoint, GCE_METADATA_IP=hole.endpoint.split("//", 1)[1])
        return url, env
    if scheme == "s3":
        env.update(AWS_ACCESS_KEY_ID="AKIDEXAMPLE", AWS_SECRET_ACCESS_KEY="cc-SECRET-not-a-real-key",
                   AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=endpoint)
    elif scheme == "gs":
        env["STORAGE_EMULATOR_HOST"] = endpoint
    else:
        env["AZURE_STORAGE_CONNECTION_STRING"] = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")
    return url, env
