"""Other users' directories, tried as those users would (issue 15: 15.2 trust, 15.3 group mode,
15.6 the local Inductor dir): run as throwaway non-root users made by the fixture.

Each test shows the job completing with eager's outputs, or a clear refusal naming the owner.
Children are forked and drop to the user (tests/_user_helpers.py); as they cannot read this
interpreter's files under /root, the module imports what they need and runs one job first.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import pytest
from _fault_helpers import STORE_ENV, FakeInductor, Net, run_job
from _user_helpers import Users, as_user, chown_tree, make_users, owned_dir, preload

from compile_cache.errors import UnsafeStoreError
from compile_cache.store import Store
from compile_cache.store.layout import Layout
from compile_cache.store.safety import describe_dir


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> Users:
    warm = tmp_path_factory.mktemp("preload")
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(warm / "inductor")
    try:
        preload()
        run_job(warm / "store")  # imports everything a job needs, while root can read it
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    yield from make_users()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (*STORE_ENV, "TRITON_CACHE_DIR", "COMPILE_CACHE_TRUST_LOCAL_DIRS"):
        monkeypatch.delenv(name, raising=False)


def _job_as(store: str, inductor: str) -> dict:
    """One job (FakeInductor, outputs checked against eager), in the calling user's child."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report, backend = run_job(store)
    return {"key": report.key, "restored": report.restored_packs, "published": report.published_packs,
            "hit": report.hit, "misses": backend.misses, "stats": Store(store).stats(),
            "warnings": [f"{w.category.__name__}: {w.message}" for w in record]}


def _refusal_as(store: str, inductor: str) -> str:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
    try:
        run_job(store)
    except UnsafeStoreError as exc:
        return str(exc)
    return "accepted"


# ---------------------------------------------------------------------------------------------
# 15.2: a store that belongs to another user is refused, writable or not, direct or by symlink


def test_another_users_store_is_refused_read_only_or_not_with_the_owner_named(users: Users) -> None:
    a, b = users.a, users.b
    home_b = users.scratch / "b-store"
    store_b = owned_dir(home_b, b, 0o755) / "store"
    as_user(b, _job_as, str(store_b), str(b.home / "inductor"))  # b's store, with a pack
    chown_tree(home_b, b)
    store_b.chmod(0o755)  # readable by everyone, writable by b only: was "read-only, silent"
    (store_b / "v1").chmod(0o755)

    refusal = as_user(a, _refusal_as, str(store_b), str(a.home / "inductor"))
    assert f"belongs to user {b.name} (uid {b.uid})" in refusal and "COMPILE_CACHE_DIR" in refusal
    # The same through a symlink of a's own pointing into b's store.
    link = a.home / "my-cache"
    as_user(a, os.symlink, str(store_b), str(link))
    refusal = as_user(a, _refusal_as, str(link), str(a.home / "inductor"))
    assert f"belongs to user {b.name}" in refusal
    # doctor gives the same verdict, naming the owner (and root, who could run b's code, too).
    text, safe = as_user(a, describe_dir, store_b, False)
    assert not safe and f"owned by user {b.name} (uid {b.uid})" in text
    with pytest.raises(UnsafeStoreError, match=f"belongs to user {b.name}"):
        Store(store_b)


def test_a_pack_or_entry_another_user_planted_in_our_store_is_refused(users: Users, tmp_path) -> None:
    a, b = users.a, users.b
    base = owned_dir(users.scratch / "a-home-store", a, 0o755)
    store = base / "store"
    key = as_user(a, _job_as, str(store), str(a.home / "inductor"))["key"]
    (pack,) = Layout(store).pack_paths(key)
    os.chown(pack, b.uid, b.gid)  # as if b had once been able to write there
    pack.chmod(0o644)
    result = as_user(a, _job_as, str(store), str(a.home / "inductor-2"))
    assert result["restored"] == 0 and result["misses"] >= 1  # compiled instead: eager-equal
    assert any(f"belongs to user {b.name}" in w for w in result["warnings"])
    assert result["stats"]["untrusted"] == 1
    # An entry directory of b's: the same.
    entry = Layout(store).entry_dir(key)
    os.chown(entry, b.uid, b.gid)
    entry.chmod(0o755)
    result = as_user(a, _job_as, str(store), str(a.home / "inductor-3"))
    assert result["restored"] == 0 and result["stats"]["untrusted"] == 2
    entry.chmod(0o700)  # and one a cannot even read: a miss too, never a crash
    result = as_user(a, _job_as, str(store), str(a.home / "inductor-4"))
    assert result["restored"] == 0 and result["misses"] >= 1


# ---------------------------------------------------------------------------------------------
# 15.3: group mode all the way down, and no lock error is a crash


def _group_job(store: str, inductor: str, lock_mode: str) -> dict:
    os.environ.update(COMPILE_CACHE_SHARED="group", COMPILE_CACHE_LOCK=lock_mode)
    return _job_as(store, inductor)


def _leader_as(store: str, inductor: str, lock_mode: str) -> dict:
    """The compiling rank of a distributed job: compile_regions, then the leader's compile under
    the store's lock (what crashed with PermissionError on another member's lock file)."""
    import torch
    from torch._dynamo.utils import counters

    import compile_cache
    from compile_cache.distributed import WarmUpReport, steps
    from compile_cache.session import session_for

    os.environ.update(COMPILE_CACHE_SHARED="group", COMPILE_CACHE_LOCK=lock_mode,
                      COMPILE_CACHE_LOCK_TIMEOUT="5", TORCHINDUCTOR_CACHE_DIR=inductor)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = model(x)
        compile_cache.compile_regions(model, cache_dir=store, backend=FakeInductor(salt=lock_mode))
        session = session_for(model)
        report = WarmUpReport(mode="shared", role="leader", key=session.key)
        steps.compile_under_lock(report, model, (x,), False, session, "sig", 5.0)
        out = model(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    return {"notes": report.notes, "stats": Store(store).stats()}


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")
            if not p.is_symlink()}


@pytest.mark.parametrize("lock_mode", ["fcntl", "mkdir"])
def test_a_group_store_works_for_the_second_member_all_the_way_down(users: Users, lock_mode) -> None:
    a, b = users.a, users.b
    shared = owned_dir(users.scratch / f"shared-{lock_mode}", a, 0o2775, gid=users.gid)
    store = shared / "store"
    first = as_user(a, _group_job, str(store), str(a.home / f"ind-{lock_mode}"), lock_mode)
    assert first["published"] == 1
    # b: a hit (its used mark, LRU, is b's to update), then the leader's compile under the lock.
    used = Layout(store).used_file(first["key"])
    os.utime(used, (1, 1))
    hit = as_user(b, _group_job, str(store), str(b.home / f"ind-{lock_mode}"), lock_mode)
    assert hit["hit"] and hit["misses"] == 0 and used.stat().st_mtime > 1
    leader = as_user(b, _leader_as, str(store), str(b.home / f"ind2-{lock_mode}"), lock_mode)
    assert not any("lock" in n for n in leader["notes"]), leader["notes"]  # took a's lock fine
    # Every file and directory either member created has the group mode, whatever the umask.
    modes = _modes(store)
    files = {p: m for p, m in modes.items() if not (store / p).is_dir()}
    dirs = {p: m for p, m in modes.items() if (store / p).is_dir()}
    assert files and all(m & 0o660 == 0o660 for m in files.values()), files
    assert all(m & 0o2770 == 0o2770 for m in dirs.values()), dirs
    assert all((store / p).stat().st_gid == users.gid for p in modes)


def test_a_lock_file_the_second_member_cannot_open_is_replaced_by_one_of_its_own(users: Users) -> None:
    a, b = users.a, users.b
    shared = owned_dir(users.scratch / "shared-old", a, 0o2775, gid=users.gid)
    store = shared / "store"
    key = as_user(a, _group_job, str(store), str(a.home / "ind-old"), "fcntl")["key"]
    # An older store: a's lock file was made 0644, before lock files got the group mode.
    lock = Layout(store).lock_base(key).with_name(f"{key}.lock")
    lock.touch()
    os.chown(lock, a.uid, users.gid)
    lock.chmod(0o644)
    leader = as_user(b, _leader_as, str(store), str(b.home / "ind-old"), "fcntl")
    # Nobody held it: b put a fresh lock file of its own in its place (never writing a's).
    assert not any("lock" in n for n in leader["notes"]), leader["notes"]
    assert leader["stats"]["lock_fallbacks"] == 0
    st = lock.lstat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode), st.st_nlink) == (b.uid, 0o664, 1)


def test_group_mode_refuses_a_store_of_a_group_we_are_not_in_or_without_setgid(users: Users) -> None:
    a, b = users.a, users.b
    plain = owned_dir(users.scratch / "no-setgid", a, 0o755, gid=users.gid)  # shared group, 0755
    refusal = as_user(b, _refusal_as_group, str(plain), str(b.home / "i"))
    assert f"belongs to user {a.name}" in refusal and "2775" in refusal
    foreign = owned_dir(users.scratch / "foreign", a, 0o2775, gid=a.gid)  # a's own group
    refusal = as_user(b, _refusal_as_group, str(foreign), str(b.home / "i"))
    assert "not one of this process's groups" in refusal
    shared = owned_dir(users.scratch / "setgid", a, 0o2775, gid=users.gid)
    assert as_user(b, _refusal_as_group, str(shared), str(b.home / "i")) == "accepted"


def _refusal_as_group(store: str, inductor: str) -> str:
    os.environ["COMPILE_CACHE_SHARED"] = "group"
    return _refusal_as(store, inductor)


# ---------------------------------------------------------------------------------------------
# 15.6: torch's local dirs are checked too; an unsafe one is replaced by a private dir


def _local_job(store: str, inductor: str | None, tmpdir: str | None = None) -> dict:
    import compile_cache.local_dirs as local_dirs
    from compile_cache import artifacts

    if inductor is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
    if tmpdir is not None:
        import tempfile

        os.environ["TMPDIR"] = tmpdir
        tempfile.tempdir = None
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        report, backend = run_job(store)
    from torch._inductor import codecache

    return {"restored": report.restored_packs, "hit": report.hit, "misses": backend.misses,
            "warnings": [str(w.message) for w in record if issubclass(w.category, local_dirs.UnsafeLocalDirWarning)],
            "inductor": str(artifacts.local_cache_dirs()["inductor"]),
            "header_dir": codecache._HEADER_DIR}


def test_an_inductor_dir_another_user_made_world_writable_is_replaced(users: Users) -> None:
    a, b = users.a, users.b
    store = owned_dir(users.scratch / "a-store6", a, 0o700) / "store"
    planted = owned_dir(users.scratch / "planted", b, 0o777)  # b made it, anyone can write
    first = as_user(a, _local_job, str(store), str(planted))
    assert first["warnings"] and "world-writable" in first["warnings"][0]
    assert first["inductor"] != str(planted) and Path(first["inductor"]).is_relative_to(a.home)
    assert list(planted.iterdir()) == []  # nothing compiled or restored went there
    # The next start restores into the private dir and hits (outputs equal eager's).
    again = as_user(a, _local_job, str(store), str(planted))
    assert again["hit"] and again["misses"] == 0 and list(planted.iterdir()) == []
    # A symlink (of b's) to b's directory: the same.
    link = users.scratch / "link-to-b"
    os.symlink(owned_dir(users.scratch / "b-inductor", b, 0o755), link)
    os.lchown(link, b.uid, b.gid)
    third = as_user(a, _local_job, str(store), str(link))
    assert third["warnings"] and b.name in third["warnings"][0] and third["hit"]


def test_torchs_default_dir_made_by_another_user_is_replaced_headers_included(users: Users) -> None:
    a, b = users.a, users.b
    store = owned_dir(users.scratch / "a-store-default", a, 0o700) / "store"
    tmp = users.scratch / "shared-tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # a /tmp of its own: sticky, world-writable
    owned_dir(tmp / f"torchinductor_{a.name}", b, 0o777)  # b got there first
    result = as_user(a, _local_job, str(store), None, str(tmp))
    assert result["warnings"] and any("inductor" in w for w in result["warnings"])
    assert not result["inductor"].startswith(str(tmp))
    assert result["header_dir"].startswith(str(a.home))  # precompiled headers moved too
    assert list((tmp / f"torchinductor_{a.name}").iterdir()) == []


def test_doctor_reports_an_unsafe_local_dir(users: Users, tmp_path, monkeypatch, capsys) -> None:
    from compile_cache import cli

    theirs = owned_dir(users.scratch / "their-inductor", users.b, 0o755)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(theirs))
    assert cli.main(["doctor", "--cache-dir", str(tmp_path / "s")]) == 1
    out = capsys.readouterr().out
    assert f"local inductor dir: refusing to use compile cache directory {theirs}" in out
    assert f"belongs to user {users.b.name}" in out
    monkeypatch.setenv("COMPILE_CACHE_TRUST_LOCAL_DIRS", "1")  # the opt-out: shown, not a problem
    assert cli.main(["doctor", "--cache-dir", str(tmp_path / "s")]) == 0
    assert "trusted by COMPILE_CACHE_TRUST_LOCAL_DIRS" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# issue 31.1: a group member swaps the store's working directories for links into the victim's
# home; the victim's own commands and jobs must never delete, move or plant anything there


_VICTIM_FILES = {
    "thesis/chapter1.tex": b"\\chapter{One}",
    "thesis/data/results.csv": b"1,2,3",
    "Documents/notes.txt": b"not json",
    "Documents/plan.md": b"# plan",
    ".ssh/id_ed25519": b"-----BEGIN OPENSSH PRIVATE KEY-----",
    ".ssh/authorized_keys": b"ssh-ed25519 AAAA victim",
}


def _victim_home(home: Path, user) -> dict[str, bytes]:
    """The victim's files (old, as a real home's are), owned by the victim; ``.bashrc.d`` empty."""
    month_ago = os.path.getmtime(home) - 30 * 86400
    for rel, data in _VICTIM_FILES.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (home / ".bashrc.d").mkdir(exist_ok=True)
    for path in [*home.rglob("*")]:
        os.lchown(path, user.uid, user.gid)
        os.utime(path, (month_ago, month_ago), follow_symlinks=False)
    return dict(_VICTIM_FILES)


def _victim_state(home: Path) -> tuple[dict[str, bytes], list[str]]:
    """Every file under the victim's four directories (anything moved in shows), and what
    ``.bashrc.d`` holds."""
    files = {str(p.relative_to(home)): p.read_bytes()
             for top in ("thesis", "Documents", ".ssh", ".bashrc.d") for p in (home / top).rglob("*")
             if p.is_file() or p.is_symlink()}
    return files, sorted(os.listdir(home / ".bashrc.d"))


def _swap(store: str, links: dict[str, str]) -> None:
    """As the attacker: each working dir of the store (``v1/<name>``) renamed away, a link in
    its place."""
    base = Path(store) / "v1"
    for name, target in links.items():
        if (base / name).exists():
            os.rename(base / name, base / f"{name}-old")
        os.symlink(target, base / name)


def _plant_pack(store: str, key: str) -> None:
    """As the attacker: a "pack" holding shell code in the victim's entry (fails its checks)."""
    packs = Layout(Path(store)).packs_dir(key)
    (packs / ("e" * 32 + ".pack")).write_bytes(b"#!/bin/sh\nrm -rf ~\n")


def _victim_commands(store: str, inductor: str) -> dict:
    """As the victim, everything that went wrong in issue 31: a job (a load that quarantines
    the planted pack), an over-cap publish (eviction, quarantine pruning), and the CLI's
    ``verify --fix``, ``stats``, ``stats --zero``, ``prune``, ``ls``; none may raise."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from compile_cache import cli

    os.environ.update(COMPILE_CACHE_SHARED="group")
    job = _job_as(store, inductor)  # eager-equal outputs, checked inside run_job
    Store(store, max_size=1).publish("ab" * 16, {"inductor/x": b"y" * 64})  # over the cap
    codes = {}
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        for argv in (["verify", "--fix"], ["stats"], ["stats", "--json"], ["ls"],
                     ["prune", "--max-size", "1", "--yes"], ["stats", "--zero"]):
            codes[" ".join(argv)] = cli.main([*argv, "--cache-dir", store])
    return {"job": job, "codes": codes, "stderr": err.getvalue(), "stdout": out.getvalue()}


@pytest.mark.parametrize("when", ["before-the-job", "after-the-store-opened"])
def test_a_group_member_swapping_working_dirs_for_links_never_touches_the_victims_files(
    users: Users, when: str,
) -> None:
    victim, attacker = users.a, users.b
    shared = owned_dir(users.scratch / f"shared-swap-{when}", victim, 0o2775, gid=users.gid)
    store = shared / "store"
    first = as_user(victim, _group_job, str(store), str(victim.home / f"ind-{when}-0"), "fcntl")
    home = victim.home
    before = _victim_home(home, victim)
    links = {"tmp": str(home / "thesis"), "stats": str(home / "Documents"),
             "quarantine": str(home / ".ssh"), "misses": str(home / ".bashrc.d"),
             "locks": str(home / ".ssh")}
    as_user(attacker, _plant_pack, str(store), first["key"])
    if when == "before-the-job":
        as_user(attacker, _swap, str(store), links)
        result = as_user(victim, _victim_commands, str(store), str(home / f"ind-{when}-1"))
    else:
        result = as_user(victim, _victim_after_swap, str(store), str(home / f"ind-{when}-1"),
                         links)
    assert _victim_state(home) == (before, [])  # every file there, unchanged; nothing planted
    assert "Traceback" not in result["stderr"], result["stderr"]
    if "job" in result:
        assert result["job"]["key"] == first["key"]  # completed, outputs equal to eager's
        assert all(code in (0, 1) for code in result["codes"].values()), (result["codes"], result["stderr"])


def _victim_after_swap(store: str, inductor: str, links: dict[str, str]) -> dict:
    """As the victim: a store opened and used *before* its working dirs are swapped for links,
    then used again (every operation checks at use). The links are made here, after the store
    opened, as a member's swap would make them (the victim cannot drop to the attacker): no link
    inside the store is followed, whoever made it."""
    os.environ.update(COMPILE_CACHE_SHARED="group", TORCHINDUCTOR_CACHE_DIR=inductor)
    opened = Store(store, max_size=1)
    opened.stats()
    _swap(store, links)
    key = next(opened.layout.keys())
    opened.load(key)  # quarantines the planted pack: never into the link's target
    opened.publish("cd" * 16, {"inductor/x": b"z" * 64})  # over the cap: evicts, prunes
    opened.record_miss(key)
    opened.verify(fix=True, temp_age=0)
    opened.stats()
    opened.zero_stats()
    opened.evict(max_size=1)
    opened.clear()
    return {"stderr": ""}
