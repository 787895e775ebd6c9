"""Work handed to a thread pool that still gets done while the interpreter exits.

A job that is never closed can have a checkpoint in flight when its main thread
returns. The interpreter then joins the pools' threads, so the write in flight goes on,
but from that moment `ThreadPoolExecutor.submit` refuses new work ("cannot schedule new
futures after interpreter shutdown") on every pool, old or new: a write that hands its
fsyncs, its epsilon or its retention to another pool would fail there and the version
be lost. These helpers run the work in the calling thread instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = ["run_all", "submit_or_run"]

T = TypeVar("T")


def submit_or_run(
    pool: concurrent.futures.Executor, fn: Callable[..., T], *args: Any
) -> concurrent.futures.Future[T]:
    """`pool.submit(fn, *args)`, or, where the pool refuses new work because the
    interpreter is exiting (or the pool was shut down), `fn(*args)` run now, its result
    or exception in the future returned."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # the caller's result() raises it, as a pool's would
            done.set_exception(exc)
        return done


_pools: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _shared_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of `workers` threads (a forked child makes its own: it has
    none of its parent's threads)."""
    key = (os.getpid(), workers)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"state-run{workers}"
            )
        return pool


def run_all(fn: Callable[[T], object], workers: int, *batches: Iterable[T]) -> None:
    """`fn(item)` for every item of each batch in turn, on up to `workers` threads of a
    pool kept for the process (in this thread where the interpreter is exiting). A batch
    is done whole before the next starts; the first failure of a batch is raised once the
    batch is done, and the later batches do not run. `fn` must not call `run_all` itself
    (it could wait for threads its caller holds).

    The pool is kept: a new one per call started up to `workers` threads at every
    commit (8 thread starts a version in the profile of a checkpoint every 10 steps)."""
    pool = _shared_pool(workers)
    for batch in batches:
        futures = [submit_or_run(pool, fn, item) for item in batch]
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()
