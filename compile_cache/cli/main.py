"""The ``python -m compile_cache`` command line (also the ``compile-cache`` console script).

Subcommands: ``warm`` (compile a model into the store ahead of a job), ``ls``, ``stats``,
``verify``, ``prune``, ``clear``, ``export``, ``import``, ``explain`` (why a key misses),
``doctor`` and ``run`` (start a command with the process-wide store, :mod:`.run`). Every one takes
``--cache-dir`` and ``--help``; those that report take ``--json``. Output follows ``ccache -s``
and ``hf cache ls``: aligned columns, human sizes and ages.

Exit codes: 0 success; 1 a problem the command found (``verify`` with problems left, a ``warm``
that leaves no entry for its key, an ``explain`` whose key is not in the store) or an unexpected
error (with a traceback); 2 bad input (one line on stderr: a bad TARGET, flag value, size, path,
environment variable, an unknown model name, a refused confirmation).

The commands live in :mod:`.store_cmds` (ls, stats, verify, prune, clear, export, import: no
torch import), :mod:`.explain_cmd` (torch only with a TARGET), :mod:`.doctor` and :mod:`.warm`
(with :mod:`.job`, the job both mirror); this module holds the parser and the error handling.
This package is the only part of compile_cache that prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CompileCacheError
from ..redact import one_line, shown
from .job import MODE_HELP, add_job_arguments
from .output import PROG

__all__ = ["build_parser", "main"]


def _command(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of ``compile_cache.cli.<module>``, imported when it runs: a store
    command loads neither the job machinery nor doctor's."""

    qualified = f"{__package__}.{module}"

    def run(args: argparse.Namespace) -> int:
        __import__(qualified)  # the interpreter's import (seen by -X importtime), not importlib's
        return int(getattr(sys.modules[qualified], name)(args))

    run.__name__ = name
    return run


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (exposed for docs and tests)."""
    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument(
        "--cache-dir", metavar="DIR",
        help="the store: a directory or a URL such as s3://bucket/prefix (default: COMPILE_CACHE_DIR, "
             "then $XDG_CACHE_HOME/compile_cache, then ~/.cache/compile_cache)",
    )
    store_opts.add_argument("-v", "--verbose", action="store_true",
                            help="log what compile_cache does to stderr, and the warnings of the object "
                                 "storage packages (s3fs, gcsfs, adlfs and theirs)")
    json_opts = argparse.ArgumentParser(add_help=False)
    json_opts.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    confirm_opts = argparse.ArgumentParser(add_help=False)
    confirm_opts.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    confirm_opts.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    both = [store_opts, json_opts]

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Manage the compile_cache store of torch.compile artifacts.",
        epilog=f"Run `{PROG} COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("warm", parents=both, help="compile a model into the store ahead of a job",
                       description="Compile a model over a grid of input shapes and publish the "
                       "compiled code to the store, so jobs on any node restore it instead of "
                       f"compiling. {MODE_HELP} The summary prints the key; a job with the same "
                       "settings shows it in compile_cache.last_report().key. Exit 1 when the store "
                       "has no entry for the key afterwards.")
    add_job_arguments(p)
    p.add_argument("--whole-model", action="store_true",
                   help="compile the model whole, as compile_cache.compile(model) (the same key), "
                        "instead of by regions")
    p.set_defaults(func=_command("warm", "cmd_warm"))

    p = sub.add_parser("ls", parents=both, help="list cache entries",
                       description="One row per cache entry: key, model, regions, packs, size, ages.")
    p.add_argument("--sort", choices=("size", "used", "created"), default="used",
                   help="order (largest, most recently used, newest first; default used)")
    p.add_argument("--limit", type=int, metavar="N", help="show at most N entries")
    p.add_argument("-q", "--quiet", action="store_true", help="print full keys only")
    p.set_defaults(func=_command("store_cmds", "cmd_ls"))

    p = sub.add_parser("stats", parents=both, help="hit/miss statistics",
                       description="Hits, misses, errors, bytes and compile time saved, summed over processes.")
    p.add_argument("--zero", action="store_true", help="reset the counters")
    p.set_defaults(func=_command("store_cmds", "cmd_stats"))

    p = sub.add_parser("verify", parents=both, help="check every pack as a restoring job does",
                       description="Check packs (limits, checksum, signature, every member: a shared "
                       "library must be complete), owners and modes, entry files, temp files and locks. "
                       "Exit 1 when problems remain.")
    p.add_argument("--fix", action="store_true", help="quarantine corrupt packs, remove orphans and stale locks")
    p.set_defaults(func=_command("store_cmds", "cmd_verify"))

    p = sub.add_parser("prune", parents=[*both, confirm_opts], help="evict entries by size, age or key",
                       description="Remove entries: least recently used beyond --max-size, unused for "
                       "--older-than, or named by --key. Without criteria, enforce the store's cap.")
    p.add_argument("--max-size", metavar="SIZE", help="keep the store under SIZE (e.g. 20G)")
    p.add_argument("--older-than", metavar="AGE", help="remove entries not used for AGE (e.g. 30d)")
    p.add_argument("--key", action="append", metavar="K", help="remove this entry (key or prefix; repeatable)")
    p.set_defaults(func=_command("store_cmds", "cmd_prune"))

    p = sub.add_parser("clear", parents=[*both, confirm_opts], help="remove every entry",
                       description="Remove every entry and quarantined pack (statistics are kept).")
    p.set_defaults(func=_command("store_cmds", "cmd_clear"))

    p = sub.add_parser("export", parents=both, help="write entries to one archive",
                       description="Write entries with their valid packs into one tar archive "
                       "(.tar.gz/.tgz: compressed), e.g. for an air-gapped cluster.")
    p.add_argument("file", metavar="FILE", help="the archive to write")
    p.add_argument("--key", action="append", metavar="K", help="export only this entry (repeatable)")
    p.set_defaults(func=_command("store_cmds", "cmd_export"))

    p = sub.add_parser("import", parents=both, help="add the entries of an archive",
                       description="Validate every member of an archive made by export, then add "
                       "its entries. Importing twice is harmless.")
    p.add_argument("file", metavar="FILE", help="the archive to read")
    p.set_defaults(func=_command("store_cmds", "cmd_import"))

    p = sub.add_parser("explain", parents=both, help="why a start missed the store",
                       description="Without TARGET: the last misses the store recorded, each with the "
                       "fields that differ from the closest entry of the same model (threads, CPU "
                       "instruction set, torch build, torch.compile settings, precompile, dtype or "
                       "device of the parameters, ...), then the partial hits (starts that found "
                       "their key and still compiled: a new shape, a path not taken before, another "
                       "dtype or value, and whether a later node hits). With a TARGET or --hf (and "
                       f"the job's flags, as for warm): that job's key, and why it would miss. {MODE_HELP} "
                       "Exit 1 when the key is not in the store.")
    add_job_arguments(p)
    p.add_argument("--limit", type=int, default=5, metavar="N",
                   help="without TARGET: explain the N most recent misses and partial hits (default 5)")
    p.add_argument("--name", metavar="NAME",
                   help="a process store's name (run --name, compile_cache.enable): its key on this "
                        "machine, and the environment fields that differ from the name's entries")
    p.set_defaults(func=_command("explain_cmd", "cmd_explain"))

    p = sub.add_parser("run", parents=[store_opts], help="run a command with the store for its own compiles",
                       description="Start CMD with the process-wide store enabled under NAME, without "
                       "changing its code: every torch.compile in it restores from and publishes to "
                       "the store (a sitecustomize on the child's PYTHONPATH). Exit code: CMD's.")
    p.add_argument("--name", required=True, help="the entry's name (one per program or service)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
    p.set_defaults(func=_command("run", "cmd_run"))

    p = sub.add_parser("doctor", parents=both, help="diagnose the store and the environment",
                       description="Where the store is and why, filesystem and lock mode, "
                       "permissions, the environment key and its cross-node hazards, the "
                       "fingerprint backend and the environment variables.")
    p.set_defaults(func=_command("doctor", "cmd_doctor"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``compile-cache`` and ``python -m compile_cache``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "verbose", False):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log = logging.getLogger("compile_cache")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        from ..store.backends.fsspec_backend import FALLBACK_LOGGERS

        for name in FALLBACK_LOGGERS:  # the protocol packages' warnings too (quiet without -v)
            logging.getLogger(name).addHandler(handler)
    with _RedactedOutput():  # every line the command prints, --json included: no credential
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args))
    except (CompileCacheError, ValueError) as exc:
        # User errors: one line, no traceback. StoreError covers a corrupt archive, an unsafe or
        # read-only store; ValueError a bad key or value; ConfigError a bad size or variable.
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG} {args.command}: error: {one_line(message)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `compile-cache ls | head`: the reader went away; not an error.
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return 0


class _Redacting:
    """A text stream that writes what it is given with every credential redacted and every
    control character but newline and tab escaped (:func:`~compile_cache.redact.shown`): the
    store's text (an ``entry.json``, a miss record) never reaches the terminal raw."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(shown(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _RedactedOutput:
    """``with _RedactedOutput():`` sys.stdout and sys.stderr redacted, restored afterwards."""

    def __enter__(self) -> None:
        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Redacting(sys.stdout), _Redacting(sys.stderr)

    def __exit__(self, *exc: object) -> None:
        if isinstance(sys.stdout, _Redacting):
            sys.stdout = self._saved[0]
        if isinstance(sys.stderr, _Redacting):
            sys.stderr = self._saved[1]
