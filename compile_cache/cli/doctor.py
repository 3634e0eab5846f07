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


def _remote_info(tier: Any) -> dict[str, Any]:
    """What doctor says of a store on object storage: its URL (no credentials), whether a
    listing works, and where its credentials come from (a source, never a value)."""
    from ..store.backends import redact

    error = None
    try:
        tier.backend.list(tier.layout.stats_dir)
    except CompileCacheError as exc:
        error = str(exc)
    protocol = tier.url.split("://", 1)[0].lower()
    if protocol in ("s3", "s3a"):
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            creds = "environment (AWS_ACCESS_KEY_ID)"
        elif os.environ.get("AWS_PROFILE"):
            creds = f"profile {os.environ['AWS_PROFILE']!r}"
        else:
            creds = "the default chain (~/.aws, instance or pod role)"
        if os.environ.get("AWS_ENDPOINT_URL"):
            creds += f"; endpoint {redact(os.environ['AWS_ENDPOINT_URL'])}"
    elif protocol in ("gs", "gcs"):
        if os.environ.get("GOOGLE_OAUTH_ACCESS_TOKEN"):
            creds = "environment (GOOGLE_OAUTH_ACCESS_TOKEN)"
        elif os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            creds = "GOOGLE_APPLICATION_CREDENTIALS (a key file)"
        else:
            creds = "the metadata server, else gcsfs's chain (fsspec config token, gcloud's)"
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            creds += f"; endpoint {redact(os.environ['STORAGE_EMULATOR_HOST'])} (STORAGE_EMULATOR_HOST)"
    elif protocol in ("az", "abfs", "abfss"):
        found = [n for n in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_KEY",
                             "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_SECRET")
                 if os.environ.get(n)]
        creds = (f"environment ({found[0]})" if found
                 else "adlfs's chain (fsspec config, DefaultAzureCredential)")
    else:
        creds = f"the {protocol} backend's usual chain"
    return {"url": tier.display, "error": error, "credentials": creds, "client": tier.backend.client,
            "client_why": getattr(tier.backend, "why", "")}


def cmd_doctor(args: argparse.Namespace) -> int:
    """Where the store is and why, whether it is safe and usable, and what splits cache keys."""
    import torch

    from .. import __version__
    from ..distributed.hazards import cross_rank_hazards
    from ..keys import environment, environment_digest
    from ..locks import filesystem_type, lock_mode_for
    from ..store import Store, misses
    from ..store.remote import remote_location
    from ..store.safety import describe_dir, resolve_location

    remote: dict[str, Any] | None = None
    remote_problem = ""
    try:
        tier, local_root, remote_source = remote_location(args.cache_dir)
    except CompileCacheError as exc:  # a URL without fsspec/s3fs installed
        tier, local_root, remote_source = None, None, None
        remote = {"url": args.cache_dir or config.DIR.value(), "error": str(exc)}
        remote_problem = f"object storage unusable: {exc}"
    root, source = resolve_location(local_root if tier else None if remote else args.cache_dir)
    if tier is not None:
        source, remote = remote_source or source, _remote_info(tier)
    source_text = {
        "argument": "--cache-dir argument",
        "COMPILE_CACHE_DIR": "COMPILE_CACHE_DIR environment variable",
        "XDG_CACHE_HOME": "$XDG_CACHE_HOME/compile_cache",
        "default": "default (~/.cache/compile_cache)",
    }.get(source, source)
    problems: list[str] = [remote_problem] if remote_problem else []
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
    store_state: dict[str, Any] = {}
    if exists:
        try:
            store = Store(tier.url if tier else root)
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
    elif not problems:
        parent = root.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            problems.append(f"{root} does not exist and {parent} is not writable: the store would be read-only")

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

    if remote is not None and remote.get("error"):
        problems.append(f"object storage: {remote['error']}")
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
           ("object storage", ("reachable" if not remote["error"] else f"UNREACHABLE: {remote['error']}")
            + f"; credentials: {remote.get('credentials') or '-'}"),
           ("object storage client", (remote.get("client") or "-")
            + (f" ({remote['client_why']})" if remote.get("client_why") else ""))] if remote else []),
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

