"""Training runs at a lower CPU priority than the event loop.

The event loop carries everything other peers wait on (heartbeats, DHT
answers, the all-reduce's records, `/status`); the inner steps are throughput
work that can wait a few milliseconds. On a machine with fewer cores than busy
threads, the kernel shares the CPU by weight: at the same priority a training
thread preempts the loop in the middle of a round (measured: event-loop lag
p99 21-25 ms with 4 peers training a 50M model on 2 cores, bench/allreduce.py).
Volunteer-computing clients (BOINC, Folding@home) run their work at a low
priority for the same reason, and so that the owner's own programs come first.

On Linux a thread's nice value is its own (threads are tasks) and threads it
starts inherit it (torch's intra-op pool, when started by the training
thread). Elsewhere this is a no-op.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["HELPER_NICE", "TRAINING_NICE", "helper_executor", "lower_this_thread"]

log = logging.getLogger("shoal.peer.training.priority")

# Weight 110 against the loop's 1024 (nice 0): the loop gets ~90% of a shared core.
TRAINING_NICE = 10
# The loop's helper threads (its default executor: a round's reductions and hashes,
# reads and writes of states) sit between the two: other peers wait on their work too,
# but not as on the loop's, which answers heartbeats and deadlines (weight 335).
HELPER_NICE = 5


def helper_executor(nice: int = HELPER_NICE) -> ThreadPoolExecutor:
    """An executor for the event loop's default (`loop.set_default_executor`) whose
    threads run `nice` below the loop. For a process that is only the peer: a library
    user's loop and its executor are theirs."""
    return ThreadPoolExecutor(
        thread_name_prefix="shoal-helper", initializer=lower_this_thread, initargs=(nice,)
    )


def lower_this_thread(nice: int = TRAINING_NICE) -> bool:
    """Raise the calling thread's nice value by `nice` (capped at 19); True when
    it changed. Never raises: a priority is a preference, not a requirement."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        target = min(19, current + nice)
        if target == current:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError as e:  # a sandbox without the syscall, say
        log.debug("could not lower the training thread's priority: %r", e)
        return False
    return True
