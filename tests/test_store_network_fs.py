"""The store on a real network filesystem (issue 54): ``sshfs`` mounts of a loopback ``sshd``,
two mounts of one directory as two nodes (each its own FUSE client, with its own attribute and
directory caches). The fixture starts sshd on a free 127.0.0.1 port with a throwaway host key
and an authorized key in a temp dir, mounts twice, and unmounts and stops it after.

Skipped only where /dev/fuse is absent; ``make install`` installs sshfs and openssh-server.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import fresh_node_env

from compile_cache.store import Store
from compile_cache.store.layout import Layout

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_netfs_child.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                        if os.access(p, os.X_OK)), None)
    if found is None:
        pytest.fail(f"{name} is not installed: `make install` installs sshfs and openssh-server")
    return found


@pytest.fixture(scope="module")
def mounts(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(node 1's mount, node 2's mount, the directory both show)."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("/dev/fuse is absent: no FUSE filesystem can be mounted here")
    sshd, sshfs, keygen = _tool("sshd"), _tool("sshfs"), _tool("ssh-keygen")
    unmount = shutil.which("fusermount3") or shutil.which("fusermount") or "umount"
    base = tmp_path_factory.mktemp("sshfs")
    for key in ("host_key", "client_key"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(base / key)], check=True)
    authorized = base / "authorized_keys"
    shutil.copy(base / "client_key.pub", authorized)
    authorized.chmod(0o600)
    port, user = _free_port(), pwd.getpwuid(os.getuid()).pw_name
    config = base / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {base / 'host_key'}\n"
        f"AuthorizedKeysFile {authorized}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        f"PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
        f"AllowUsers {user}\nSubsystem sftp internal-sftp\nPidFile {base / 'sshd.pid'}\n")
    if os.getuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    log = open(base / "sshd.log", "wb")  # noqa: SIM115 - closed after sshd stops
    server = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=log, stderr=log)
    shared = base / "shared"
    shared.mkdir(mode=0o700)
    mounted: list[Path] = []
    try:
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail(f"sshd did not start: {(base / 'sshd.log').read_text()[-2000:]}")
            time.sleep(0.1)
        for node in ("node1", "node2"):
            mount = base / node
            mount.mkdir(mode=0o700)
            done = subprocess.run(
                [sshfs, f"{user}@127.0.0.1:{shared}", str(mount), "-p", str(port), "-o",
                 f"IdentityFile={base / 'client_key'},StrictHostKeyChecking=no,"
                 "UserKnownHostsFile=/dev/null,LogLevel=ERROR,BatchMode=yes"],
                capture_output=True, text=True, timeout=30, check=False)
            if done.returncode != 0:
                pytest.fail(f"sshfs mount failed: {done.stderr[-2000:]}")
            mounted.append(mount)
        yield mounted[0], mounted[1], shared
    finally:
        for mount in mounted:
            subprocess.run([unmount, "-u", str(mount)] if "fusermount" in unmount else [unmount, str(mount)],
                           capture_output=True, check=False, timeout=30)
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        log.close()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("COMPILE_CACHE_DIR", "COMPILE_CACHE_SHARED", "COMPILE_CACHE_LOCK", "COMPILE_CACHE_MAX_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _start(node: Path, store: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(CHILD), str(store)], env=fresh_node_env(node),
                            cwd=node, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def test_doctor_picks_mkdir_locks_on_the_fuse_mount(mounts, tmp_path) -> None:
    node1, _node2, _shared = mounts
    env = {**fresh_node_env(tmp_path / "n"), "COMPILE_CACHE_DIR": str(node1 / "doctor-store")}
    env.pop("COMPILE_CACHE_LOCK", None)
    done = subprocess.run([sys.executable, "-m", "compile_cache", "doctor", "--json"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    data = json.loads(done.stdout)["store"]
    assert data["filesystem"] == "fuse.sshfs" and data["lock_mode"] == "mkdir", data


def test_two_nodes_publish_and_restore_one_model_at_once_through_two_mounts(mounts, tmp_path) -> None:
    node1, node2, shared = mounts
    first = [_start(tmp_path / f"cold{i}", mount / "store") for i, mount in enumerate((node1, node2))]
    cold = [_result(p) for p in first]  # both at once: outputs equal eager's (checked in the child)
    assert cold[0]["key"] == cold[1]["key"]
    assert sum(r["published"] for r in cold) >= 1
    # Each node, new again, restores what the two published: a hit, nothing compiled.
    warm = [_result(_start(tmp_path / f"warm{i}", mount / "store")) for i, mount in enumerate((node1, node2))]
    assert all(r["hit"] and r["misses"] == 0 and r["restored"] >= 1 for r in warm), warm
    # Nothing lost or broken: every pack either node wrote is whole, seen from the server's side.
    report = Store(shared / "store").verify()
    assert not report.corrupt_packs and not report.bad_entries and not report.stale_locks, report
    assert Layout(shared / "store").pack_paths(cold[0]["key"])


def _victim_counts(store: str, until: float) -> int:
    opened = Store(store)
    rounds = 0
    while time.time() < until:
        opened.record_error("race")
        rounds += 1
    return rounds


def _attack(locks: Path, target: str, until: float) -> int:
    """Every stats lock directory swapped for a link (RENAME_EXCHANGE where the filesystem has
    it, else renamed aside and a link made in its place), again and again."""
    libc = ctypes.CDLL(None, use_errno=True)
    swaps = 0
    names = [locks / f"stats-{n}.lockdir" for n in range(8)]
    while time.time() < until:
        for name in names:
            link = name.with_name(f".evil-{name.name}")
            if not os.path.islink(link):
                with contextlib.suppress(OSError):
                    os.rename(link, f"{link}-{swaps}-{time.monotonic_ns()}")
                with contextlib.suppress(OSError):
                    os.symlink(target, link)
            if libc.renameat2(-100, bytes(name), -100, bytes(link), 2) == 0:
                swaps += 1
                time.sleep(0.0005)
                libc.renameat2(-100, bytes(name), -100, bytes(link), 2)
            else:
                with contextlib.suppress(OSError):
                    os.rename(name, f"{name}-aside-{swaps}")
                    os.symlink(target, name)
                    swaps += 1
                    time.sleep(0.0005)
                    os.unlink(name)
    return swaps


def test_the_lock_dir_swap_does_not_reach_outside_the_store_on_the_mount(mounts, tmp_path) -> None:
    import multiprocessing

    node1, _node2, shared = mounts
    home = tmp_path / "home"
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    ssh.chmod(0o700)
    (ssh / "id_ed25519").write_bytes(b"secret")
    (ssh / "id_ed25519").chmod(0o600)
    before = {str(p): (stat.S_IMODE(p.lstat().st_mode), p.is_file() and p.read_bytes())
              for p in [home, *home.rglob("*")]}
    store = node1 / "race-store"
    _victim_counts(str(store), 0.0)  # made through node 1: its locks dir exists
    Store(store).record_error("race")
    until = time.time() + 20
    fork = multiprocessing.get_context("fork")
    with fork.Pool(1) as pool:
        # The attacker works on the server's side of the mount (as another client without
        # caches would): node 2's FUSE client caches names for seconds, too slow to race.
        attack = pool.apply_async(_attack, (shared / "race-store" / "v1" / "locks", str(ssh), until))
        rounds = _victim_counts(str(store), until)
        swaps = attack.get(60)
    after = {str(p): (stat.S_IMODE(p.lstat().st_mode), p.is_file() and p.read_bytes())
             for p in [home, *home.rglob("*")]}
    assert rounds > 20 and swaps >= 1, (rounds, swaps)  # the attack landed
    assert after == before
