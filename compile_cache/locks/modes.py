"""Which lock mode a directory gets: by ``COMPILE_CACHE_LOCK``, else by its filesystem.

``fcntl`` on local filesystems; ``mkdir`` on network/cluster filesystems (NFS, Lustre, GPFS,
CephFS...), where fcntl/flock can silently succeed for everyone or fail with ``ENOLCK``, and on
any filesystem where fcntl already raised ``ENOLCK`` in this process (:func:`note_enolck`).
"""

from __future__ import annotations

import os

from .. import config

__all__ = [
    "LOCK_MODES",
    "NETWORK_FILESYSTEMS",
    "device_of",
    "filesystem_type",
    "lock_mode_for",
    "note_enolck",
]

LOCK_MODES: tuple[str, ...] = ("fcntl", "flock", "mkdir", "none")
#: Filesystem types where fcntl/flock cannot be trusted across nodes: ``mkdir`` is used instead.
NETWORK_FILESYSTEMS: frozenset[str] = frozenset(
    {
        "nfs", "nfs4", "lustre", "ceph", "cifs", "smb3", "smbfs", "gpfs", "beegfs", "glusterfs",
        "fuse.glusterfs", "fuse.sshfs", "fuse.ceph", "9p", "afs", "panfs", "ocfs2", "gfs2",
        "wekafs", "fuse.juicefs", "fuse.gcsfuse", "fuse.s3fs",
    }
)
# Devices where fcntl raised ENOLCK: every later lock on them uses mkdir directly.
_enolck_devices: set[int] = set()


def _unescape_mount(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal (``\\040``)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def filesystem_type(path: str | os.PathLike[str], *, mounts_file: str = "/proc/mounts") -> str:
    """The type (``ext4``, ``nfs4``, ``lustre``...) of the filesystem holding ``path``, or ``"unknown"``.

    ``path`` need not exist: its nearest existing ancestor is used. Read from ``/proc/mounts``
    (longest mount-point prefix wins), so it is Linux-only and returns ``"unknown"`` elsewhere.
    """
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    real = os.path.realpath(probe)
    best, best_type = "", "unknown"
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return "unknown"
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point, fs_type = _unescape_mount(fields[1]), fields[2]
        prefix = mount_point.rstrip("/") + "/"
        if (real == mount_point or (real + "/").startswith(prefix)) and len(mount_point) >= len(best):
            best, best_type = mount_point, fs_type
    return best_type


def device_of(path: str | os.PathLike[str]) -> int | None:
    probe = os.path.abspath(path)
    while True:
        try:
            return os.stat(probe).st_dev
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent


def lock_mode_for(path: str | os.PathLike[str]) -> tuple[str, str]:
    """The lock mode to use for locks under ``path``, and why (for ``doctor``).

    ``COMPILE_CACHE_LOCK`` wins when set (a bad value raises :class:`ConfigError`); otherwise
    ``mkdir`` on network/cluster filesystems (NFS, Lustre, GPFS, CephFS...) or where ``fcntl``
    already failed with ``ENOLCK`` in this process, and ``fcntl`` everywhere else.
    """
    env = config.LOCK.value()
    if env is not None:
        return env, f"COMPILE_CACHE_LOCK={env}"
    fs_type = filesystem_type(path)
    if fs_type in NETWORK_FILESYSTEMS or fs_type.startswith("nfs") or "lustre" in fs_type:
        return "mkdir", f"{fs_type} filesystem: fcntl/flock are unreliable across nodes there"
    device = device_of(path)
    if device is not None and device in _enolck_devices:
        return "mkdir", f"fcntl raised ENOLCK on this {fs_type} filesystem"
    return "fcntl", f"local {fs_type} filesystem"




def note_enolck(path: str | os.PathLike[str]) -> None:
    """fcntl raised ENOLCK for ``path``: later locks on its filesystem go straight to mkdir."""
    device = device_of(path)
    if device is not None:
        _enolck_devices.add(device)


def _reset() -> None:
    """Forget the filesystems where fcntl raised ENOLCK (tests)."""
    _enolck_devices.clear()
