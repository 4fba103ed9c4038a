"""How busy the machine was with other work while we timed something.

The 1-minute load average lags: two busy jobs started a minute before a compile read about 2.0 on
2 cores, the same as our own two timing threads would, so a rule on it alone took that machine
for quiet. Here the CPU time all cores spent busy (/proc/stat, steal included) less this process's
own CPU time, over the timing's wall time, gives the cores other work held while we measured.
Where /proc/stat does not exist the readings are None and callers fall back to the load average.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple, Optional

# Ticks per second of /proc/stat's counters.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


class CpuMark(NamedTuple):
    """A point in time: every core's busy seconds so far, this process's CPU seconds, wall seconds."""

    busy_s: float
    own_s: float
    wall_s: float


def busy_seconds(stat_line: str) -> float:
    """Busy seconds of all cores from /proc/stat's first ("cpu") line: everything but idle and iowait."""
    fields = [int(x) for x in stat_line.split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(fields) - fields[3] - fields[4]) / _TICKS


def cpu_mark() -> Optional[CpuMark]:
    """Now, as a CpuMark; None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            line = f.readline()
        busy = busy_seconds(line)
    except (OSError, ValueError, IndexError):
        return None
    return CpuMark(busy, time.process_time(), time.perf_counter())


def others_cores(start: Optional[CpuMark], end: Optional[CpuMark]) -> Optional[float]:
    """Cores that other processes (and the hypervisor's steal) kept busy between two marks."""
    if start is None or end is None or end.wall_s <= start.wall_s:
        return None
    return max(0.0, ((end.busy_s - start.busy_s) - (end.own_s - start.own_s)) / (end.wall_s - start.wall_s))


def others_since(mark: Optional[CpuMark]) -> Optional[float]:
    """Cores other work held from mark until now (None: unknown)."""
    return others_cores(mark, cpu_mark())
