"""The on-disk store of compile artifacts: entries of immutable, checksummed, content-addressed packs.

A *key* (what ``compile_regions`` computes from the model, its plan, the compile settings and the
environment) names an *entry*; an entry accumulates *packs*, one per publish, each named by the
hash of its content. The modules, each with one job:

``pack``         the pack format: encode, content hash, the prefix/header checks, the limits
``reader``       reading a pack bounded: every check, then members on demand (decode)
``members``      what a member must be before torch sees it (complete libraries, name limits)
``layout``       every path under the store root (the only module that knows the disk layout)
``safety``       where the store is (argument, ``COMPILE_CACHE_DIR``, XDG, ~/.cache), and the
                 owner/mode checks that refuse a directory others could write (doctor uses it too)
``core``         :class:`Store`: publish, entries, quarantine, locks
``loading``      :meth:`Store.load`: one consistent set of packs, each checked, trust per directory
``stats``        the counters, sharded per process
``maintenance``  evict (LRU, cap, age, keys), clear, verify (fix)
``archive``      export / import of entries as one tar archive
``backend``      object storage under a URL (fsspec): list/get/put, bounded retries
``remote``       a store on object storage: a local read-through tier plus the URL's objects
"""

from __future__ import annotations

from ._io import StoreWarning
from ._io import _reset as _reset_warnings
from .core import DEFAULT_MAX_SIZE, Store
from .layout import LAYOUT_DIR
from .maintenance import ORPHAN_AGE, QUARANTINE_KEEP
from .pack import (
    FORMAT_VERSION,
    IncompatiblePackError,
    content_hash,
    encode_pack,
    read_pack_header,
)
from .reader import decode_pack
from .records import CompactReport, EntryInfo, ImportReport, Pack, PackInfo, VerifyReport
from .safety import resolve_location
from .stats import COUNTERS, STATS_SHARDS

__all__ = [
    "COUNTERS",
    "DEFAULT_MAX_SIZE",
    "FORMAT_VERSION",
    "LAYOUT_DIR",
    "ORPHAN_AGE",
    "QUARANTINE_KEEP",
    "STATS_SHARDS",
    "CompactReport",
    "EntryInfo",
    "ImportReport",
    "IncompatiblePackError",
    "Pack",
    "PackInfo",
    "Store",
    "StoreWarning",
    "VerifyReport",
    "content_hash",
    "decode_pack",
    "encode_pack",
    "read_pack_header",
    "resolve_location",
]


def _reset() -> None:
    """Forget which one-time store warnings were shown (tests)."""
    _reset_warnings()
