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
``fs``           the file layer: every file operation, no link followed; modes, read-only
                 state, locks
``counters``     the counters (an enum of names), pending counts, shards per process
``checker``      :class:`PackChecker`: limits, signature and member checks of a pack
``keeper``       an entry's upkeep: use marks, entry.json, quarantine, counted I/O errors
``parts``        :class:`StoreParts`: the above, as the operation modules take them
``loading``      a load: one consistent set of packs, each checked, trust per directory
``publishing``   a publish: checked, written whole or not at all, then the cap
``stats``        what the counters mean; hit/miss outcomes; the ``stats`` summary
``maintenance``  eviction plans (LRU, cap, age, keys), compaction, clear
``verifier``     verify: a scan, and the fixes of what it found
``archive``      export / import of entries as one tar archive
``misses``       what ``explain`` reads: entry records, the last misses
``local``        :class:`LocalStore`: every operation on one directory
``remote``       the objects under a URL (:class:`RemoteTier`), fetched into a local tier
``tiered``       :class:`TieredStore`: a local store composed with a remote tier
``backends/``    object storage clients: base (retries), fsspec, the small S3 client
``core``         :class:`Store`: the public face; builds the parts, picks local or tiered
"""

from __future__ import annotations

from ._io import StoreWarning, reset_warnings
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
from .records import (
    CompactReport,
    EntryInfo,
    EvictionPlan,
    ImportReport,
    Pack,
    PackInfo,
    VerifyReport,
)
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
    "EvictionPlan",
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
    reset_warnings()
