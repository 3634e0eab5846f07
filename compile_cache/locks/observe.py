"""Judging a lock's holder on this process's own clock: whether its record changes.

A holder's heartbeat time comes from the holder's clock, which may run ahead (a dead holder
whose time is an hour ahead would otherwise hold its lock for an hour, or, with a waiter's
``wait_alive``, for ever). A time further ahead than :data:`CLOCK_SKEW` is not trusted; such a
lock is judged by :func:`unchanged_for`: how long, on this process's monotonic clock, its record
has stayed the same. A live holder's heartbeat changes it; a dead one's does not.
"""

from __future__ import annotations

import os
import stat
import threading
import time

__all__ = ["CLOCK_SKEW", "unchanged_for"]

#: A heartbeat time up to this far ahead of this host's clock is ordinary skew; further ahead it
#: is not trusted.
CLOCK_SKEW = 5.0
#: record path -> (the record as last seen, when this process first saw it so: monotonic)
_seen: dict[str, tuple[object, float]] = {}
_seen_lock = threading.Lock()


def _state(record: str | os.PathLike[str]) -> object:
    """The record's inode, mtime, size and first bytes (non-blocking, no link): what changes
    when a holder beats."""
    try:
        fd = os.open(record, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        head = os.read(fd, 200) if stat.S_ISREG(st.st_mode) else b""
        return (st.st_ino, st.st_mtime_ns, st.st_size, head)
    except OSError:
        return None
    finally:
        os.close(fd)


def unchanged_for(record: str | os.PathLike[str]) -> float:
    """Seconds, on this process's own monotonic clock, since the lock record at ``record`` last
    changed as far as this process has looked: 0 at the first look."""
    state = _state(record)
    now = time.monotonic()
    key = os.path.abspath(record)
    with _seen_lock:
        previous = _seen.get(key)
        if previous is None or previous[0] != state:
            if len(_seen) > 4096:  # bounded: the oldest looked-at lock goes first
                _seen.pop(next(iter(_seen)))
            _seen[key] = (state, now)
            return 0.0
        return now - previous[1]
