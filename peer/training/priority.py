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

__all__ = ["TRAINING_NICE", "lower_this_thread"]

log = logging.getLogger("shoal.peer.training.priority")

# Weight 110 against the loop's 1024 (nice 0): the loop gets ~90% of a shared core.
TRAINING_NICE = 10


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
