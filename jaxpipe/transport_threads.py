"""Keep gloo's event-loop threads from taking a core away from the computation.

On CPU, a multi-process pipeline moves its messages with gloo. Each process's gloo TCP
device runs an event-loop thread, and that thread keeps polling ``epoll`` while the
process computes: on a core shared with the compute thread it takes a share of every
tick's compute time. Measured with ``benchmarks/probes/permute_cost.py`` (2 processes
pinned to one core each, 20 matmuls then a 128 KiB permute per tick): the permute costs
1.0-1.3 ms at normal priority, 0.125 ms when there is no compute to share the core with.

:func:`idle_transport_threads` gives those threads Linux's ``SCHED_IDLE`` policy: they
run whenever the core has nothing else to do (when the compute thread waits in a
collective, which is when they are needed) and never preempt computation. The threads
are found by what they are: the threads that appear while the CPU backend starts and
then wait in ``epoll_wait``. :func:`jaxpipe.distributed.initialize` calls it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["EPOLL_SYSCALLS", "idle_transport_threads", "thread_ids", "waiting_in_epoll"]

#: x86-64 and arm64 syscall numbers of ``epoll_wait``, ``epoll_pwait``, ``epoll_pwait2``
#: (as ``/proc/<pid>/task/<tid>/syscall`` reports them).
EPOLL_SYSCALLS = {"x86_64": {232, 281, 441}, "aarch64": {22, 441}}

_TASKS = Path("/proc/self/task")


def thread_ids() -> set[int]:
    """This process's thread ids (empty where ``/proc`` is not available)."""
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return set()


def waiting_in_epoll(tids: set[int], samples: int = 20, interval_s: float = 0.002,
                     patience_s: float = 1.0) -> set[int]:
    """Of ``tids``, the threads seen waiting in an ``epoll`` call in any of ``samples``
    looks (a polling thread may be between two calls at one look). Where none is seen
    in those, looking goes on for up to ``patience_s``: on a loaded machine a thread
    just started may not have reached its first wait yet."""
    epoll = EPOLL_SYSCALLS.get(os.uname().machine, set())
    found: set[int] = set()
    deadline = time.monotonic() + patience_s
    looks = 0
    while looks < samples or (not found and time.monotonic() < deadline):
        for tid in tids - found:
            try:
                call = (_TASKS / str(tid) / "syscall").read_text().split()
            except OSError:  # exited, or /proc forbids it
                continue
            if call and call[0].isdigit() and int(call[0]) in epoll:
                found.add(tid)
        looks += 1
        time.sleep(interval_s)
    return found


def idle_transport_threads(start_backend: Callable[[], bool]) -> list[int]:
    """Run ``start_backend`` and, where it returns ``True`` (it started the CPU backend,
    whose gloo device moves the messages), give the event-loop threads it started
    ``SCHED_IDLE``; returns their thread ids.

    Returns ``[]`` and changes nothing where the backend is another (a TPU or GPU host's
    threads are not gloo's) or the threads cannot be found or changed (not Linux, no
    ``/proc``, no permission): the pipeline then runs as JAX runs it.
    """
    before = thread_ids()
    if not start_backend() or not before or not hasattr(os, "SCHED_IDLE"):
        return []
    loops = sorted(waiting_in_epoll(thread_ids() - before))
    done = []
    for tid in loops:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            continue
        done.append(tid)
    return done
