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

from .ondisk import RECORD_LIMIT, open_lockdir, open_record, read_link

__all__ = ["CLOCK_SKEW", "unchanged_for"]

#: A heartbeat time up to this far ahead of this host's clock is ordinary skew; further ahead it
#: is not trusted.
CLOCK_SKEW = 5.0
#: record path -> (the record as last seen, when this process first saw it so: monotonic)
_seen: dict[str, tuple[object, float]] = {}
_seen_lock = threading.Lock()
#: The holder record inside a lock directory (the same name as ``base.OWNER_FILE``).
OWNER = "owner"


def _state(dfd: int, name: str) -> object:
    """The lock ``name``'s inode, mtime and size, and its record's (a lock link's text, an older
    release's lock directory's owner file, or the lock file itself) with the record's first bytes: what changes when a holder
    beats. Non-blocking, no link followed."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    own = (st.st_ino, st.st_mtime_ns, st.st_size)
    if stat.S_ISLNK(st.st_mode):  # a mkdir lock: its text is the record
        return (own, read_link(dfd, name))
    if stat.S_ISDIR(st.st_mode):
        where = open_lockdir(dfd, name)
        if where is None:
            return own
        record_name = OWNER
    else:
        where, record_name = dfd, name
    try:
        fd = open_record(where, record_name)
        if fd is None:
            return own
        try:
            rst = os.fstat(fd)
            return (own, rst.st_ino, rst.st_mtime_ns, rst.st_size, os.read(fd, RECORD_LIMIT))
        except OSError:
            return own
        finally:
            os.close(fd)
    finally:
        if where != dfd:
            os.close(where)


def unchanged_for(dfd: int, lock_path: str | os.PathLike[str]) -> float:
    """Seconds, on this process's own monotonic clock, since the lock at ``lock_path`` (its name
    looked up in the directory open at ``dfd``) last changed as far as this process has looked:
    0 at the first look."""
    state = _state(dfd, os.path.basename(os.fspath(lock_path)))
    now = time.monotonic()
    key = os.path.abspath(lock_path)
    with _seen_lock:
        previous = _seen.get(key)
        if previous is None or previous[0] != state:
            if len(_seen) > 4096:  # bounded: the oldest looked-at lock goes first
                _seen.pop(next(iter(_seen)))
            _seen[key] = (state, now)
            return 0.0
        return now - previous[1]
