"""compile_cache.store.generations and Store.compact: an entry restores its current generation.

Packs here are published straight into a store with hand-made manifests (what a capture by use
writes), so the rules are checked without a compile: a newer unit in the same (scope, slot)
supersedes an older one, other slots and scopes are kept, members are deduplicated by content,
and ``prune`` / ``verify --fix`` merge an entry into one pack that holds exactly what is current.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from _cli_helpers import call

from compile_cache.store import Store, generations, maintenance

KEY = "ab" * 16
pytestmark = pytest.mark.usefixtures("no_env_store")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _publish(store: Store, units: dict[tuple[str, str], dict[str, bytes]],
             always: dict[str, bytes] | None = None, *, carry: set[str] | None = None) -> None:
    """A pack whose manifest covers ``units`` ((scope, slot) -> members) and ``always``; it holds
    the members the store lacks (or ``carry``)."""
    everything = {n: d for members in units.values() for n, d in members.items()}
    everything.update(always or {})
    entry = store.entry(KEY)
    held = generations.held(entry.packs if entry else ())
    if carry is None:
        carry = {n for n, d in everything.items() if not generations.holds(held, n, _sha(d))}
    manifest = generations.make_manifest(
        [{"scope": s, "slot": slot, "members": list(m)} for (s, slot), m in units.items()],
        list(always or {}), {n: _sha(d) for n, d in everything.items()})
    store.publish(KEY, {n: everything[n] for n in carry},
                  metadata={generations.MANIFEST_KEY: manifest})
    time.sleep(0.01)  # packs are ordered by creation time


def _current(store: Store, scopes: list[str] | None = None) -> dict[str, bytes]:
    packs = {p.info.name: p for p in store.load(KEY)}
    selection = generations.select([p.info for p in packs.values()], scopes)
    assert selection.missing == []
    return {n: packs[src].members[n] for n, src in selection.sources.items()}


def _gen(i: int) -> dict[tuple[str, str], dict[str, bytes]]:
    """Generation ``i`` of one graph: its FX entry and kernel change, its slot does not."""
    return {("region_Block", "aot:x#0"): {f"inductor/fxgraph/k{i}/e": b"fx%d" % i,
                                          f"inductor/c{i}.kernel": b"kernel%d" % i}}


def test_a_newer_unit_in_the_same_slot_supersedes_the_older(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    isa = {"inductor/isa/probe.bin": b"isa"}
    for i in range(3):
        _publish(store, _gen(i), isa)
    assert len(store.entry(KEY).packs) == 3
    assert _current(store) == {**_gen(2)[("region_Block", "aot:x#0")], **isa}


def test_other_slots_and_scopes_are_kept_and_scopes_filter(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    _publish(store, {("region_Block", "aot:shape1#0"): {"inductor/fx/a": b"a"}})
    _publish(store, {("region_Block", "aot:shape2#0"): {"inductor/fx/b": b"b"}})  # new shape
    _publish(store, {("part_Head", "aot:shape1#0"): {"inductor/fx/h": b"h"}})  # another group
    assert set(_current(store)) == {"inductor/fx/a", "inductor/fx/b", "inductor/fx/h"}
    assert set(_current(store, ["region_Block"])) == {"inductor/fx/a", "inductor/fx/b"}


def test_members_are_deduplicated_by_content_not_by_name(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    _publish(store, {("g", "s#0"): {"inductor/c.bin": b"old", "inductor/fx/1": b"1"}})
    _publish(store, {("g", "s#0"): {"inductor/c.bin": b"old", "inductor/fx/2": b"2"}})
    second = max(store.entry(KEY).packs, key=lambda p: p.created)
    assert second.member_names == ("inductor/fx/2",)  # the same bytes are not stored twice
    _publish(store, {("g", "s#0"): {"inductor/c.bin": b"new bytes", "inductor/fx/3": b"3"}})
    assert _current(store)["inductor/c.bin"] == b"new bytes"  # a new version is not ignored


def test_packs_without_a_manifest_are_applied_whole(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    store.publish(KEY, {"inductor/old/1": b"1", "inductor/old/2": b"2"})
    _publish(store, _gen(0))
    assert {"inductor/old/1", "inductor/old/2"} <= set(_current(store))


def test_compact_merges_an_entry_into_its_current_generation(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    isa = {"inductor/isa/probe.bin": b"isa"}
    for i in range(4):
        _publish(store, _gen(i), isa)
    current = _current(store)
    assert store.compact(dry_run=True) and len(store.entry(KEY).packs) == 4
    (report,) = store.compact()
    assert len(report.merged) == 4 and report.bytes_after < report.bytes_before
    (pack,) = store.load(KEY)
    assert pack.members == current
    assert generations.manifest_of(pack.info.metadata)["always"] == list(isa)
    # The size the cap is checked against (a counter, not a walk) follows the merge exactly.
    assert store.counters.tracked_size()[0] == maintenance.total_size(store.parts)
    assert store.compact() == []  # compact already
    _publish(store, _gen(9), isa)  # a later publish still supersedes the merged pack
    assert _current(store)["inductor/fxgraph/k9/e"] == b"fx9"


def test_compaction_keeps_the_merged_packs_age(tmp_path: Path) -> None:
    """A pack published while a compaction runs must stay newer than the merged one."""
    store = Store(tmp_path / "s")
    _publish(store, _gen(0))
    _publish(store, _gen(1))
    newest = max(p.created for p in store.entry(KEY).packs)
    store.compact()
    (pack,) = store.entry(KEY).packs
    assert pack.created == newest


def test_prune_and_verify_compact(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    for i in range(3):
        _publish(store, _gen(i))
    code, out, _ = call(capsys, "verify", "--cache-dir", str(tmp_path / "s"))
    assert code == 0 and "Would compact 1 entry" in out and "verify --fix" in out
    code, out, _ = call(capsys, "prune", "--dry-run", "--cache-dir", str(tmp_path / "s"))
    assert code == 0 and "Would compact 1 entry holding superseded generations (3 packs" in out
    assert len(store.entry(KEY).packs) == 3
    code, out, _ = call(capsys, "prune", "--json", "--cache-dir", str(tmp_path / "s"))
    data = json.loads(out)
    assert code == 0 and data["removed"] == [] and len(data["compacted"][0]["merged"]) == 3
    assert len(store.entry(KEY).packs) == 1
    for i in range(3, 5):
        _publish(store, _gen(i))
    code, out, _ = call(capsys, "verify", "--fix", "--cache-dir", str(tmp_path / "s"))
    assert code == 0 and "Compacted 1 entry" in out
    assert len(store.entry(KEY).packs) == 1


def test_maintenance_never_rewrites_a_pack_it_cannot_verify_with_its_own_key(tmp_path) -> None:
    """issue 31.6: prune or verify --fix without the key (or with another one) leaves every
    other signer's packs as they are; each team still loads its own."""
    import hashlib

    from compile_cache.store import Store
    from compile_cache.store.generations import make_manifest

    root = tmp_path / "store"
    key = "ab" * 16

    def generation(store: Store, n: int, team: str) -> None:
        name = f"inductor/{team}/graph"
        data = f"{team}-{n}".encode()
        manifest = make_manifest([{"scope": "s", "slot": "graph#0", "members": [name]}], [],
                                 {name: hashlib.sha256(data).hexdigest()})
        assert store.publish(key, {name: data}, metadata={"manifest": manifest}) is not None

    teams = {t: Store(root, signing_key=f"key-{t}") for t in ("a", "b")}
    for n in (1, 2):  # two generations each: compactable
        for team, store in teams.items():
            generation(store, n, team)
    signed = {p.name: p.read_bytes() for p in Store(root).layout.pack_paths(key)}
    assert len(signed) == 4
    keyless = Store(root)
    keyless.verify(fix=True)
    keyless.compact()
    keyless.evict(older_than=10**9)  # prune's other half: nothing old, nothing removed
    after = {p.name: p.read_bytes() for p in keyless.layout.pack_paths(key)}
    assert after == signed  # not merged into one unsigned pack, not deleted
    for store in teams.values():
        assert len(store.load(key)) == 2
    teams["a"].compact()  # team a's maintenance merges team a's packs only
    assert len(teams["a"].load(key)) == 1 and len(teams["b"].load(key)) == 2
    assert {p.info.path.name for p in teams["b"].load(key)} <= set(signed)  # b's, untouched


def _generations(root, keys, rounds: int = 2) -> None:
    import hashlib

    from compile_cache.store import Store
    from compile_cache.store.generations import make_manifest

    store = Store(root)
    for n in range(rounds):
        for key in keys:
            name = "inductor/graph"
            data = f"{key}-{n}".encode()
            manifest = make_manifest([{"scope": "s", "slot": "graph#0", "members": [name]}], [],
                                     {name: hashlib.sha256(data).hexdigest()})
            store.publish(key, {name: data}, metadata={"manifest": manifest})


def test_a_full_disk_during_compaction_is_an_error_for_prune_and_not_ok_for_verify(
    tmp_path, monkeypatch, capsys,
) -> None:
    """issue 31.11: prune died with a traceback, verify --fix said OK."""
    import errno
    import hashlib

    from compile_cache import _paths, cli
    from compile_cache.store import Store
    from compile_cache.store.generations import make_manifest

    root = tmp_path / "store"
    store = Store(root)
    for members in ({"inductor/a": b"a1", "inductor/b": b"b1"}, {"inductor/a": b"a2"}):
        digests = {n: hashlib.sha256(d).hexdigest() for n, d in members.items()}
        units = [{"scope": "s", "slot": n, "members": [n]} for n in members]
        store.publish("ab" * 16, members, metadata={"manifest": make_manifest(units, [], digests)})
    # the merged pack (a2 and b1) is new: writing it needs space

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_paths, "_write_all", full)
    code = cli.main(["prune", "--max-size", "1T", "--yes", "--cache-dir", str(root)])
    out = capsys.readouterr()
    assert code in (0, 1) and "Traceback" not in out.err
    report = Store(root).verify(fix=True)
    assert not report.ok and report.not_fixed and "ENOSPC" in report.not_fixed[0][1]
    monkeypatch.undo()
    assert len(Store(root).load("ab" * 16)) == 2  # nothing lost: the packs are all still there


def _maintain(root: str, seconds: float, out) -> None:
    import time
    import traceback

    from compile_cache.store import Store

    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            store = Store(root)
            store.verify(fix=True, temp_age=0)
            store.compact()
            store.evict(max_size=10**12)
        out.put("ok")
    except BaseException:
        out.put(traceback.format_exc())


def test_concurrent_prune_and_verify_fix_never_end_in_a_traceback(tmp_path) -> None:
    """issue 31.11: two maintainers at once (prune on one node, verify --fix on another) while
    entries gain generations."""
    import multiprocessing

    from _fault_helpers import join_or_fail

    root = tmp_path / "store"
    keys = [f"{n:02x}" * 16 for n in range(6)]
    _generations(root, keys)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    children = [ctx.Process(target=_maintain, args=(str(root), 4.0, out)) for _ in range(2)]
    for child in children:
        child.start()
    _generations(root, keys, rounds=3)  # and publishers meanwhile
    for child in children:
        join_or_fail(child, 60)
    results = [out.get(timeout=5) for _ in children]
    assert results == ["ok", "ok"], results[0] if results[0] != "ok" else results[1]
