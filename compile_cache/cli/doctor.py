"""``doctor``: where the store is and why, whether it is safe, what splits cache keys.

It only presents what the modules that own each fact find: the location and the owner/mode check
(:mod:`compile_cache.store.safety`, the store's own check), the lock mode
(:mod:`compile_cache.locks`), the environment key and cross-rank hazards (:mod:`compile_cache.keys`,
:mod:`compile_cache.distributed.hazards`), torch's capabilities (:mod:`compile_cache.torch_compat`)
and every variable of the registry (:mod:`compile_cache.config`). It imports torch (the
environment key needs it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import threading
from typing import Any

from .. import config
from .._sizes import format_size
from ..errors import CompileCacheError, ConfigError
from .output import PROG, pairs, print_json, table

__all__ = ["cmd_doctor"]

#: torch's variables doctor shows next to compile_cache's registry (compile_cache.config)
_TORCH_VARS: tuple[tuple[str, str], ...] = (
    ("TORCHINDUCTOR_CACHE_DIR", "torch's local Inductor cache (packs are restored into it)"),
    ("TRITON_CACHE_DIR", "Triton's local kernel cache (packs are restored into it)"),
)



def _backend_info() -> dict[str, Any]:
    fingerprint = importlib.import_module("compile_cache.fingerprint")  # the package's name is a function
    try:
        info: dict[str, Any] = {"backend": fingerprint.backend, "fallbacks": fingerprint.backend_fallbacks}
    except ConfigError as exc:  # a bad COMPILE_CACHE_BACKEND: listed with the variables
        return {"backend": f"not chosen ({exc})", "fallbacks": 0, "extension": None,
                "built_against_torch": None}
    impl = getattr(fingerprint, "_implementation", None)
    path = getattr(impl, "__file__", None) if fingerprint.backend == "native" else None
    if path is None:
        spec = importlib.util.find_spec("compile_cache._C")
        path = spec.origin if spec else None
    info["extension"] = path
    built = None
    for attr in ("torch_version", "__torch_version__", "TORCH_VERSION"):
        built = getattr(impl, attr, None) if fingerprint.backend == "native" else None
        if built:
            break
    info["built_against_torch"] = str(built) if built else None
    return info


#: Seconds doctor waits for a store on object storage to answer its one listing: doctor is
#: what a user runs because something is wrong, and must answer in seconds (issue 57).
PROBE_S = 5.0


class _RemoteProbe:
    """A store URL's client, credential sources and one listing (``diagnose``), found on a
    thread of its own while doctor imports torch and looks at the rest: a store that does not
    answer costs doctor :data:`PROBE_S` at most, not that plus torch's import."""

    def __init__(self, cache_dir: str | None) -> None:
        from ..store.backends import is_url

        self.url: str | None = None
        self.tier: Any = None
        self.source: str | None = None
        self.error: str | None = None  # the store could not be opened (a missing package)
        self.diagnosis: Any = None
        try:
            text = cache_dir if cache_dir is not None else config.DIR.value()
        except ConfigError:  # listed with the other bad variables
            return
        if not is_url(text):
            return
        self.url = str(text).strip()
        self._cache_dir = cache_dir
        self._opened = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._run, name="compile-cache-doctor-probe", daemon=True).start()

    def _run(self) -> None:
        from ..store.backends import diagnose
        from ..store.remote import remote_location

        try:
            self.tier, _, self.source = remote_location(self._cache_dir)  # its local tier made
            self._opened.set()
            self.diagnosis = diagnose(self.tier.backend, self.tier.layout.stats_dir, PROBE_S)
        except CompileCacheError as exc:  # a URL without fsspec or its protocol package
            self.error = str(exc)
        except Exception as exc:  # whatever a protocol package raises: a line, not a traceback
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._opened.set()
            self._done.set()

    def opened(self) -> None:
        """Until the store is open and its local tier made (its package imported), or failed."""
        self._opened.wait(PROBE_S + 30.0)

    def wait(self) -> None:
        """Until the probe is done (:data:`PROBE_S` and a margin at most: its own deadlines end it)."""
        if self.url is not None and not self._done.wait(PROBE_S + 10.0):
            self.error = f"no answer within {PROBE_S + 10.0:g} s"

    def local_tier(self) -> Any:
        from ..store.remote import local_tier_dir

        return self.tier.local_root if self.tier is not None else local_tier_dir(self.url or "")

    def info(self) -> dict[str, Any]:
        """What doctor shows and lists (see :func:`~compile_cache.store.backends.diagnose`)."""
        from ..store.backends import credential_sources, redact

        url = redact(self.url)
        d = self.diagnosis
        if d is None:
            sources = credential_sources(self.url or "")
            problem = f"object storage {url} unusable: {self.error}"
            return {"url": url, "error": self.error, "client": None, "client_why": "",
                    "credentials_looked_at": [n for n, _ in sources],
                    "credentials_found": [n for n, there in sources if there],
                    "credentials": ", ".join(n for n, there in sources if there) or "none found",
                    "endpoint": None, "answered": None, "fault": self.error, "problem": problem}
        if d.error is None:
            problem = None
        elif d.answered is False:
            problem = f"object storage {url}: {d.endpoint} did not answer: {d.fault}"
        elif d.answered:
            problem = f"object storage {url}: {d.endpoint} answered {d.fault} to a listing"
        else:
            problem = f"object storage {url}: {d.fault}"
        if problem is not None:
            problem += f" (client: {d.client}; credentials found: {', '.join(d.found) or 'none'})"
        return {"url": url, "error": d.error, "client": d.client, "client_why": d.why,
                "credentials_looked_at": list(d.looked_at), "credentials_found": list(d.found),
                "credentials": ", ".join(d.found) or "none found",
                "endpoint": d.endpoint, "answered": d.answered, "fault": d.fault, "problem": problem}


def _endpoint_text(remote: dict[str, Any]) -> str:
    """doctor's ``endpoint`` line: where requests go, and whether it answered."""
    where = remote.get("endpoint") or "-"
    if not remote.get("error"):
        return f"{where}: answered (a listing works)"
    if remote.get("answered") is False:
        return f"{where}: did not answer: {remote['fault']}"
    if remote.get("answered"):
        return f"{where}: answered {remote['fault']} (a listing refused)"
    return f"{where}: not asked (no request went out: see object storage)"


def cmd_doctor(args: argparse.Namespace) -> int:
    """Where the store is and why, whether it is safe and usable, and what splits cache keys."""
    probe = _RemoteProbe(args.cache_dir)  # first: its listing overlaps torch's import
    import torch

    from .. import __version__
    from ..distributed.hazards import cross_rank_hazards
    from ..keys import environment, environment_digest
    from ..locks import filesystem_type, lock_mode_for
    from ..store import Store, misses
    from ..store.safety import describe_dir, resolve_location

    remote: dict[str, Any] | None = None
    if probe.url is not None:  # its listing is waited for last: it overlaps what comes first
        probe.opened()
        root, source = probe.local_tier(), probe.source or ("argument" if args.cache_dir else "COMPILE_CACHE_DIR")
    else:
        root, source = resolve_location(args.cache_dir)
    source_text = {
        "argument": "--cache-dir argument",
        "COMPILE_CACHE_DIR": "COMPILE_CACHE_DIR environment variable",
        "XDG_CACHE_HOME": "$XDG_CACHE_HOME/compile_cache",
        "default": "default (~/.cache/compile_cache)",
    }.get(source, source)
    problems: list[str] = []
    try:
        shared = bool(config.SHARED.value())
    except ConfigError as exc:
        shared = False
        problems.append(str(exc))
    exists = root.is_dir()
    if os.path.lexists(root) and not exists:
        problems.append(f"{root} exists and is not a directory")
    try:
        lock_mode, lock_reason = lock_mode_for(root)
    except ConfigError as exc:
        lock_mode, lock_reason = "?", str(exc)
        problems.append(str(exc))
    perms, safe = describe_dir(root, shared) if exists else ("does not exist yet (created on first use)", True)
    if not safe:
        problems.append(f"store permissions: {perms}")
    store_problems = bool(problems)  # the location's own (the writability check below needs none)

    from ..local_dirs import check_local_dirs
    from ..torch_compat import capabilities

    try:
        trust_local = bool(config.TRUST_LOCAL_DIRS.value())
    except ConfigError:  # listed with the other bad variables below
        trust_local = False
    local = [{"label": d.label, "path": str(d.path), "safe": d.problem is None, "problem": d.problem}
             for d in check_local_dirs()]
    for d in local:
        if d["problem"] and not trust_local:
            problems.append(f"local {d['label']} dir: {d['problem']} (compile_cache uses a private "
                            "directory instead; COMPILE_CACHE_TRUST_LOCAL_DIRS=1 to use it anyway)")

    caps = [{"name": c.name, "available": c.available, "detail": c.detail} for c in capabilities()]
    env = environment()
    hazards = cross_rank_hazards()
    backend = _backend_info()
    variables = config.describe()
    problems.extend(v["error"] for v in variables if v["error"] and v["error"] not in problems)
    for name, meaning in _TORCH_VARS:
        value = os.environ.get(name)
        variables.append({"name": name, "value": value if value is not None else "unset",
                          "source": "environment" if value is not None else "default",
                          "default": "torch's", "allowed": "a directory path", "meaning": meaning,
                          "error": None})

    if probe.url is not None:
        probe.wait()
        remote = probe.info()
        if remote["problem"]:
            problems.insert(0, remote["problem"])
    store_state: dict[str, Any] = {}
    if exists and not (remote and remote["error"]):  # an unreachable URL is asked nothing more
        try:
            store = Store(probe.url if remote else root)
            st = store.stats()
            store_state = {
                "read_only": store.read_only, "read_only_reason": store.read_only_reason,
                "entries": st["entries"], "size": st["size"], "max_size": st["max_size"],
                "recent_misses": [
                    {"key": m["key"], "time": m.get("time"), "reason": m.get("reason")}
                    for m in misses.last_misses(store, 3) if not store.has(m["key"])  # unresolved
                ],
                "signed": store.signing_key is not None, "signer": store.signer,
                "signature_mismatch": st["signature_mismatch"], "untrusted": st["untrusted"],
                "load_failures": st["load_failures"], "lock_fallbacks": st["lock_fallbacks"],
                "bad_miss_records": [{"file": n, "why": why} for n, why in misses.bad_records(store)],
                "evict_lock_holder": store.evict_lock_holder(),
            }
            renames_safe, renames_why = store.rename_safety()
            store_state["member_renames"] = {"safe": renames_safe, "why": renames_why}
            if renames_safe is False:
                problems.append(f"member renames: {renames_why}")
            for bad in store_state["bad_miss_records"]:
                problems.append(f"miss record {bad['file']} is skipped: {bad['why']} (remove it)")
        except CompileCacheError as exc:
            problems.append(f"store unusable: {exc}")
    elif not store_problems and not (remote and remote["problem"]):
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            problems.append(f"{root} does not exist and {parent} is not writable: the store would be read-only")

    not_carried = _not_carried()
    precompile = _precompile_info()
    data = {
        "version": __version__,
        "store": {
            "location": remote["url"] if remote else str(root), "source": source, "exists": exists,
            "remote": remote, "local_tier": str(root) if remote else None,
            "filesystem": filesystem_type(root), "lock_mode": lock_mode, "lock_reason": lock_reason,
            "permissions": perms, "safe": safe, "group_shared": shared, **store_state,
        },
        "environment": {"key": environment_digest(env), "fields": env, "hazards": hazards},
        "fingerprint": backend,
        "torch": {"version": torch.__version__, "git": getattr(torch.version, "git_version", None)},
        "local_dirs": local,
        "variables": variables,
        "capabilities": caps,
        "precompile": precompile,
        "not_carried": not_carried,
        "problems": problems,
    }
    if args.json:
        print_json(data)
        return 1 if problems else 0

    s = data["store"]
    print(f"compile_cache {__version__}\n")
    print("Store")
    rows = [
        ("location", s["location"]),
        ("from", source_text),
        *([("local tier", f"{root} (read-through: a pack is downloaded once per node)"),
           ("object storage", "reachable" if not remote["error"] else
            "UNREACHABLE (see endpoint)" if remote.get("answered") is False else f"UNUSABLE: {remote['fault']}"),
           ("client", (remote.get("client") or "-")
            + (f" ({remote['client_why']})" if remote.get("client_why") else "")),
           ("credentials", f"looked at {', '.join(remote['credentials_looked_at']) or '-'}; found: "
            + (", ".join(remote["credentials_found"]) or "none")),
           ("endpoint", _endpoint_text(remote))] if remote else []),
        ("filesystem", s["filesystem"]),
        ("lock mode", f"{lock_mode} ({lock_reason})"),
        ("permissions", perms),
        ("sharing", "group (COMPILE_CACHE_SHARED=group)" if shared else "private to this user"),
    ]
    if store_state:
        ro = store_state["read_only"]
        rows.append(("read-only", f"yes: {store_state['read_only_reason']}" if ro else "no"))
        cap = format_size(store_state["max_size"]) if store_state["max_size"] else "unlimited"
        rows.append(("size", f"{format_size(store_state['size'])} of {cap}, {store_state['entries']} entries"))
        signing = (f"packs signed and checked (COMPILE_CACHE_SIGNING_KEY set, signer id "
                   f"{store_state['signer']})" if store_state["signed"] else "off (checksums only)")
        if store_state["signature_mismatch"]:
            signing += (f"; {store_state['signature_mismatch']} loads skipped a pack signed with another "
                        "key or unsigned (a miss for that reader only, the pack is left in place)")
        rows.append(("signing", signing))
        rows.append(("member renames", store_state["member_renames"]["why"]))
        holder = store_state["evict_lock_holder"]
        rows.append(("eviction lock", f"held by {holder} (a publisher over the cap waits a few seconds "
                     "for it, then evicts without it)" if holder else "free"))
        rows.append(("refused", f"{store_state['untrusted']} untrusted dirs/packs, "
                     f"{store_state['load_failures']} packs torch could not load, "
                     f"{store_state['lock_fallbacks']} lock fallbacks"))
    print(pairs(rows, "  "))
    if store_state.get("recent_misses"):
        print(f"\nRecent misses (`{PROG} explain` compares them with the store's entries now)")
        for miss in store_state["recent_misses"]:
            print(f"  - {miss['reason']}")
    print("\nLocal cache dirs (torch loads and runs what they hold: they must be yours alone)")
    print(pairs([(d["label"], f"{d['path']}: " + ("ok" if d["safe"] else
                  ("UNSAFE, trusted by COMPILE_CACHE_TRUST_LOCAL_DIRS" if trust_local else "UNSAFE, replaced by a "
                   "private directory when compiling") + f" ({d['problem']})")) for d in local], "  "))
    print("\nEnvironment key (packs are restored only where it is equal)")
    device = env.get("device_name") or "cpu only (no CUDA)"
    print(pairs([
        ("key", data["environment"]["key"]),
        ("torch", f"{env['torch']} (git {env['torch_git'][:12] or '?'}, CUDA {env['torch_cuda'] or 'none'})"),
        ("python", env["python"]),
        ("cpu threads", f"{env['cpu_threads']} (keyed for models on the CPU only)"),
        ("cpu capability", f"{env['cpu_capability']} (keyed for models on the CPU only)"),
        ("device", f"{device} (name, capability, CUDA and Triton keyed for models on a GPU; "
                   "not the device count)"),
    ], "  "))
    if hazards:
        print("  differs most often across nodes/ranks:")
        for hazard in hazards:
            print(f"    - {hazard}")
    else:
        print("  no cross-rank hazard found (device index 0, thread count pinned)")
    print("\nNot carried by packs (a fresh node compiles or tunes these again)")
    for line in not_carried:
        print(f"  - {line}")
    print("\nPrecompile (Dynamo's traced code cached per region group)")
    print(pairs([("state", ("on" if precompile["on"] else "off") + f" ({precompile['source']})"),
                 ("default", "off: " + precompile["why_default"])], "  "))
    print("\nFingerprint backend")
    fb_rows = [
        ("backend", backend["backend"] + (f" (fell back {backend['fallbacks']}x)" if backend["fallbacks"] else "")),
        ("extension", backend["extension"] or "not found"),
        ("built against", f"torch {backend['built_against_torch']}" if backend["built_against_torch"]
         else f"not recorded in the extension (running torch {torch.__version__})"),
    ]
    print(pairs(fb_rows, "  "))
    print("\nTorch capabilities (private torch API compile_cache uses; a missing one degrades, "
          "with one warning)")
    print(table(("  CAPABILITY", "STATE", "DETAIL"),
                 [(f"  {c['name']}", "available" if c["available"] else "MISSING", c["detail"])
                  for c in caps]))
    print("\nEnvironment variables (precedence: command-line argument > variable > default)")
    print(table(("  VARIABLE", "VALUE", "SOURCE", "DEFAULT", "MEANING"),
                 [(f"  {v['name']}", v["value"], v["source"], v["default"], v["meaning"])
                  for v in variables]))
    if problems:
        print("\nProblems")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nNo problems found")
    return 0


def _precompile_info() -> dict[str, Any]:
    """Whether a job started here uses precompile, where that comes from, and why the default is
    what it is (``config.PRECOMPILE_DEFAULT``)."""
    try:
        on = bool(config.PRECOMPILE.value())
    except ConfigError:  # listed with the other bad variables
        on = config.PRECOMPILE_DEFAULT
    source = ("COMPILE_CACHE_PRECOMPILE" if config.PRECOMPILE.raw() is not None
              else "the default; precompile=True or COMPILE_CACHE_PRECOMPILE=1 turns it on, warned")
    return {"on": on, "source": source, "default": config.PRECOMPILE_DEFAULT,
            "why_default": "under review: a loaded entry can still differ from eager where a value "
                           "was absent at trace time, a builtin is shadowed by a module global or a "
                           "class attribute is swapped after compiling"}


def _not_carried() -> list[str]:
    """What a pack never holds, so that a fresh node pays for it (shown by ``doctor``)."""
    from ..torch_compat import autotune

    out = [
        "CUTLASS kernels and other CUDACodeCache libraries (max_autotune_gemm_backends with "
        "CUTLASS): built from source on every fresh node",
        "Triton's own compile cache outside Inductor's FX-graph entries (kernels of a "
        "user's own @triton.jit functions)",
    ]
    if autotune.triton_bundling() is False:
        out.insert(0, "Triton kernels: torch._inductor.config.bundle_triton_into_fx_graph_cache "
                      "is off, so FX-graph entries carry no kernels")
    if not autotune.install_possible():
        out.append("autotune results (.best_config, max-autotune's selection cache): the "
                   "autotune.capture capability is missing")
    return out

