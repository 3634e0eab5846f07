"""The collaborators of a local store, as its operation modules take them (:class:`StoreParts`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checker import PackChecker
from .counters import Counters
from .fs import StoreFS
from .keeper import Keeper
from .layout import Layout

__all__ = ["StoreParts"]


@dataclass(frozen=True)
class StoreParts:
    """A store's file layer (``fs``), paths (``layout``), ``counters``, pack checks (``checker``)
    and entry upkeep (``keeper``): what loading, publishing, maintenance and archives work with."""

    fs: StoreFS
    layout: Layout
    counters: Counters
    checker: PackChecker
    keeper: Keeper

    @classmethod
    def build(cls, fs: StoreFS, checker: PackChecker) -> StoreParts:
        """The parts of the store whose files are ``fs``, checking packs with ``checker``."""
        layout = Layout(fs.root, fs)
        counters = Counters(fs, layout)
        return cls(fs, layout, counters, checker, Keeper(fs, layout, counters))

    @property
    def root(self) -> Path:
        """The store's root directory."""
        return self.fs.root
