"""Inter-process locks (compile_cache.locks): exclusion, timeouts, stale holders, NFS fallbacks.

Every multi-process test bounds its waits, so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import compile_cache.locks as locks
from compile_cache._paths import HOSTNAME
from compile_cache.errors import ConfigError, LockTimeoutError
from compile_cache.locks import (
    LOCAL_NAMESPACE,
    FileLock,
    LockHolder,
    break_stale_lock,
    filesystem_type,
    is_stale,
    lock_mode_for,
    read_holder,
)

REPO = str(Path(__file__).resolve().parents[1])
WAIT = 30.0  # upper bound for any wait on a child process

HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from compile_cache.locks import FileLock
lock = FileLock(sys.argv[1], mode=sys.argv[2], timeout=20)
lock.acquire()
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
lock.release()
print("released", flush=True)
"""

COUNTER = """
import sys, time
sys.path.insert(0, {repo!r})
from compile_cache.locks import FileLock
base, mode, counter = sys.argv[1], sys.argv[2], sys.argv[3]
for _ in range(int(sys.argv[4])):
    with FileLock(base, mode=mode, timeout=20, poll_interval=0.005):
        with open(counter) as fh:
            value = int(fh.read() or 0)
        time.sleep(0.001)  # widen the race window: without the lock, increments get lost
        with open(counter, "w") as fh:
            fh.write(str(value + 1))
"""


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script.format(repo=REPO), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_line(proc: subprocess.Popen[str], expected: str) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], WAIT)
    if not ready:
        proc.kill()
        pytest.fail(f"child did not print {expected!r} within {WAIT}s")
    line = proc.stdout.readline().strip()
    if line != expected:
        proc.kill()
        _, err = proc.communicate(timeout=WAIT)
        pytest.fail(f"child printed {line!r}, expected {expected!r}; stderr: {err}")


@pytest.mark.parametrize("mode", ["fcntl", "flock", "mkdir"])
def test_a_lock_held_by_another_process_excludes_until_released(tmp_path, mode: str) -> None:
    base = tmp_path / "locks" / "key"
    proc = _spawn(HOLDER, str(base), mode, "1.0")
    try:
        _wait_for_line(proc, "locked")
        with pytest.raises(LockTimeoutError) as info:
            FileLock(base, mode=mode, timeout=0.2).acquire()
        assert f"{HOSTNAME}:{proc.pid}" in str(info.value)  # the message names the holder
        started = time.monotonic()
        with FileLock(base, mode=mode, timeout=WAIT) as lock:
            assert lock.is_locked
            assert read_holder(lock.path).same_process(
                LockHolder(HOSTNAME, os.getpid(), 0.0, LOCAL_NAMESPACE)
            )
        assert time.monotonic() - started < WAIT
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)


@pytest.mark.parametrize("mode", ["fcntl", "mkdir"])
def test_two_processes_contending_never_lose_an_update(tmp_path, mode: str) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    base = tmp_path / "locks" / "counter"
    procs = [_spawn(COUNTER, str(base), mode, str(counter), "10") for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=WAIT * 2)
        assert proc.returncode == 0, err
    assert counter.read_text() == "20"


def test_a_holder_killed_with_sigkill_is_broken_by_the_next_waiter(tmp_path) -> None:
    base = tmp_path / "locks" / "key"
    proc = _spawn(HOLDER, str(base), "mkdir", "600")
    _wait_for_line(proc, "locked")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=WAIT)
    lock_dir = base.with_name("key.lockdir")
    assert lock_dir.is_symlink()  # a mkdir lock (a link holding the record) survives its holder...
    assert read_holder(lock_dir).pid == proc.pid
    started = time.monotonic()
    with FileLock(base, mode="mkdir", timeout=5.0) as lock:  # ...and the next waiter breaks it
        assert read_holder(lock.path).pid == os.getpid()
    assert time.monotonic() - started < 5.0
    assert not os.path.lexists(lock_dir)


def test_a_killed_fcntl_holder_releases_its_lock(tmp_path) -> None:
    base = tmp_path / "key"
    proc = _spawn(HOLDER, str(base), "fcntl", "600")
    _wait_for_line(proc, "locked")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=WAIT)
    with FileLock(base, mode="fcntl", timeout=5.0) as lock:
        assert lock.is_locked


def _plant_lockdir(path: Path, holder: str, age: float = 0.0) -> None:
    path.mkdir(parents=True)
    (path / "owner").write_text(holder)
    if age:
        past = time.time() - age
        os.utime(path / "owner", (past, past))
        os.utime(path, (past, past))


def test_a_lock_from_another_host_is_broken_only_once_too_old(tmp_path) -> None:
    base = tmp_path / "key"
    lock_dir = base.with_name("key.lockdir")
    _plant_lockdir(lock_dir, f"othernode:4242:{time.time():.3f}")
    with pytest.raises(LockTimeoutError, match="othernode:4242"):
        FileLock(base, mode="mkdir", timeout=0.2, stale_after=60).acquire()
    assert lock_dir.exists()  # alive for all we know: not broken
    (lock_dir / "owner").write_text(f"othernode:4242:{time.time() - 120:.3f}")
    past = time.time() - 120
    os.utime(lock_dir / "owner", (past, past))  # no heartbeat for two minutes
    with FileLock(base, mode="mkdir", timeout=2.0, stale_after=60) as lock:
        assert read_holder(lock.path).host == HOSTNAME


def test_an_ownerless_lock_dir_is_broken_after_a_grace_period(tmp_path) -> None:
    lock_dir = tmp_path / "key.lockdir"
    lock_dir.mkdir()
    assert not is_stale(lock_dir, stale_after=30)
    past = time.time() - 120
    os.utime(lock_dir, (past, past))
    assert is_stale(lock_dir, stale_after=30)
    assert break_stale_lock(lock_dir, stale_after=30)
    assert not lock_dir.exists()


def test_waiting_logs_who_holds_the_lock(tmp_path, caplog) -> None:
    base = tmp_path / "key"
    _plant_lockdir(base.with_name("key.lockdir"), f"othernode:77:{time.time():.3f}")
    caplog.set_level(logging.INFO, logger="compile_cache")
    with pytest.raises(LockTimeoutError):
        FileLock(base, mode="mkdir", timeout=0.5, wait_log_interval=0.1).acquire()
    assert any("still waiting for othernode:77" in r.getMessage() for r in caplog.records)


def test_threads_of_one_process_exclude_each_other(tmp_path) -> None:
    base = tmp_path / "key"
    inside = []
    overlap = []

    def work() -> None:
        for _ in range(20):
            with FileLock(base, mode="fcntl", timeout=WAIT):
                inside.append(1)
                if len(inside) > 1:
                    overlap.append(1)
                time.sleep(0.001)
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
        assert not t.is_alive()
    assert not overlap


def test_enolck_falls_back_to_mkdir(tmp_path, monkeypatch, caplog, fresh_state) -> None:
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    monkeypatch.delenv("COMPILE_CACHE_LOCK", raising=False)
    caplog.set_level(logging.WARNING, logger="compile_cache")
    lock = FileLock(tmp_path / "key", mode="fcntl", timeout=2)
    with lock:
        assert lock.mode == "mkdir"
        assert (tmp_path / "key.lockdir").is_symlink()
    assert "falling back to mkdir" in caplog.text
    mode, reason = lock_mode_for(tmp_path)  # later locks on that filesystem go straight to mkdir
    assert mode == "mkdir" and "ENOLCK" in reason


def test_lock_mode_follows_env_and_filesystem(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COMPILE_CACHE_LOCK", "mkdir")
    assert lock_mode_for(tmp_path) == ("mkdir", "COMPILE_CACHE_LOCK=mkdir")
    monkeypatch.setenv("COMPILE_CACHE_LOCK", "posix")
    with pytest.raises(ConfigError, match="COMPILE_CACHE_LOCK"):
        lock_mode_for(tmp_path)
    monkeypatch.delenv("COMPILE_CACHE_LOCK")
    monkeypatch.setattr(locks.modes, "filesystem_type", lambda path: "nfs4")
    mode, reason = lock_mode_for(tmp_path)
    assert mode == "mkdir" and "nfs4" in reason
    monkeypatch.setattr(locks.modes, "filesystem_type", lambda path: "lustre")
    assert lock_mode_for(tmp_path)[0] == "mkdir"
    monkeypatch.setattr(locks.modes, "filesystem_type", lambda path: "ext4")
    assert lock_mode_for(tmp_path) == ("fcntl", "local ext4 filesystem")


def test_filesystem_type_reads_the_longest_mount_prefix(tmp_path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        f"server:/export {tmp_path}/shared\\040dir nfs4 rw 0 0\n"
        f"mds@o2ib:/fs {tmp_path}/lus lustre rw,localflock 0 0\n"
    )
    (tmp_path / "shared dir" / "cache").mkdir(parents=True)
    (tmp_path / "lus").mkdir()
    assert (
        filesystem_type(tmp_path / "shared dir" / "cache" / "new", mounts_file=str(mounts))
        == "nfs4"
    )
    assert filesystem_type(tmp_path / "lus" / "x", mounts_file=str(mounts)) == "lustre"
    assert filesystem_type(tmp_path / "elsewhere", mounts_file=str(mounts)) == "ext4"
    assert filesystem_type(tmp_path, mounts_file=str(tmp_path / "missing")) == "unknown"
    assert filesystem_type(tmp_path) != "unknown"  # the real /proc/mounts


def test_mode_none_never_blocks(tmp_path) -> None:
    with (
        FileLock(tmp_path / "k", mode="none") as a,
        FileLock(tmp_path / "k", mode="none", timeout=0) as b,
    ):
        assert a.is_locked and b.is_locked
    assert os.listdir(tmp_path) == []


def test_bad_mode_and_reentry_are_errors(tmp_path) -> None:
    with pytest.raises(ConfigError):
        FileLock(tmp_path / "k", mode="posix")
    lock = FileLock(tmp_path / "k", mode="mkdir", timeout=1)
    with lock, pytest.raises(RuntimeError, match="re-entrant"):
        lock.acquire()
    lock.release()  # releasing twice is harmless


def test_release_after_the_lock_was_broken_leaves_the_new_holder_alone(tmp_path) -> None:
    base = tmp_path / "key"
    lock = FileLock(base, mode="mkdir", timeout=1).acquire()
    lock.path.unlink()  # broken and re-taken elsewhere
    lock.path.symlink_to(f"othernode:9:{time.time():.3f}")
    lock.release()
    assert read_holder(lock.path) is not None and read_holder(lock.path).host == "othernode"


def test_a_dead_holder_whose_clock_ran_ahead_goes_stale_on_the_waiters_clock(tmp_path) -> None:
    """issue 31.9: a heartbeat an hour in the future is not trusted: the waiter breaks the lock
    once the record has not changed for the stale age on its own clock (not after its 1800 s
    wait_alive), and verify reports it (and --fix breaks it) at one look."""
    base = tmp_path / "key"
    lock_dir = base.with_name("key.lockdir")
    ahead = time.time() + 3600
    _plant_lockdir(lock_dir, f"othernode:4242:{ahead:.3f}")
    os.utime(lock_dir / "owner", (ahead, ahead))
    start = time.monotonic()
    with FileLock(base, mode="mkdir", timeout=0.5, stale_after=1.0, wait_alive=1800) as lock:
        assert read_holder(lock.path).host == HOSTNAME
    assert time.monotonic() - start < 10
    _plant_lockdir(lock_dir, f"othernode:4242:{ahead:.3f}")
    os.utime(lock_dir / "owner", (ahead, ahead))
    assert is_stale(lock_dir, stale_after=60, one_look=True)  # verify's single look
    assert break_stale_lock(lock_dir, stale_after=60, one_look=True) and not lock_dir.exists()


def test_a_live_holder_whose_clock_ran_ahead_keeps_its_lock_while_it_beats(tmp_path) -> None:
    base = tmp_path / "key"
    lock_dir = base.with_name("key.lockdir")
    _plant_lockdir(lock_dir, f"othernode:4242:{time.time() + 3600:.3f}")
    stop = threading.Event()

    def beat() -> None:  # the holder on the other host: a new record every 0.1 s
        while not stop.wait(0.1):  # written as a holder writes it: whole, then renamed
            (lock_dir / ".owner.tmp").write_text(f"othernode:4242:{time.time() + 3600:.3f}")
            os.replace(lock_dir / ".owner.tmp", lock_dir / "owner")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        with pytest.raises(LockTimeoutError):
            FileLock(base, mode="mkdir", timeout=5.0, stale_after=2.0).acquire()
        assert lock_dir.exists() and read_holder(lock_dir).host == "othernode"
    finally:
        stop.set()
        thread.join()


def test_a_holder_record_with_a_heartbeat_that_is_no_finite_number_is_no_holder() -> None:
    # Another member's record "host:pid:nan" would otherwise look fresh for ever (its age is 0).
    for bad in ("othernode:1:nan:ns", "othernode:1:inf", "othernode:1:-inf:ns", "othernode:1:1e999"):
        assert LockHolder.parse(bad) is None, bad
    assert LockHolder.parse("othernode:1:1.5:ns") == LockHolder("othernode", 1, 1.5, "ns")


# ---------------------------------------------------------------------------------------------
# The mkdir lock's form: one link in the locks directory whose text is the holder record


def test_a_mkdir_lock_is_one_link_holding_its_record_and_nothing_is_made_inside(tmp_path) -> None:
    base = tmp_path / "key"
    with FileLock(base, mode="mkdir", timeout=1) as lock:
        assert lock.path.is_symlink() and not lock.path.exists()  # its text names no file
        holder = LockHolder.parse(os.readlink(lock.path))
        assert holder is not None and holder.pid == os.getpid() and holder.host == HOSTNAME
        first = holder.time
        time.sleep(0.01)
        assert lock.beat()  # the heartbeat: a new link renamed over the name
        assert read_holder(lock.path).time > first
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # released: no leftover, no temp link


def test_a_member_who_swaps_the_lock_for_a_link_to_a_directory_gets_nothing_written_there(tmp_path) -> None:
    """The lock name swapped for a link to somebody's directory while held: the holder's next
    heartbeat and its release find another text and leave the name alone; nothing is made,
    written or changed in the target."""
    victim = tmp_path / "victims-home"
    victim.mkdir(mode=0o700)
    base = tmp_path / "locks" / "key"
    lock = FileLock(base, mode="mkdir", timeout=1).acquire()
    os.rename(lock.path, tmp_path / "aside")
    lock.path.symlink_to(victim)
    assert lock.beat() is False
    lock.release()
    assert list(victim.iterdir()) == [] and (victim.stat().st_mode & 0o777) == 0o700
    assert os.readlink(lock.path) == str(victim)  # not ours: left in place


def test_a_members_link_at_a_lock_name_goes_stale_and_is_removed_as_a_link(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    lock_path = tmp_path / "key.lockdir"
    lock_path.symlink_to(target)
    assert not is_stale(lock_path, stale_after=30)  # new: could be a record being judged
    past = time.time() - 60
    os.utime(lock_path, (past, past), follow_symlinks=False)
    assert is_stale(lock_path, stale_after=30)
    with FileLock(tmp_path / "key", mode="mkdir", timeout=2, stale_after=30) as lock:
        assert read_holder(lock.path).pid == os.getpid()
    assert (target / "keep").read_text() == "x"  # the link was removed, never followed


def test_a_filesystem_without_links_gets_the_directory_form(tmp_path, monkeypatch) -> None:
    def no_links(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_links)
    with FileLock(tmp_path / "key", mode="mkdir", timeout=1) as lock:
        assert lock.path.is_dir() and not lock.path.is_symlink()
        assert read_holder(lock.path).pid == os.getpid()
        assert lock.beat()
    assert not os.path.lexists(tmp_path / "key.lockdir")


def test_a_link_lock_and_an_older_releases_directory_lock_exclude_each_other(tmp_path) -> None:
    """A job of a release before 2026-12-07 holds its lock as a directory with an owner file:
    the link form waits for it (and breaks it only when stale), and it waits for ours."""
    base = tmp_path / "key"
    _plant_lockdir(base.with_name("key.lockdir"), f"{HOSTNAME}:{os.getpid()}:{time.time():.3f}:{LOCAL_NAMESPACE}")
    with pytest.raises(LockTimeoutError):
        FileLock(base, mode="mkdir", timeout=0.2).acquire()
    os.unlink(base.with_name("key.lockdir") / "owner")
    os.rmdir(base.with_name("key.lockdir"))
    with FileLock(base, mode="mkdir", timeout=1):
        with pytest.raises(FileExistsError):  # an older release's take: mkdir of the name
            os.mkdir(base.with_name("key.lockdir"))
