"""compile_cache.publisher: publishing off the step, and an exit that publishes but never hangs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from compile_cache.publisher import Publisher


def test_jobs_run_in_order_off_the_callers_thread() -> None:
    pub = Publisher(register_atexit=False)
    ran: list[tuple[int, str]] = []
    for i in range(3):
        pub.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
    assert pub.drain(10)
    assert [i for i, _ in ran] == [0, 1, 2]
    assert {name for _, name in ran} == {"compile_cache-publish"}


def test_a_key_still_waiting_is_not_queued_twice() -> None:
    pub = Publisher(register_atexit=False)
    gate = threading.Event()
    pub.submit(gate.wait)  # holds the thread so the next ones wait in the queue
    ran: list[str] = []
    assert pub.submit(lambda: ran.append("a"), key="model")
    assert not pub.submit(lambda: ran.append("b"), key="model")  # one publish for a burst
    gate.set()
    assert pub.drain(10)
    assert ran == ["a"]
    assert pub.submit(lambda: ran.append("c"), key="model")  # ran: it may be queued again
    assert pub.drain(10) and ran == ["a", "c"]


def test_a_failing_job_is_recorded_and_the_next_one_runs() -> None:
    pub = Publisher(register_atexit=False)
    ran: list[int] = []
    pub.submit(lambda: 1 / 0)
    pub.submit(lambda: ran.append(1))
    assert pub.drain(10)
    assert ran == [1] and pub.errors and "ZeroDivisionError" in pub.errors[0]


def test_drain_gives_up_after_its_timeout() -> None:
    pub = Publisher(register_atexit=False)
    gate = threading.Event()
    pub.submit(gate.wait)
    assert pub.drain(0.2) is False
    gate.set()
    assert pub.drain(10)


def _exit_run(job_seconds: float, budget: float) -> tuple[subprocess.CompletedProcess[str], float]:
    code = textwrap.dedent(f"""
        import logging, time
        from compile_cache import publisher
        logging.basicConfig()
        publisher.EXIT_TIMEOUT_S = {budget}
        pub = publisher.get()
        pub.exit_timeout = {budget}
        def hook():
            pub.submit(lambda: (time.sleep({job_seconds}), print("published", flush=True)))
        pub.at_exit(hook)
        print("exiting", flush=True)
    """)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    return done, time.perf_counter() - start


def test_exit_publishes_what_is_left() -> None:
    done, _ = _exit_run(job_seconds=0.5, budget=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exiting", "published"]


def test_a_stuck_publish_never_hangs_the_exit() -> None:
    done, _ = _exit_run(job_seconds=60, budget=1)
    assert done.returncode == 0, done.stderr
    assert "published" not in done.stdout  # the exit did not wait for the 60 s job
    assert "did not finish within 1 s" in done.stderr


def test_a_forked_child_gets_a_working_publisher_while_the_parents_is_busy() -> None:
    """A DataLoader worker or a multiprocessing fork inherits the parent's publisher without its
    thread (and its locks as they were): the child's publishes and counters still go out."""
    import multiprocessing

    from compile_cache import publisher

    release = threading.Event()
    parent = publisher.get()
    parent.submit(release.wait)  # the parent's thread is busy while the child forks
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()

    def child() -> None:
        ran: list[int] = []
        mine = publisher.get()
        mine.submit(lambda: ran.append(1))
        out.put((mine is not parent, mine.drain(5.0), ran))

    proc = ctx.Process(target=child)
    proc.start()
    try:
        fresh, drained, ran = out.get(timeout=30)
    finally:
        release.set()
        proc.join(10)
    assert fresh and drained and ran == [1]
    assert parent.drain(10.0)


def test_sigterm_drains_the_publisher_within_its_bound_then_terminates(tmp_path) -> None:
    """issue 31.11: SIGTERM (SLURM, Kubernetes) during a background publish used to lose the
    pack; now the queue drains (at most EXIT_TIMEOUT_S) and the process still dies of SIGTERM."""
    import signal

    done = tmp_path / "published"
    code = textwrap.dedent(f"""
        import os, signal, time
        from compile_cache import publisher
        p = publisher.get()
        def slow_publish():
            time.sleep(1.0)
            open({str(done)!r}, "w").write("pack")
        p.submit(slow_publish)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert done.read_text() == "pack"
    assert time.monotonic() - start < 15
