"""The ``compile-cache`` command line (also ``python -m compile_cache``).

Subcommands: ``warm`` (compile a model into the store ahead of a job), ``ls``, ``stats``,
``verify``, ``prune``, ``clear``, ``export``, ``import`` and ``doctor``. Every one takes
``--cache-dir`` and ``--help``; those that report take ``--json``. Output follows ``ccache -s``
and ``hf cache ls``: aligned columns, human sizes and ages.

Exit codes: 0 success; 1 a problem the command found (``verify`` with problems left, a ``warm``
whose code is not all in the store) or an unexpected error (with a traceback); 2 bad input (one
line on stderr: a bad TARGET, size, path, an unknown model name, a refused confirmation).

The commands live in :mod:`.store_cmds` (ls, stats, verify, prune, clear, export, import: no
torch import), :mod:`.doctor` and :mod:`.warm`; this module holds the parser and the error
handling. This package is the only part of compile_cache that prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from ..errors import CompileCacheError
from .doctor import cmd_doctor
from .output import PROG
from .store_cmds import cmd_clear, cmd_export, cmd_import, cmd_ls, cmd_prune, cmd_stats, cmd_verify
from .warm import cmd_warm

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (exposed for docs and tests)."""
    store_opts = argparse.ArgumentParser(add_help=False)
    store_opts.add_argument(
        "--cache-dir", metavar="DIR",
        help="the store (default: COMPILE_CACHE_DIR, then $XDG_CACHE_HOME/compile_cache, then ~/.cache/compile_cache)",
    )
    store_opts.add_argument("-v", "--verbose", action="store_true", help="log what compile_cache does to stderr")
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
                       "compiled code to the store, so jobs on any node restore it instead of compiling.")
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="package.module:factory or path/to/file.py:factory; the factory returns a model, "
                   "(model, example_inputs) or (model, [example_inputs, ...])")
    p.add_argument("--hf", metavar="NAME", help="a transformers model type (gpt2, llama, ...) built from its "
                   "config with random weights (never downloads)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for --hf (repeatable)")
    p.add_argument("--batch-size", action="append", metavar="N[,N...]", help="batch sizes of the input grid")
    p.add_argument("--seq-len", action="append", metavar="N[,N...]", help="sequence lengths of the input grid")
    p.add_argument("--train", action="store_true", help="warm forward and backward (default: inference)")
    p.add_argument("--dtype", help="cast the model and floating inputs (float32, bfloat16, ...)")
    p.add_argument("--device", help="move the model and inputs (cpu, cuda, cuda:0, ...)")
    p.add_argument("--mode", help="torch.compile mode (default, reduce-overhead, max-autotune, ...)")
    p.add_argument("--backend", help="torch.compile backend (default inductor)")
    p.add_argument("--dynamic", type=_bool_arg, metavar="true|false", help="torch.compile dynamic=")
    p.add_argument("--fullgraph", action="store_true", help="torch.compile fullgraph=True")
    p.add_argument("--precompile", action="store_true", help="also cache Dynamo's traced code")
    p.set_defaults(func=cmd_warm)

    p = sub.add_parser("ls", parents=both, help="list cache entries",
                       description="One row per cache entry: key, model, regions, packs, size, ages.")
    p.add_argument("--sort", choices=("size", "used", "created"), default="used",
                   help="order (largest, most recently used, newest first; default used)")
    p.add_argument("--limit", type=int, metavar="N", help="show at most N entries")
    p.add_argument("-q", "--quiet", action="store_true", help="print full keys only")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stats", parents=both, help="hit/miss statistics",
                       description="Hits, misses, errors, bytes and compile time saved, summed over processes.")
    p.add_argument("--zero", action="store_true", help="reset the counters")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("verify", parents=both, help="check every pack as a restoring job does",
                       description="Check packs (limits, checksum, signature, every member: a shared "
                       "library must be complete), owners and modes, entry files, temp files and locks. "
                       "Exit 1 when problems remain.")
    p.add_argument("--fix", action="store_true", help="quarantine corrupt packs, remove orphans and stale locks")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("prune", parents=[*both, confirm_opts], help="evict entries by size, age or key",
                       description="Remove entries: least recently used beyond --max-size, unused for "
                       "--older-than, or named by --key. Without criteria, enforce the store's cap.")
    p.add_argument("--max-size", metavar="SIZE", help="keep the store under SIZE (e.g. 20G)")
    p.add_argument("--older-than", metavar="AGE", help="remove entries not used for AGE (e.g. 30d)")
    p.add_argument("--key", action="append", metavar="K", help="remove this entry (key or prefix; repeatable)")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("clear", parents=[*both, confirm_opts], help="remove every entry",
                       description="Remove every entry and quarantined pack (statistics are kept).")
    p.set_defaults(func=cmd_clear)

    p = sub.add_parser("export", parents=both, help="write entries to one archive",
                       description="Write entries with their valid packs into one tar archive "
                       "(.tar.gz/.tgz: compressed), e.g. for an air-gapped cluster.")
    p.add_argument("file", metavar="FILE", help="the archive to write")
    p.add_argument("--key", action="append", metavar="K", help="export only this entry (repeatable)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=both, help="add the entries of an archive",
                       description="Validate every member of an archive made by export, then add "
                       "its entries. Importing twice is harmless.")
    p.add_argument("file", metavar="FILE", help="the archive to read")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("doctor", parents=both, help="diagnose the store and the environment",
                       description="Where the store is and why, filesystem and lock mode, "
                       "permissions, the environment key and its cross-node hazards, the "
                       "fingerprint backend and the environment variables.")
    p.set_defaults(func=cmd_doctor)
    return parser


def _bool_arg(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


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
    try:
        return int(args.func(args))
    except (CompileCacheError, ValueError) as exc:
        # User errors: one line, no traceback. StoreError covers a corrupt archive, an unsafe or
        # read-only store; ValueError a bad key or value; ConfigError a bad size or variable.
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
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


