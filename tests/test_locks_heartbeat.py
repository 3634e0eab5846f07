"""Lock heartbeats (compile_cache.locks): a live holder keeps its lock however long it compiles,
a dead or frozen one loses it after the stale age, and a pid says nothing across containers.

Every wait is bounded (``WAIT``), so a deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from compile_cache._paths import HOSTNAME
from compile_cache.errors import LockTimeoutError
from compile_cache.locks import LOCAL_NAMESPACE, FileLock, LockHolder, is_stale, read_holder

REPO = str(Path(__file__).resolve().parents[1])
WAIT = 30.0
STALE = 2.0  # stale age of these tests: a heartbeat every second

HOLDER = """
import sys, time
sys.path.insert(0, {repo!r})
from pathlib import Path
from compile_cache.locks import FileLock
base, mode, hold, marker = sys.argv[1], sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
lock = FileLock(base, mode=mode, timeout=20, stale_after={stale})
lock.acquire()
print("locked", flush=True)
time.sleep(hold)
marker.write_text("done")  # written while still holding: a waiter that broke the lock sees none
lock.release()
print("released", flush=True)
"""


def _spawn_holder(base: Path, mode: str, hold: float, marker: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(repo=REPO, stale=STALE), str(base), mode, str(hold),
         str(marker)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # the child prints at once; a crash closes the pipe
    if line != "locked":
        proc.kill()
        pytest.fail(f"holder did not take the lock: {line!r} {proc.communicate(timeout=WAIT)}")
    return proc


def _wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {WAIT}s")
        time.sleep(0.05)


def test_holder_record_parses_old_and_new_forms() -> None:
    old = LockHolder.parse("node7:42:1700000000.500")
    assert old == LockHolder("node7", 42, 1700000000.5, "") and old.is_alive() is None
    new = LockHolder.parse(f"node7:42:1700000000.500:{LOCAL_NAMESPACE or 'ns.1'}\n")
    assert new is not None and new.namespace and new.same_process(old.beat()) is False
    assert LockHolder.parse(new.encode().decode()) == new
    for garbage in ("", "node7", "node7:x:1", ":1:2", "a:1:2:3:4"):
        assert LockHolder.parse(garbage) is None


@pytest.mark.parametrize("mode", ["mkdir", "fcntl"])
def test_a_holder_refreshes_its_record_while_it_holds_the_lock(tmp_path: Path, mode: str) -> None:
    with FileLock(tmp_path / "key", mode=mode, timeout=1, stale_after=STALE) as lock:
        first = read_holder(lock.path)
        assert first is not None and first.same_process(LockHolder(HOSTNAME, os.getpid(), 0.0, LOCAL_NAMESPACE))
        _wait_until(lambda: (read_holder(lock.path) or first).time > first.time, "no heartbeat")
        assert not is_stale(lock.path, stale_after=STALE) if mode == "mkdir" else True
    if mode == "mkdir":
        assert not lock.path.exists()


@pytest.mark.parametrize("mode", ["mkdir", "fcntl"])
def test_a_waiter_outwaits_its_timeout_while_the_holder_is_alive_then_takes_the_lock(
    tmp_path: Path, mode: str
) -> None:
    """The holder keeps the lock twice the stale age: without its heartbeat the waiter would
    break a live lock (mkdir) or give up at its timeout (fcntl)."""
    base, marker = tmp_path / "key", tmp_path / "holder-finished"
    proc = _spawn_holder(base, mode, 2 * STALE + 1, marker)
    try:
        waiter = FileLock(base, mode=mode, timeout=0.3, stale_after=STALE, wait_alive=WAIT)
        with waiter:
            assert marker.exists(), "the waiter took the lock while its holder still held it"
        assert waiter.waited_past_timeout and waiter.waited > 0.3
        out, err = proc.communicate(timeout=WAIT)
        assert "released" in out and "broken" not in err, err
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)


@pytest.mark.parametrize("mode", ["mkdir", "fcntl"])
def test_a_waiter_takes_a_lock_released_between_its_try_and_its_look_at_the_holder(
    tmp_path: Path, mode: str
) -> None:
    """The release race: the waiter's try fails, then the holder releases (its record goes
    first: the lock directory is renamed aside, the lock file emptied before it is unlocked),
    then the waiter looks at the holder and finds no record. That is a lock changing hands, not
    a dead holder: the waiter takes it instead of giving up with "held by an unknown process"."""
    base, marker = tmp_path / "key", tmp_path / "m"
    proc = _spawn_holder(base, mode, 600, marker)
    waiter = FileLock(base, mode=mode, timeout=0.3, stale_after=STALE, wait_alive=WAIT)
    try_on_disk, released = waiter.try_once, []

    def release_just_after_a_failed_try() -> bool:
        took = try_on_disk()
        if not took and not released and waiter.waited_past_timeout:
            if mode == "mkdir":  # the holder's release: rename aside (then it would rmtree it)
                os.rename(waiter.path, tmp_path / "aside")
            else:  # the holder's release: empty the record; the unlock follows an instant later
                os.truncate(waiter.path, 0)
            proc.kill()  # the holder gone, its lock free: nothing but the record told the waiter
            proc.wait(timeout=WAIT)
            released.append(True)
        return took

    waiter.try_once = release_just_after_a_failed_try  # type: ignore[method-assign]
    try:
        with waiter:
            assert released and read_holder(waiter.path).pid == os.getpid()
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)


def test_without_wait_alive_the_timeout_still_holds(tmp_path: Path) -> None:
    base, marker = tmp_path / "key", tmp_path / "m"
    proc = _spawn_holder(base, "mkdir", 2 * STALE + 1, marker)
    try:
        with pytest.raises(LockTimeoutError, match=f"{HOSTNAME}:{proc.pid}.*heartbeat"):
            FileLock(base, mode="mkdir", timeout=0.3, stale_after=STALE).acquire()
        assert not marker.exists()
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)


def test_wait_alive_is_a_bound_too(tmp_path: Path) -> None:
    """A holder that stays alive for ever: the waiter gives up at ``wait_alive``, naming it."""
    base = tmp_path / "key"
    lock_dir = base.with_name("key.lockdir")
    lock_dir.mkdir()
    stop = threading.Event()

    def beat() -> None:  # a live holder on another node, refreshing its record
        while not stop.is_set():  # written aside and renamed, as holders do: never half a record
            (lock_dir / "owner.new").write_text(f"othernode:99:{time.time():.3f}:boot.1\n")
            os.replace(lock_dir / "owner.new", lock_dir / "owner")
            stop.wait(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        waiter = FileLock(base, mode="mkdir", timeout=0.2, stale_after=STALE, wait_alive=1.0)
        with pytest.raises(LockTimeoutError, match="othernode:99") as info:
            waiter.acquire()
        assert "while its heartbeat was fresh" in str(info.value) and waiter.waited_past_timeout
        assert lock_dir.is_dir()  # alive: never broken
    finally:
        stop.set()
        thread.join(timeout=WAIT)


def test_a_frozen_holder_loses_its_lock_after_the_stale_age(tmp_path: Path) -> None:
    """A stopped process is alive (its pid exists) but sends no heartbeat: broken by age."""
    base, marker = tmp_path / "key", tmp_path / "m"
    proc = _spawn_holder(base, "mkdir", 600, marker)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        with FileLock(base, mode="mkdir", timeout=WAIT, stale_after=STALE) as lock:
            assert read_holder(lock.path).pid == os.getpid()
        assert proc.poll() is None  # still there, frozen: it was its silence that counted
    finally:
        proc.kill()
        proc.wait(timeout=WAIT)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=WAIT, check=True)
    return int(done.stdout)


@pytest.mark.parametrize(
    "namespace, broken",
    [("", False), ("otherboot.4026531836", False), (LOCAL_NAMESPACE, True)],
    ids=["old-record", "other-container", "this-namespace"],
)
def test_a_dead_pid_breaks_a_fresh_lock_only_in_our_own_pid_namespace(
    tmp_path: Path, namespace: str, broken: bool
) -> None:
    """A container with our hostname has its own pids: its holder's pid being free here says
    nothing, so only the heartbeat decides; in our own namespace a dead pid is dead."""
    if broken and not LOCAL_NAMESPACE:
        pytest.fail("this Linux test machine must expose /proc/self/ns/pid and a boot id")
    base = tmp_path / "key"
    lock_dir = base.with_name("key.lockdir")
    lock_dir.mkdir()
    (lock_dir / "owner").write_bytes(LockHolder(HOSTNAME, _dead_pid(), time.time(), namespace).encode())
    lock = FileLock(base, mode="mkdir", timeout=0.3, stale_after=60)
    if broken:
        with lock:
            assert read_holder(lock.path).pid == os.getpid()
    else:
        with pytest.raises(LockTimeoutError):
            lock.acquire()
        assert lock_dir.is_dir() and not is_stale(lock_dir, stale_after=60)


def _job_env(local: Path, **extra: str) -> dict[str, str]:
    """A second job on this machine, with its own local torch cache dirs ``local``: what it
    compiles or restores is its own (the machine-wide state, such as the precompiled header, is
    the machine's, as for any two jobs on one node)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPILE_CACHE_", "TORCHINDUCTOR_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(local / "inductor"), TRITON_CACHE_DIR=str(local / "triton"),
               PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


def test_a_second_job_waits_on_a_live_compile_past_the_lock_timeout_then_restores(
    tmp_path: Path,
) -> None:
    """Real Inductor. The holder compiles under the store's lock and holds it well past the
    waiter's lock timeout (1 s) and past the stale age (3 s): its heartbeat keeps the lock, the
    waiter keeps waiting, then restores the holder's packs and compiles nothing. Both are jobs on
    this machine, each with its own Inductor cache dir."""
    child = str(Path(__file__).with_name("_lock_child.py"))
    store, ready = tmp_path / "store", tmp_path / "waiter-ready"
    settings = {"COMPILE_CACHE_LOCK": "mkdir", "COMPILE_CACHE_LOCK_TIMEOUT": "1",
                "COMPILE_CACHE_LOCK_STALE": "3", "COMPILE_CACHE_WAIT_TIMEOUT": "300"}
    procs = {}
    for role in ("holder", "waiter"):
        if role == "waiter":  # start once the holder holds the lock
            _wait_until(lambda: (tmp_path / "holder.locked").exists() or procs["holder"].poll() is not None,
                        "the holder did not take the lock")
        procs[role] = subprocess.Popen(
            [sys.executable, child, role, str(store), str(tmp_path / f"{role}.json"), str(ready)],
            env=_job_env(tmp_path / role, **settings),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
    logs = {}
    for role, proc in procs.items():
        try:
            logs[role], _ = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{role} still running after 400 s")
        assert proc.returncode == 0, f"{role}:\n{logs[role][-4000:]}"
    holder, waiter = (json.loads((tmp_path / f"{r}.json").read_text()) for r in ("holder", "waiter"))
    assert holder["warm_up"]["fxgraph_misses"] >= 1 and holder["report"]["published_packs"] >= 1
    notes = waiter["warm_up"]["notes"]
    assert any("heartbeat stayed fresh past the 1 s lock timeout" in n for n in notes), notes
    assert any("another process published while we waited" in n for n in notes), notes
    assert waiter["warm_up"]["fxgraph_misses"] == 0  # compiled nothing: loaded the holder's
    assert waiter["warm_up"]["fxgraph_hits"] >= 1  # traced, each graph a restored FX hit
    assert waiter["report"]["restored_packs"] >= 1 and waiter["report"]["published_packs"] == 0
    assert "broken" not in logs["holder"] + logs["waiter"]
    assert holder["max_diff"] < 1e-4 and waiter["max_diff"] < 1e-4
