"""A wall clock off by SHOAL_SOAK_CLOCK_OFFSET_S seconds, for one soak peer only.

bench/soak.py puts this directory on the PYTHONPATH of a peer it starts with a
wrong clock (a machine without NTP): Python imports it at start-up, before
shoal, and every `time.time()` / `time.time_ns()` of the process is moved. The
monotonic clock (timeouts, the event loop) stays right, as it does on a machine
whose wall clock is wrong.
"""

import os
import time

_offset = float(os.environ.get("SHOAL_SOAK_CLOCK_OFFSET_S", "0") or 0)
if _offset:
    _real_time, _real_time_ns = time.time, time.time_ns
    time.time = lambda: _real_time() + _offset
    time.time_ns = lambda: _real_time_ns() + int(_offset * 1e9)
