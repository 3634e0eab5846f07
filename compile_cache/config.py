"""Every ``COMPILE_CACHE_*`` environment variable, in one registry: name, type, default, doc.

Nothing else in compile_cache reads ``os.environ`` for a ``COMPILE_CACHE_*`` name: code asks its
:class:`Variable` here (``config.MAX_SIZE.value()``). A variable is read when it is first needed
(a store is opened, a compile starts, a rank waits), never at ``import compile_cache``, and read
again on every use, so a test or a job that changes the environment sees the new value.

Values are parsed one way per type. Booleans accept ``1/0``, ``true/false``, ``yes/no`` and
``on/off`` (any case); an empty or unset variable means the default. A value that cannot be used
raises :class:`~compile_cache.errors.ConfigError` naming the variable, the value and what would be
right. ``python -m compile_cache doctor`` prints this registry with each value and its source.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._sizes import format_size, parse_size
from .errors import ConfigError

__all__ = [
    "BACKEND",
    "BROADCAST_SCOPE",
    "DEFER_HEADER",
    "DIR",
    "DISTRIBUTED",
    "LOCAL_TIER",
    "LOCK",
    "LOCK_STALE",
    "LOCK_TIMEOUT",
    "MAX_MEMBER_NAME",
    "MAX_PACK_MEMBERS",
    "MAX_PACK_SIZE",
    "MAX_SIZE",
    "PACK_COMPRESSION",
    "PRECOMPILE",
    "PRECOMPILE_DEFAULT",
    "PRECOMPILE_UNDER_REVIEW",
    "PREFETCH",
    "PREFETCH_HEADER",
    "READ_ONLY",
    "REMOTE_RETRIES",
    "REMOTE_FIRST_TIMEOUT",
    "REMOTE_TIMEOUT",
    "REMOTE_CLIENT",
    "S3_CLIENT",
    "SHARED",
    "SIGNING_KEY",
    "TRUST_LOCAL_DIRS",
    "VARIABLES",
    "WAIT_TIMEOUT",
    "Variable",
    "check_all",
    "describe",
    "parse_bool",
]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
BOOLEAN_VALUES = "1/0, true/false, yes/no or on/off"


class _Invalid(Exception):
    """Raised by a parser: the text is not a value of the variable's type."""


def parse_bool(text: str) -> bool:
    """The one boolean parser: ``1/0``, ``true/false``, ``yes/no``, ``on/off``, any case."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _Invalid(text)


def _choice(values: tuple[str, ...], aliases: dict[str, str] | None = None) -> Callable[[str], str]:
    table = {v: v for v in values} | dict(aliases or {})

    def parse(text: str) -> str:
        try:
            return table[text.strip().lower()]
        except KeyError:
            raise _Invalid(text) from None

    return parse


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError:
        raise _Invalid(text) from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _Invalid(text) from None
    if not value > 0 or value == float("inf"):
        raise _Invalid(text)
    return value


def _shared(text: str) -> bool:
    low = text.lower()
    if low == "group":
        return True
    if low in ("private", "user") or low in _FALSE:
        return False
    raise _Invalid(text)


def _text(text: str) -> str:
    return text


def _positive_size(text: str) -> int:
    value = _size(text)
    if value <= 0:
        raise _Invalid(text)
    return value


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise _Invalid(text) from None
        if not low <= value <= high:
            raise _Invalid(text)
        return value

    return parse


@dataclass(frozen=True)
class Variable:
    """One environment variable: how to read it, what it defaults to, what it means."""

    name: str
    kind: str  # bool, size, seconds, choice, path, secret
    default: Any
    doc: str
    allowed: str  # what a right value looks like (error messages, doctor)
    parser: Callable[[str], Any] = field(default=_text, repr=False, compare=False)
    secret: bool = False

    def raw(self) -> str | None:
        """The variable's text as set, or None when unset or empty."""
        text = os.environ.get(self.name)
        return text if text is not None and text.strip() else None

    def value(self) -> Any:
        """The parsed value, or the default when unset/empty; ConfigError for a bad value."""
        text = self.raw()
        if text is None:
            return self.default
        return self.parse(text, self.name)

    def parse(self, text: str, what: str | None = None) -> Any:
        """``text`` parsed by this variable's rule; ``what`` names the setting in the error
        (the variable, or an argument that takes the same values)."""
        try:
            return self.parser(text.strip())
        except _Invalid:
            raise ConfigError(
                f"{what or self.name}={text!r} is not a valid value: expected {self.allowed}"
            ) from None

    @property
    def source(self) -> str:
        """``"environment"`` when the variable is set (non-empty), else ``"default"``."""
        return "environment" if self.raw() is not None else "default"

    def shown(self) -> str:
        """The value for people: a secret is only ``set``/``unset``."""
        text = self.raw()
        if self.secret:
            return "set" if text is not None else "unset"
        return text if text is not None else "unset"


VARIABLES: dict[str, Variable] = {}


def _register(variable: Variable) -> Variable:
    VARIABLES[variable.name] = variable
    return variable


DIR = _register(Variable(
    "COMPILE_CACHE_DIR", "path", None,
    "the store; share it on NFS/Lustre across nodes, or a URL: s3://bucket/prefix, gs://, az://, "
    "memory:// (after --cache-dir / cache_dir=)",
    "a directory path or an object-storage URL", _text,
))
MAX_SIZE = _register(Variable(
    "COMPILE_CACHE_MAX_SIZE", "size", 20 << 30,
    "size cap; least recently used entries are evicted above it; 0 = no cap",
    "a size such as 20G, 512M or 0 (no cap); units B, K, M, G, T, P (binary)", _size,
))
SHARED = _register(Variable(
    "COMPILE_CACHE_SHARED", "choice", False,
    "'group': a group-shared store (setgid dirs, group-writable files); default private",
    "'group' (shared with your group) or unset / 'private'", _shared,
))
READ_ONLY = _register(Variable(
    "COMPILE_CACHE_READ_ONLY", "bool", False, "restore but never publish",
    f"a boolean: {BOOLEAN_VALUES}", parse_bool,
))
LOCK = _register(Variable(
    "COMPILE_CACHE_LOCK", "choice", None,
    "lock mode: fcntl, flock, mkdir or none (default: mkdir on NFS/Lustre, else fcntl)",
    "one of fcntl, flock, mkdir, none", _choice(("fcntl", "flock", "mkdir", "none")),
))
SIGNING_KEY = _register(Variable(
    "COMPILE_CACHE_SIGNING_KEY", "secret", None,
    "HMAC key: sign packs, refuse unsigned or altered ones", "any text", _text, secret=True,
))
BACKEND = _register(Variable(
    "COMPILE_CACHE_BACKEND", "choice", None,
    "fingerprint backend: native or python (default: native if it loads, else python)",
    "'native' or 'python'", _choice(("native", "python")),
))
#: Whether ``compile_regions(precompile=None)`` uses precompile when ``COMPILE_CACHE_PRECOMPILE``
#: is unset: the one place the default is decided (the default alone applies to Inductor only).
#: Off while precompile is under review (issue 53, 2026-12-07): a hidden set of 67 cases found
#: 17 of 203 runs silently off eager with it on (a value absent at trace time, a builtin
#: shadowed by a module global, a property swapped after compiling), 0 with it off. It comes
#: back on only when every guard it drops is proven by an allow-list of treatments.
#: ``precompile=True`` (or ``COMPILE_CACHE_PRECOMPILE=1``) still uses it, with a warning.
PRECOMPILE_DEFAULT = False

#: The warning an explicit request for precompile gets while it is under review.
PRECOMPILE_UNDER_REVIEW = (
    "compile_cache: precompile is under review and off by default: a loaded entry can still "
    "differ from eager where a value was absent at trace time, a builtin is shadowed by a "
    "module global, or a class attribute is swapped after compiling. "
    "Use precompile=False (the default) where outputs must match eager"
)

PRECOMPILE = _register(Variable(
    "COMPILE_CACHE_PRECOMPILE", "bool", PRECOMPILE_DEFAULT,
    "also cache Dynamo's traced code and guards per region group, so a hit skips tracing "
    "(when compile_regions gets precompile=None)",
    f"a boolean: {BOOLEAN_VALUES}", parse_bool,
))
PREFETCH = _register(Variable(
    "COMPILE_CACHE_PREFETCH", "bool", True,
    "build Inductor's CPU instruction-set probe libraries in the background",
    f"a boolean: {BOOLEAN_VALUES}", parse_bool,
))
DEFER_HEADER = _register(Variable(
    "COMPILE_CACHE_DEFER_HEADER", "bool", True,
    "build Inductor's precompiled CPU kernel header only when a kernel is really compiled",
    f"a boolean: {BOOLEAN_VALUES}", parse_bool,
))
PREFETCH_HEADER = _register(Variable(
    "COMPILE_CACHE_PREFETCH_HEADER", "bool", True,
    "on a cold start, build Inductor's precompiled CPU kernel header in the background",
    f"a boolean: {BOOLEAN_VALUES}", parse_bool,
))
DISTRIBUTED = _register(Variable(
    "COMPILE_CACHE_DISTRIBUTED", "choice", "shared",
    "how ranks share a compile: shared (one store), broadcast (over the process group) or off",
    "one of shared, broadcast, off",
    _choice(("shared", "broadcast", "off"), {"0": "off", "no": "off", "false": "off", "none": "off"}),
))
BROADCAST_SCOPE = _register(Variable(
    "COMPILE_CACHE_BROADCAST_SCOPE", "choice", "rank",
    "who receives broadcast packs: every rank, or one rank per node",
    "'rank' or 'node'", _choice(("rank", "node")),
))
WAIT_TIMEOUT = _register(Variable(
    "COMPILE_CACHE_WAIT_TIMEOUT", "seconds", 1800.0,
    "seconds a rank waits for the compiling rank and the warm-up barrier",
    "a positive number of seconds", _seconds,
))
LOCK_TIMEOUT = _register(Variable(
    "COMPILE_CACHE_LOCK_TIMEOUT", "seconds", 300.0,
    "seconds the compiling rank waits for the store's lock of its key",
    "a positive number of seconds", _seconds,
))
LOCK_STALE = _register(Variable(
    "COMPILE_CACHE_LOCK_STALE", "seconds", 120.0,
    "seconds without a heartbeat after which a lock is stale and waiters break it (its holder "
    "refreshes it every tenth of that, at least every second, while it compiles)",
    "a positive number of seconds", _seconds,
))

# -- bounds on what one pack may hold (checked from its prefix and header before its body is read)
MAX_PACK_SIZE = _register(Variable(
    "COMPILE_CACHE_MAX_PACK_SIZE", "size", 1 << 30,
    "largest pack read or written; a larger one is refused from its first bytes (a counted miss)",
    "a positive size such as 4G or 512M; units B, K, M, G, T, P (binary)", _positive_size,
))
MAX_PACK_MEMBERS = _register(Variable(
    "COMPILE_CACHE_MAX_PACK_MEMBERS", "count", 20_000,
    "most files one pack may hold; a pack listing more is refused from its header",
    "a whole number from 1 to 10000000", _count(1, 10_000_000),
))
MAX_MEMBER_NAME = _register(Variable(
    "COMPILE_CACHE_MAX_MEMBER_NAME", "count", 1024,
    "longest member name (characters) a pack may hold; each path part is at most 255 bytes",
    "a whole number from 16 to 4096", _count(16, 4096),
))
TRUST_LOCAL_DIRS = _register(Variable(
    "COMPILE_CACHE_TRUST_LOCAL_DIRS", "bool", False,
    "use torch's local Inductor/Triton dirs even when another user owns or can write them "
    "(default: warn and use a private directory instead)",
    f"a boolean: {BOOLEAN_VALUES}", parse_bool,
))

# -- a store on object storage (COMPILE_CACHE_DIR=s3://...)
LOCAL_TIER = _register(Variable(
    "COMPILE_CACHE_LOCAL_TIER", "path", None,
    "where a store on object storage keeps its local read-through tier, one directory per URL "
    "(default $XDG_CACHE_HOME/compile_cache/remote); bounded by COMPILE_CACHE_MAX_SIZE",
    "a directory path", _text,
))
REMOTE_RETRIES = _register(Variable(
    "COMPILE_CACHE_REMOTE_RETRIES", "count", 2,
    "retries (with backoff) of an object-storage request that failed, before it is a miss",
    "a whole number from 0 to 10", _count(0, 10),
))
REMOTE_TIMEOUT = _register(Variable(
    "COMPILE_CACHE_REMOTE_TIMEOUT", "seconds", 10.0,
    "seconds an object-storage request may take to connect or to answer",
    "a positive number of seconds", _seconds,
))
REMOTE_FIRST_TIMEOUT = _register(Variable(
    "COMPILE_CACHE_REMOTE_FIRST_TIMEOUT", "seconds", 5.0,
    "seconds a process's first object-storage request may take to get an answer (the client's "
    "start and credential lookup included; at most COMPILE_CACHE_REMOTE_TIMEOUT): a store that "
    "does not answer in time is a miss, not retried, and a job compiles without it",
    "a positive number of seconds", _seconds,
))
PACK_COMPRESSION = _register(Variable(
    "COMPILE_CACHE_PACK_COMPRESSION", "count", 3,
    "zstd level of packs sent to object storage and put in export archives (0: uncompressed); "
    "3 was measured the best trade (benchmarks/RESULTS.md)",
    "a whole number from 0 to 19", _count(0, 19),
))
# -- python -m compile_cache run (set by the command for its child; a user may set them too)
#: What a process store's name may be (a path segment of nothing). Here, not in process_store,
#: so that ``run`` checks ``--name`` without importing torch.
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _run_name(text: str) -> str:
    if not RUN_NAME_PATTERN.fullmatch(text):
        raise _Invalid(text)
    return text


RUN_NAME = _register(Variable(
    "COMPILE_CACHE_RUN_NAME", "text", None,
    "the process store's name: set, the process enables the store for every torch.compile at "
    "start (python -m compile_cache run --name sets it for its command, with a sitecustomize)",
    "a name of letters, digits, '.', '_' and '-' (at most 128), starting with a letter or digit",
    _run_name,
))
RUN_DIR = _register(Variable(
    "COMPILE_CACHE_RUN_DIR", "path", None,
    "the store of the process store named by COMPILE_CACHE_RUN_NAME (run --cache-dir); unset, "
    "the store COMPILE_CACHE_DIR names", "a directory path or URL", _text,
))
REMOTE_CLIENT = _register(Variable(
    "COMPILE_CACHE_REMOTE_CLIENT", "choice", "auto",
    "client for object storage: auto (the small built-in clients for s3://, gs:// and az:// "
    "where they can serve the store, else fsspec) or fsspec (always s3fs, gcsfs or adlfs)",
    "'auto' or 'fsspec'", _choice(("auto", "fsspec")),
))
S3_CLIENT = _register(Variable(
    "COMPILE_CACHE_S3_CLIENT", "choice", "auto",
    "client for s3:// stores: auto (the small built-in client when the keys are in the "
    "environment or a profile, else s3fs) or s3fs (always)",
    "'auto' or 's3fs'", _choice(("auto", "s3fs")),
))


def _default_text(variable: Variable) -> str:
    if variable.default is None:
        return "-"
    if variable.kind == "size":
        return format_size(variable.default)
    if variable.kind == "bool":
        return "on" if variable.default else "off"
    if variable.name == SHARED.name:
        return "private"
    return str(variable.default)


def check_all() -> None:
    """Parses every variable that is set: ConfigError for the first bad one. ``compile_regions``
    calls it first, so a typo in a job's environment fails at that line, not when a rank first
    waits for another half an hour later."""
    for variable in VARIABLES.values():
        variable.value()


def describe() -> list[dict[str, Any]]:
    """Every variable with its shown value, source, default, allowed values, meaning and, for a
    bad value, the error it raises (for ``doctor``)."""
    out = []
    for variable in VARIABLES.values():
        error = None
        try:
            variable.value()
        except ConfigError as exc:
            error = str(exc)
        out.append({
            "name": variable.name,
            "value": variable.shown(),
            "source": variable.source,
            "default": _default_text(variable),
            "allowed": variable.allowed,
            "meaning": variable.doc,
            "error": error,
        })
    return out
