"""Forked worker processes for stg's parallel loops: writing a set's ranks, counting its rank
classes, evaluating an exploration's plans.

Not multiprocessing.Pool: its workers share one task queue behind a lock, and an idle worker
waits for work holding it. SIGTERM to the process group (a job scheduler's stop, `kill -- -PGID`)
ends such a worker while it holds the lock, and Pool.terminate then waits for that lock for
ever (seen once in CI: `stg generate` hung instead of exiting 143). Here each worker has its own
pipe: the parent hands out one item at a time, sees a worker that died (its pipe closes), and
ends the others with SIGKILL, which nothing they hold can delay.
"""

from __future__ import annotations

import signal
import time
from typing import Any, Callable, Iterator, Sequence

from stg.errors import StgError

_STOPS = {signal.SIGINT, signal.SIGTERM}


class WorkerError(StgError):
    """A worker process ended without finishing its item (killed, out of memory)."""


def forked_map(function: Callable[[Any], Any], items: Sequence, workers: int) -> Iterator[tuple[int, Any]]:
    """(index, function(items[index])) for every item, in the order they finish, computed in
    `workers` forked processes (in this one when there is one worker or one item). An
    exception in a worker is raised here; closing the iterator early ends the workers."""
    if workers < 2 or len(items) < 2:
        for index, item in enumerate(items):
            yield index, function(item)
        return
    from multiprocessing import get_context
    from multiprocessing.connection import wait

    context = get_context("fork")
    processes = {}  # the parent's end of each worker's pipe -> the worker
    try:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)  # until each worker has its handlers
        try:
            for _ in range(min(workers, len(items))):
                ours, theirs = context.Pipe()
                process = context.Process(target=_serve, args=(function, items, theirs), daemon=True)
                process.start()
                theirs.close()
                processes[ours] = process
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a pending signal reaches the parent now
        waiting = iter(range(len(items)))

        def hand(pipe) -> bool:
            """Send the worker at `pipe` its next item's index; False (and the worker told to
            stop) when there is none."""
            index = next(waiting, None)
            try:
                pipe.send(index)
            except ConnectionError:
                _died(processes[pipe])
            return index is not None

        busy = [pipe for pipe in processes if hand(pipe)]
        while busy:
            for pipe in wait(busy):
                try:
                    index, failed, value = pipe.recv()
                except (EOFError, ConnectionError):  # closed, or reset: it died with our index unread
                    _died(processes[pipe])
                if failed:
                    raise value
                if not hand(pipe):
                    busy.remove(pipe)
                yield index, value
    finally:
        for pipe, process in processes.items():
            if process.exitcode is None:
                process.kill()
            process.join()
            pipe.close()


def _serve(function: Callable, items: Sequence, pipe) -> None:
    """A worker: SIGINT (Ctrl-C reaches the whole group) is the parent's to report, SIGTERM ends
    the worker without a word; then items by index until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    try:
        while (index := pipe.recv()) is not None:
            try:
                reply = index, False, function(items[index])
            except Exception as error:
                reply = index, True, error
            pipe.send(reply)
    except (EOFError, ConnectionError):  # the parent has gone
        pass


def _died(process) -> None:
    """A worker's pipe closed before it answered: say why. When a stop signal ended it, the
    same signal was most likely sent to this process too (to the whole group); its handler
    gets a moment to act (raising out of the sleep) before this reports the death itself."""
    process.join()
    code = process.exitcode  # set once joined: negative for a signal's number
    if -code in _STOPS:
        time.sleep(1)
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
    hint = " (out of memory? try fewer workers)" if code == -signal.SIGKILL else ""
    raise WorkerError(f"a worker process {how} before finishing its part{hint}")
