"""Whether a pack may be used: its limits, its signature and every member (:class:`PackChecker`).

The checks a restoring job's load makes (:meth:`PackChecker.check`): the limits from the first
bytes, the header, checksum and signature (:mod:`.reader`), then every member
(:mod:`.members`: a shared library must be a complete ELF/Mach-O file of the size the capture
recorded). A publish checks the same limits before it writes (:meth:`PackChecker.limit_problem`):
a pack readers would refuse is never written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CorruptPackError
from .fs import StoreFS
from .members import BadMemberError, member_problem, name_problem
from .pack import (
    IncompatiblePackError,
    PackLimits,
    SignatureMismatchError,
    prefix_accepts,
    signer_id,
)
from .reader import CheckedPack, open_pack, open_pack_file
from .records import PackInfo

__all__ = ["PackChecker", "check_members"]


class PackChecker:
    """The checks of a pack for a reader holding ``signing_key`` (None: none), within ``limits``."""

    def __init__(self, limits: PackLimits, signing_key: bytes | None) -> None:
        #: The bounds a pack must stay within (COMPILE_CACHE_MAX_PACK_SIZE, ...).
        self.limits = limits
        self.signing_key = signing_key
        #: The id packs signed with this key carry (None without a key).
        self.signer: str | None = signer_id(signing_key)
        #: Pack files checked whole by this process a moment ago, by (device, inode): their
        #: size and modification and change times then (:meth:`vouch`).
        self._vouched: dict[tuple[int, int], tuple[int, int, int]] = {}

    def check(self, fh: BinaryIO, key: str, labels: Any = None, *, close: bool = True,
              vouched: bool = False) -> CheckedPack:
        """Every check of one open pack file (see :meth:`Store.load`); the file is closed on
        failure (with ``close``). ``labels``: the first parts member names may have (None: any).
        ``vouched``: a file :meth:`vouch` was called for, unchanged since, is not read whole
        again (its checksum and members); its prefix, signature and header still are."""
        again = not (vouched and self._take_vouched(fh))
        checked = open_pack_file(fh, signing_key=self.signing_key, key=key, limits=self.limits, close=close,
                                 checksum=again)
        if not again:
            return checked
        try:
            check_members(checked, labels, self.limits.max_name)
        except BaseException:
            checked.close()
            raise
        return checked

    def vouch(self, st: os.stat_result) -> None:
        """The pack file ``st`` describes was given every check just now, by this process (a
        download checked, then written, fsynced and renamed into the local tier, a directory
        only its user can enter). The next load's check of that same file, unchanged since
        (device, inode, size, modification and change times), reads its prefix, signature and
        header but not its body again: ~2.5 ms of a fresh node's restore for a 1.7 MB pack,
        which a restore from a directory store does not pay twice either. Once: later checks
        read the file whole."""
        self._vouched[(st.st_dev, st.st_ino)] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _take_vouched(self, fh: BinaryIO) -> bool:
        if not self._vouched:
            return False
        st = os.fstat(fh.fileno())
        return self._vouched.pop((st.st_dev, st.st_ino), None) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def check_file(self, fs: StoreFS, path: Path, key: str, name: str, labels: Any = None,
                   *, keep_other: bool = True) -> BaseException | None:
        """The checks a load makes of the pack file at ``path``, plus its content name ``name``;
        None if it may be used. A pack of another format version or signer is not corrupt
        (``keep_other``: None, the load skips it). An OSError (EMFILE, EIO: this node's)
        propagates: never a reason to delete."""
        return self.inspect_file(fs, path, key, name, labels, keep_other=keep_other)[0]

    def inspect_file(self, fs: StoreFS, path: Path, key: str, name: str, labels: Any = None,
                     *, keep_other: bool = True) -> tuple[BaseException | None, dict[str, Any] | None]:
        """:meth:`check_file`, and the header of a pack this reader may use (else None)."""
        return self._inspect(lambda: self.check(fs.open_read(path), key, labels), name, keep_other)

    def check_data(self, data: bytes, key: str, name: str) -> tuple[BaseException | None, dict[str, Any] | None]:
        """:meth:`inspect_file` of a pack held in memory (a download, expanded): the same checks
        read from ``data``, not from a file (no system call, each of which hands the GIL to the
        job's thread when made on a download's thread)."""
        view = memoryview(data)

        def opened() -> CheckedPack:
            checked = open_pack(lambda offset, n: bytes(view[offset:offset + n]), len(view),
                                signing_key=self.signing_key, key=key, limits=self.limits)
            check_members(checked, None, self.limits.max_name)
            return checked

        return self._inspect(opened, name, keep_other=True)

    @staticmethod
    def _inspect(opened: Callable[[], CheckedPack], name: str,
                 keep_other: bool) -> tuple[BaseException | None, dict[str, Any] | None]:
        try:
            checked = opened()
            try:
                if checked.content_hash() != name:
                    return CorruptPackError(f"its content does not match its name {name}"), None
                return None, checked.header
            finally:
                checked.close()
        except (IncompatiblePackError, SignatureMismatchError) as exc:
            return (None if keep_other else exc), None
        except CorruptPackError as exc:  # a content check (checksum, signature, member, name)
            return exc, None

    def usable(self, pack: PackInfo) -> bool:
        """Whether this reader accepts ``pack`` by its signer (from the header only): with a
        signing key only packs signed with it, without one every pack."""
        if self.signing_key is None:
            return True
        return pack.signed and pack.signer in (None, self.signer)

    def ours(self, pack: PackInfo) -> bool:
        """Whether maintenance may rewrite ``pack``: one it verifies with its own key (with a
        key), or an unsigned one (without). Other signers' packs are kept as they are: a keyless
        ``prune`` must not merge signed packs into an unsigned one that no keyed reader loads."""
        return self.usable(pack) if self.signing_key is not None else not pack.signed

    def accepts_prefix(self, prefix: bytes) -> bool:
        """Whether a pack's first bytes carry a signature this reader accepts."""
        return prefix_accepts(prefix, self.signing_key)

    def limit_problem(self, members: Mapping[str, bytes | bytearray | memoryview]) -> str | None:
        """Why a pack of ``members`` would break the limits readers check, or None."""
        limits = self.limits
        size = sum(len(data) for data in members.values()) + 64 * len(members) + 4096  # + header
        longest = max((len(name) for name in members), default=0)
        problem = limits.problem(size, len(members), longest)
        if problem is not None:
            return problem
        for name in members:
            problem = name_problem(name, max_name=limits.max_name)
            if problem is not None:
                return problem
        return None


def check_members(checked: CheckedPack, labels: Any = None, max_name: int | None = None) -> None:
    """Raise :class:`BadMemberError` for the first member of ``checked`` that must not reach
    torch (:func:`~compile_cache.store.members.member_problem`); ``labels``: the first parts a
    member name may have (None: any)."""
    for name in checked.entries:
        problem = member_problem(
            name, checked.member_size(name),
            lambda offset, n, _name=name: checked.read_member_at(_name, offset, n),
            checked.member_info(name), labels=labels, max_name=max_name,
        )
        if problem is not None:
            raise BadMemberError(problem)
