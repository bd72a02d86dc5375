"""stg.workers.forked_map: the forked loop under set writing, class counting and exploration.
What matters beyond the results: a worker that dies never leaves the parent waiting (the hang
multiprocessing.Pool has when a group SIGTERM ends a worker holding its queue's lock), and no
worker outlives the loop."""

import multiprocessing
import os
import signal
import threading
import time
from contextlib import closing

import pytest

from stg.workers import WorkerError, forked_map


def _square(x):
    return x * x


def _pid(_):
    time.sleep(0.05)  # long enough that every worker takes a share
    return os.getpid()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_item_once_with_its_index(workers):
    items = list(range(17))
    got = sorted(forked_map(_square, items, workers))
    assert got == [(i, i * i) for i in items]
    assert multiprocessing.active_children() == []


def test_the_work_is_shared_and_done_outside_this_process():
    pids = {pid for _, pid in forked_map(_pid, range(12), 3)}
    assert os.getpid() not in pids and len(pids) == 3


def _fails_on_five(x):
    if x == 5:
        raise OSError(28, "No space left on device")
    return x


def test_a_workers_exception_is_raised_here_as_itself():
    with pytest.raises(OSError) as caught:
        list(forked_map(_fails_on_five, range(10), 2))
    assert caught.value.errno == 28 and caught.value.strerror == "No space left on device"
    assert multiprocessing.active_children() == []


def _killed_on_three(x, sig=signal.SIGKILL):
    if x == 3:
        os.kill(os.getpid(), sig)
        time.sleep(5)
    return x


def _terminated_on_three(x):
    return _killed_on_three(x, signal.SIGTERM)


def test_a_killed_worker_is_an_error_not_a_hang():
    started = time.monotonic()
    with pytest.raises(WorkerError, match="killed by SIGKILL .*out of memory"):
        list(forked_map(_killed_on_three, range(10), 2))
    assert time.monotonic() - started < 20 and multiprocessing.active_children() == []


def test_a_worker_ended_by_sigterm_alone_is_reported_after_a_moment():
    """SIGTERM to a worker usually came to the whole group, so the parent waits a moment for its
    own; when none comes (only the worker was signalled) the death is reported."""
    started = time.monotonic()
    with pytest.raises(WorkerError, match="killed by SIGTERM"):
        list(forked_map(_terminated_on_three, range(10), 2))
    assert 1 <= time.monotonic() - started < 20 and multiprocessing.active_children() == []


def _slow_pid(_):
    time.sleep(0.2)
    return os.getpid()


def test_leaving_the_loop_early_ends_the_workers():
    started = time.monotonic()
    with closing(forked_map(_slow_pid, range(100), 2)) as results:
        next(results)
    assert multiprocessing.active_children() == [] and time.monotonic() - started < 5


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_to_the_whole_group_ends_the_parent_as_its_signal():
    """The CI hang's shape: SIGTERM reaches the workers and the parent at once (here sent to each,
    the test's own process group being pytest's), the parent seeing its workers die first. The
    parent, with a handler that raises as the CLI's does, stops with its own signal, not a
    worker error, and leaves no worker behind."""
    class Stopped(BaseException):
        pass

    def stop(number, _frame):
        raise Stopped(number)

    previous = signal.signal(signal.SIGTERM, stop)
    results = forked_map(_slow_pid, range(100), 2)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        workers = set()
        while len(workers) < 2:  # each worker is handed an item at once
            workers.add(next(results)[1])
        with pytest.raises(Stopped):
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
            timer.start()  # the parent's own signal, after it has seen the workers die
            for _ in results:
                pass
    finally:
        timer.cancel()
        if timer.ident is not None:  # started: its signal is sent or never will be
            timer.join()
        results.close()
        signal.signal(signal.SIGTERM, previous)
    assert all(_gone(pid) for pid in workers)
