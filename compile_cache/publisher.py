"""Publishing off the training step: one daemon thread that runs publish jobs in order.

A compile ends inside torch (a Dynamo frame compile, or a lazily compiled backward in the middle
of ``loss.backward()``); writing a pack there would hold up the step. :meth:`Publisher.submit`
queues the job instead and returns at once; the thread runs it. A job submitted under a ``key``
that is still waiting in the queue is not queued twice (a burst of compiles of one model makes
one publish).

At interpreter exit (``atexit``), the exit hooks run first (a session queues whatever it has not
published yet, so a job that runs one step and exits still leaves its backward in the store),
then the exit waits at most :data:`EXIT_TIMEOUT_S` for the queue to empty: a stuck store never
hangs the exit, and no thread is started at exit (Python 3.12 refuses that). A publish cut short
leaves no partial pack, only a temp file that ``verify --fix`` sweeps. ``atexit`` handlers run
in reverse order of registration, so this one, registered when the first publish is due, after
torch imported its compile workers, runs before torch shuts them down.

:func:`get` returns the process's publisher (created on first use).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable

__all__ = ["EXIT_TIMEOUT_S", "Publisher", "get"]

log = logging.getLogger("compile_cache")

#: Seconds the interpreter's exit waits for publishes still queued.
EXIT_TIMEOUT_S = 10.0


class Publisher:
    """Runs submitted jobs on one daemon thread, in order; see the module docstring."""

    def __init__(self, exit_timeout: float = EXIT_TIMEOUT_S, *, register_atexit: bool = True) -> None:
        self.exit_timeout = exit_timeout
        self.errors: list[str] = []
        self._jobs: collections.deque[tuple[Hashable | None, Callable[[], None]]] = collections.deque()
        self._queued: set[Hashable] = set()
        self._busy = False
        self._cond = threading.Condition()
        self._exit_hooks: list[Callable[[], None]] = []
        self._pid = os.getpid()  # a forked child has no thread: it gets a publisher of its own
        self._thread = threading.Thread(target=self._run, name="compile_cache-publish", daemon=True)
        self._thread.start()
        if register_atexit:
            atexit.register(self.run_at_exit)

    def submit(self, job: Callable[[], None], key: Hashable | None = None) -> bool:
        """Queue ``job``; False when a job with the same ``key`` is already waiting."""
        with self._cond:
            if key is not None:
                if key in self._queued:
                    return False
                self._queued.add(key)
            self._jobs.append((key, job))
            self._cond.notify_all()
        return True

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued job ran; True if that happened within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def pending(self) -> int:
        """How many jobs are queued or running now (0: the publisher is idle)."""
        with self._cond:
            return len(self._jobs) + (1 if self._busy else 0)

    def at_exit(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` (quick: it should only submit) at interpreter exit, before the drain."""
        with self._cond:
            if hook not in self._exit_hooks:
                self._exit_hooks.append(hook)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                key, job = self._jobs.popleft()
                self._queued.discard(key)
                self._busy = True
            try:
                job()
            except Exception as exc:  # a failed publish is the job's to report; keep going
                self.errors.append(f"{type(exc).__name__}: {exc}")
                log.warning("compile_cache: a background publish failed: %s", exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def in_this_process(self) -> bool:
        """Whether this publisher was made in this process (a forked child inherits its parent's
        publisher without the thread)."""
        return self._pid == os.getpid()

    def run_at_exit(self) -> None:
        """The exit's publish: the :meth:`at_exit` hooks, then a drain of at most
        ``exit_timeout`` seconds (atexit, and SIGTERM where nobody else handles it)."""
        if not self.in_this_process():
            return  # the parent's publisher, inherited by a forked child: its thread is not here
        for hook in list(self._exit_hooks):
            try:
                hook()
            except Exception as exc:
                log.warning("compile_cache: exit publish hook failed: %s", exc)
        if not self.drain(self.exit_timeout):
            log.warning("compile_cache: publishing at exit did not finish within %.0f s; what "
                        "was not written is compiled again next time", self.exit_timeout)


_default: Publisher | None = None
_default_lock = threading.Lock()


def get() -> Publisher:
    """This process's publisher (its thread starts on first use; after a fork, a new one)."""
    global _default
    with _default_lock:
        if _default is None or not _default.in_this_process():
            _default = Publisher()
            _drain_on_sigterm()
        return _default


def _drain_on_sigterm() -> None:
    """SIGTERM (how SLURM and Kubernetes stop a job) kills a process without its ``atexit``
    handlers: where nobody else handles it (its handler is the default), handle it by running
    the exit's publish (hooks, then a drain of at most :data:`EXIT_TIMEOUT_S`), then die of it
    as before. Only from the main thread (the only one that may set a handler)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the job's own handler (or torchrun's) decides
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        return


def _on_sigterm(signum: int, frame: object) -> None:
    import signal

    publisher = _default
    if publisher is not None:
        publisher.run_at_exit()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the exit status says "terminated", as without us


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, multiprocessing's fork) inherits the parent's
    publisher without its thread, and its locks as they were at the fork: start afresh."""
    global _default, _default_lock
    _default_lock = threading.Lock()
    _default = None


os.register_at_fork(after_in_child=_after_fork_in_child)
