"""A hostile member of a group-shared store (issue 54), tried as that member would: two throwaway
users in one group (tests/_user_helpers.py), the victim's home under the fixture's scratch dir.

Locks are store files too: every step of a lock works relative to the locks directory's
descriptor, never through a path a member could swap (compile_cache/locks/ondisk.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import stat
import time
from pathlib import Path

import pytest
from _user_helpers import Users, as_user, make_users, owned_dir, preload, start_as_user

from compile_cache.errors import LockTimeoutError
from compile_cache.store import Store
from compile_cache.store.layout import Layout

KEY = "ab" * 16
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nvictim's\n"


@pytest.fixture(scope="module")
def users() -> Users:
    preload()
    yield from make_users()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("COMPILE_CACHE_DIR", "COMPILE_CACHE_SHARED", "COMPILE_CACHE_LOCK",
                 "COMPILE_CACHE_MAX_SIZE", "COMPILE_CACHE_READ_ONLY"):
        monkeypatch.delenv(name, raising=False)


def _group_store(users: Users, name: str) -> Path:
    shared = owned_dir(users.scratch / name, users.a, 0o2775, gid=users.gid)
    return shared / "store"


def _victim_home(users: Users, name: str) -> Path:
    """A home as real ones are (0755, searchable), with a private ~/.ssh and key."""
    home = owned_dir(users.scratch / name, users.a, 0o755)
    ssh = owned_dir(home / ".ssh", users.a, 0o700)
    key = ssh / "id_ed25519"
    key.write_bytes(SECRET)
    os.chown(key, users.a.uid, users.a.gid)
    key.chmod(0o600)
    return home


def _home_state(home: Path) -> dict[str, tuple[int, bytes | None]]:
    return {str(p.relative_to(home)): (stat.S_IMODE(p.lstat().st_mode), p.read_bytes() if p.is_file() else None)
            for p in [home, *home.rglob("*")]}


def _as_group(lock_mode: str) -> None:
    os.environ.update(COMPILE_CACHE_SHARED="group", COMPILE_CACHE_LOCK=lock_mode)


# ---------------------------------------------------------------------------------------------
# 1: the mkdir lock's chmod/rename race, and a FIFO as its owner record


def _victim_counts(store: str, until: float) -> int:
    """As the victim: what a job does all the time, counter updates (each under the shard's
    lock) and the key's lock, until ``until``."""
    _as_group("mkdir")
    opened = Store(store)
    rounds = 0
    while time.time() < until:
        opened.record_error("race")
        with contextlib.suppress(LockTimeoutError), opened.lock(KEY, timeout=0):
            pass
        rounds += 1
    return rounds


def _attacker_swaps(locks: str, targets: list[str], until: float) -> dict:
    """As the attacker: every lock directory the victim makes is exchanged with a link into
    the victim's home (renameat2 RENAME_EXCHANGE, atomic), again and again; and the key tried."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    names = [f"stats-{n}.lockdir" for n in range(8)] + [f"{KEY}.lockdir"]
    pairs = []
    for i, name in enumerate(names):
        link = f"{locks}/.evil-{name}"
        os.symlink(targets[i % len(targets)], link)
        pairs.append((f"{locks}/{name}".encode(), link.encode(), link, targets[i % len(targets)]))
    swaps, read, spins = 0, False, 0
    while time.time() < until:
        for a, b, link, target in pairs:
            if libc.renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange) == 0:
                swaps += 1  # the name is the link now: leave it there a moment, then swap back
                time.sleep(0.0005)
                libc.renameat2(at_fdcwd, a, at_fdcwd, b, rename_exchange)
                if not os.path.islink(link):  # the victim moved the link away: a new one
                    with contextlib.suppress(OSError):
                        os.rename(link, f"{link}-{swaps}")
                    with contextlib.suppress(OSError):
                        os.symlink(target, link)
        spins += 1
        if spins % 2000 == 0:
            for target in targets:
                key = os.path.join(target, "id_ed25519") if target.endswith(".ssh") else target
                with contextlib.suppress(OSError), open(key, "rb") as fh:
                    read = read or fh.read() == SECRET
    return {"swaps": swaps, "read": read}


def test_a_member_swapping_new_lock_dirs_for_links_never_changes_the_victims_home(users: Users) -> None:
    store = _group_store(users, "race-store")
    home = _victim_home(users, "race-home")
    as_user(users.a, _victim_counts, str(store), 0.0)  # the store and its locks dir exist
    before = _home_state(home)
    until = time.time() + 30
    attacker = start_as_user(users.b, _attacker_swaps, str(Layout(store).locks_dir),
                             [str(home / ".ssh"), str(home / ".ssh" / "id_ed25519")], until)
    rounds = as_user(users.a, _victim_counts, str(store), until, timeout=90)
    attack = attacker.result(60)
    assert rounds > 50 and attack["swaps"] > 50, (rounds, attack)  # both really ran
    assert _home_state(home) == before  # no mode changed, nothing written or made there
    assert not attack["read"]


def _victim_holds_then_releases(store: str, ready: str, planted: str) -> float:
    _as_group("mkdir")
    lock = Store(store).lock(KEY, timeout=5)
    lock.acquire()
    Path(ready).touch()
    deadline = time.monotonic() + 60
    while not os.path.exists(planted) and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    lock.release()
    return time.monotonic() - started


def _attacker_plants_fifo(store: str) -> None:
    """As the attacker: the victim's held lock (a link) is renamed away and a FIFO put at its
    name; and an older release's lock directory with a FIFO as its owner record."""
    locks = Layout(Path(store)).locks_dir
    os.rename(locks / f"{KEY}.lockdir", locks / ".evil-aside")
    os.mkfifo(locks / f"{KEY}.lockdir", 0o666)
    old = locks / "old.lockdir"
    old.mkdir(mode=0o777)
    os.mkfifo(old / "owner", 0o666)


def _victim_judges_old_lock(store: str) -> tuple[bool, float]:
    from compile_cache.locks import is_stale

    started = time.monotonic()
    stale = is_stale(Layout(Path(store)).locks_dir / "old.lockdir", stale_after=60)
    return stale, time.monotonic() - started


def test_a_fifo_planted_as_a_lock_or_its_record_never_hangs_the_victim(users: Users) -> None:
    store = _group_store(users, "fifo-store")
    signals = owned_dir(users.scratch / "fifo-signals", users.a, 0o755)
    ready, planted = signals / "ready", signals / "planted"
    victim = start_as_user(users.a, _victim_holds_then_releases, str(store), str(ready), str(planted))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        as_user(users.b, _attacker_plants_fifo, str(store))
        planted.touch()
        seconds = victim.result(15)  # a release that blocks on the FIFO gives no result: fails
    finally:
        victim.kill()
    assert seconds < 15
    fifo = Layout(store).locks_dir / f"{KEY}.lockdir"
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # not ours: left alone, never opened
    stale, judged_in = as_user(users.a, _victim_judges_old_lock, str(store), timeout=30)
    assert judged_in < 5 and not stale  # a record that cannot be read: judged by its age


# ---------------------------------------------------------------------------------------------
# 6 (the lock part): Store.lock raises only LockTimeoutError, whatever a member put there


def _attacker_plants_lock(store: str, hold_until: float) -> None:
    """As the attacker: a 0644 ``<key>.lock`` of its own (the victim cannot open it for
    writing), held with an fcntl lock until ``hold_until`` when that is in the future."""
    import fcntl

    path = Layout(Path(store)).lock_base(KEY).with_name(f"{KEY}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.fchmod(fd, 0o644)
    os.write(fd, b"attacker's\n")
    if hold_until > time.time():
        fcntl.lockf(fd, fcntl.LOCK_EX)
        Path(store, "held").touch()
        while time.time() < hold_until:
            time.sleep(0.05)
    os.close(fd)


def _victim_locks(store: str) -> str:
    _as_group("fcntl")
    lock = Store(store).lock(KEY, timeout=1)
    try:
        lock.acquire()
    except LockTimeoutError as exc:
        return f"timeout: {exc}"
    lock.release()
    return "taken"


def test_a_members_read_only_lock_file_is_replaced_or_waited_for_never_an_undocumented_error(
    users: Users,
) -> None:
    store = _group_store(users, "lockfile-store")
    as_user(users.a, _victim_counts, str(store), 0.0)
    as_user(users.b, _attacker_plants_lock, str(store), 0.0)
    lock = Layout(store).locks_dir / f"{KEY}.lock"
    assert as_user(users.a, _victim_locks, str(store)) == "taken"  # was PermissionError
    st = lock.lstat()
    assert (st.st_uid, st.st_nlink) == (users.a.uid, 1)  # a fresh file of the victim's in place
    # Held by the attacker: the victim waits its timeout, and says so with the documented error.
    lock.unlink()
    holder = start_as_user(users.b, _attacker_plants_lock, str(store), time.time() + 20)
    try:
        deadline = time.monotonic() + 30
        while not (store / "held").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert as_user(users.a, _victim_locks, str(store)).startswith("timeout: could not take lock")
    finally:
        holder.kill()


# ---------------------------------------------------------------------------------------------
# 2: hard links to the victim's files, where the kernel does not refuse them


@pytest.fixture
def unprotected_hardlinks():
    """``fs.protected_hardlinks=0`` (as on an NFS client whose server does not enforce it) for
    this test only, restored after, whatever happens."""
    knob = Path("/proc/sys/fs/protected_hardlinks")
    old = knob.read_text()
    knob.write_text("0")
    try:
        yield
    finally:
        knob.write_text(old)


TOKEN = "victims-registry-token-0123456789"


def _victim_publishes(store: str) -> None:
    _as_group("fcntl")
    Store(store).publish(KEY, {"inductor/x": b"y" * 64})


def _attacker_links(store: str, secret: str) -> None:
    """As the attacker: the victim's file hard-linked as every stats lock, as the entry's
    ``entry.json`` and as its ``used`` mark."""
    layout = Layout(Path(store))
    for n in range(8):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(layout.locks_dir / f"stats-{n}.lock")
        os.link(secret, layout.locks_dir / f"stats-{n}.lock")
    for target in (layout.entry_json(KEY), layout.used_file(KEY)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        os.link(secret, target)


def _victim_works(store: str, archive: str) -> dict:
    """As the victim: counter updates, a hit (marks the entry used), an export."""
    _as_group("fcntl")
    opened = Store(store)
    for _ in range(3):
        opened.record_error("x")
    opened.record_hit(KEY, seconds_saved=1.0)
    opened.export(archive)
    return {"archive": Path(archive).read_bytes()}


def test_hard_links_to_the_victims_file_are_never_written_touched_or_exported(
    users: Users, unprotected_hardlinks,
) -> None:
    import gzip

    store = _group_store(users, "hardlink-store")
    home = owned_dir(users.scratch / "hardlink-home", users.a, 0o755)
    secret = home / "registry.json"  # JSON, so that a reader that parses it would take it
    secret.write_text(json.dumps({"auth": TOKEN}))
    os.chown(secret, users.a.uid, users.a.gid)
    secret.chmod(0o600)
    os.utime(secret, (1_000_000, 1_000_000))
    as_user(users.a, _victim_publishes, str(store))
    as_user(users.b, _attacker_links, str(store), str(secret))
    before = (secret.read_bytes(), secret.stat().st_mode, secret.stat().st_mtime, secret.stat().st_atime)
    out = owned_dir(users.scratch / "hardlink-out", users.a, 0o700)
    result = as_user(users.a, _victim_works, str(store), str(out / "export.tar.gz"))
    st = secret.stat()
    assert (secret.read_bytes(), st.st_mode, st.st_mtime, st.st_atime) == before
    assert TOKEN.encode() not in gzip.decompress(result["archive"])


# ---------------------------------------------------------------------------------------------
# 4: numbers in a record a member wrote: finite and bounded before use or write-back


def _cli_as_victim(store: str, *argvs: list[str]) -> list[tuple[int, str, str]]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from compile_cache import cli

    _as_group("fcntl")
    runs = []
    for argv in argvs:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main([*argv, "--cache-dir", store])
        runs.append((code, out.getvalue(), err.getvalue()))
    return runs


def _attacker_writes_shards(store: str) -> None:
    stats = Layout(Path(store)).stats_dir
    for n in range(8):
        odd = ('{"hits": NaN, "misses": Infinity, "stored_bytes": 1e308, "seconds_saved": -Infinity}'
               if n % 2 else '{"stored_bytes": 1e308, "errors_by_kind": {"x": 1e400}, "publishes": 1}')
        (stats / f"shard-{n}.json").write_text(odd)


def _victim_publishes_after(store: str) -> dict:
    _as_group("fcntl")
    opened = Store(store)
    opened.publish("cd" * 16, {"inductor/y": b"z" * 64})
    return opened.stats()


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} in JSON output")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_or_absurd_numbers_in_a_members_stats_shard_never_break_or_leak(users: Users) -> None:
    store = _group_store(users, "nan-store")
    as_user(users.a, _victim_publishes, str(store))
    as_user(users.b, _attacker_writes_shards, str(store))
    stats = as_user(users.a, _victim_publishes_after, str(store))  # was ValueError: Out of range
    assert stats["publishes"] >= 1 and stats["errors"] >= 1  # the bad shards counted as garbage
    (listed, verify, again) = as_user(users.a, _cli_as_victim, str(store), ["stats", "--json"],
                                      ["verify", "--fix"], ["stats", "--json"])
    assert listed[0] == 0, listed
    data = _strict(listed[1])  # was NaN and Infinity: not JSON
    assert all(not isinstance(v, float) or abs(v) <= 2**53 for v in data.values()), data
    assert verify[0] in (0, 1) and "Traceback" not in verify[2], verify  # was OverflowError
    for shard in Layout(store).stats_dir.glob("shard-*.json"):  # fixed: only counts left
        assert "NaN" not in shard.read_text() and "e308" not in shard.read_text()
    assert again[0] == 0 and _strict(again[1])["stored_bytes"] < 2**53


# ---------------------------------------------------------------------------------------------
# 5: a member's text in the store never reaches the victim's terminal raw

OSC52 = "\x1b]52;c;cm0gLXJmIH4K\x07"


def _poison(value):
    if isinstance(value, str):
        return value + OSC52
    if isinstance(value, dict):
        return {k: _poison(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_poison(v) for v in value]
    return value


def _attacker_writes_escapes(store: str) -> None:
    layout = Layout(Path(store))
    entry = layout.entry_json(KEY)
    record = _poison(json.loads(entry.read_text()))
    record.setdefault("model", "m" + OSC52)
    tmp = entry.with_name(".evil")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, entry)
    layout.misses_dir.mkdir(exist_ok=True)
    miss = {"key": KEY, "time": time.time(), "host": "h" + OSC52, "pid": 1, "reason": "r" + OSC52,
            "record": _poison({"model": "net", "torch": "2.13", "fields": {"x": "y"}})}
    layout.miss_file(KEY).write_text(json.dumps(miss))


def test_terminal_escapes_in_a_members_entry_or_miss_record_are_shown_escaped(users: Users) -> None:
    store = _group_store(users, "escape-store")
    as_user(users.a, _victim_publishes, str(store))
    as_user(users.b, _attacker_writes_escapes, str(store))
    runs = as_user(users.a, _cli_as_victim, str(store), ["ls"], ["ls", "-v"], ["explain"],
                   ["doctor"])
    shown = "".join(out + err for _code, out, err in runs)
    assert "\x1b" not in shown and "\x07" not in shown, [r for r in runs if "\x1b" in r[1] + r[2]]
    assert "\\x1b]52" in shown  # what was there is shown, escaped
    assert all(code in (0, 1) for code, _out, _err in runs), [(c, e[-300:]) for c, _o, e in runs]


# ---------------------------------------------------------------------------------------------
# 6: a truncated archive, a bad miss record, a held eviction lock


def _truncated_copy(archive: str, out: str) -> None:
    data = Path(archive).read_bytes()
    Path(out).write_bytes(data[: len(data) // 2])


def test_a_truncated_archive_is_one_line_and_exit_2(users: Users) -> None:
    store = _group_store(users, "archive-store")
    as_user(users.a, _victim_publishes, str(store))
    drop = owned_dir(users.scratch / "archive-drop", users.b, 0o755)
    as_user(users.a, _cli_as_victim, str(store), ["export", str(store.parent / "all.tar.gz")])
    as_user(users.b, _truncated_copy, str(store.parent / "all.tar.gz"), str(drop / "cut.tar.gz"))
    ((code, out, err),) = as_user(users.a, _cli_as_victim, str(store), ["import", str(drop / "cut.tar.gz")])
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)
    assert "not a readable tar archive" in err


def _attacker_writes_bad_miss(store: str) -> None:
    misses = Layout(Path(store)).misses_dir
    misses.mkdir(exist_ok=True)
    (misses / "zz.json").write_text(json.dumps({"key": "../../not-hex", "time": 1.0, "reason": "r"}))


def test_doctor_reports_a_members_bad_miss_record_and_goes_on(users: Users) -> None:
    store = _group_store(users, "miss-store")
    as_user(users.a, _victim_publishes, str(store))
    as_user(users.b, _attacker_writes_bad_miss, str(store))
    ((code, out, err), (jcode, jout, _)) = as_user(users.a, _cli_as_victim, str(store), ["doctor"],
                                                    ["doctor", "--json"])
    assert code == 1 and "Traceback" not in err, (code, err)  # was exit 2 on "cache key must be"
    assert "miss record zz.json is skipped: its key '../../not-hex' is not a cache key" in out
    assert "Local cache dirs" in out  # and the rest of the report after it
    assert jcode == 1 and json.loads(jout)["store"]["bad_miss_records"][0]["file"] == "zz.json"


def _victim_publishes_over_cap(store: str) -> dict:
    _as_group("fcntl")
    opened = Store(store, max_size=10_000)
    started = time.monotonic()
    for i in range(8):
        opened.publish(f"{i:02x}" * 16, {"inductor/x": os.urandom(4000)})
    return {"seconds": time.monotonic() - started, "size": opened.stats()["size"]}


def test_a_member_holding_the_eviction_lock_does_not_turn_the_size_cap_off(users: Users) -> None:
    store = _group_store(users, "cap-store")
    as_user(users.a, _victim_publishes, str(store))
    holder = start_as_user(users.b, _attacker_holds_evict, str(store), time.time() + 120)
    try:
        deadline = time.monotonic() + 30
        while not (store / "held").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        result = as_user(users.a, _victim_publishes_over_cap, str(store), timeout=120)
        ((code, out, _err),) = as_user(users.a, _cli_as_victim, str(store), ["doctor"])
    finally:
        holder.kill()
    assert result["size"] <= 10_000, result  # was 8 packs kept: over the cap
    assert result["seconds"] < 60  # each over-cap publish waits a bounded time for the lock
    assert "eviction lock" in out and "held by" in out


def _attacker_holds_evict(store: str, hold_until: float) -> None:
    import fcntl

    fd = os.open(Layout(Path(store)).locks_dir / "evict.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    os.write(fd, b"attacker:1:1.0\n")
    Path(store, "held").touch()
    while time.time() < hold_until:
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# 7: doctor says which lock mode the store's filesystem gets and whether renames are safe


def test_doctor_says_the_lock_mode_and_whether_a_members_renames_are_safe(users: Users) -> None:
    store = _group_store(users, "doctor-store")
    as_user(users.a, _victim_publishes, str(store))
    ((code, out, err), (_jc, jout, _je)) = as_user(users.b, _cli_as_victim, str(store), ["doctor"],
                                                    ["doctor", "--json"])
    assert "Traceback" not in err
    assert "lock mode       fcntl (COMPILE_CACHE_LOCK=fcntl)" in out
    assert "member renames  yes: every step works relative to a directory descriptor" in out
    data = json.loads(jout)["store"]
    assert data["lock_mode"] == "fcntl" and data["member_renames"]["safe"] is True
    assert not list(Layout(store).locks_dir.glob(".link-probe-*"))  # the probe cleaned up
