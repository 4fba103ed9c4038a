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
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional

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


# How long ThreadBackoff first looks at the machine before any work has been measured.
FIRST_LOOK_S = 0.05


def threads_beside(others: Optional[float], wanted: int, cores: int) -> int:
    """Threads that fit beside other work holding `others` cores: the cores left (rounded), at least
    1 and at most `wanted`; `wanted` itself when the load is unknown.

    Why: an OpenMP region of many tiny ops ends at a barrier where every thread must arrive; with a
    core taken by another process, one of ours waits for a scheduler slice at each barrier. Two
    busy processes on 2 cores made a compile's fits take 10x the CPU time at 2 threads as at 1."""
    if others is None:
        return wanted
    return max(1, min(wanted, int(cores - others + 0.5)))


class ThreadBackoff:
    """torch's intra-op thread count for a sequence of pieces of small-op work (the compile-time
    fits, one site each): each piece runs at `threads_beside` the cores other work held during the
    previous piece (before the first, during a FIRST_LOOK_S look), then the count is restored."""

    def __init__(self):
        import torch

        self._torch = torch
        self.wanted = torch.get_num_threads()
        self.cores = os.cpu_count() or 1
        start = cpu_mark()
        if start is not None:
            time.sleep(FIRST_LOOK_S)
        self.others = others_since(start)
        self.used: list[int] = []  # threads of each piece, in order

    def run(self, piece):
        """`piece()` at the thread count the last reading allows; returns its result."""
        threads = threads_beside(self.others, self.wanted, self.cores)
        self.used.append(threads)
        start = cpu_mark()
        if threads != self.wanted:
            self._torch.set_num_threads(threads)
        try:
            return piece()
        finally:
            if threads != self.wanted:
                self._torch.set_num_threads(self.wanted)
            measured = others_since(start)
            self.others = measured if measured is not None else self.others


@contextmanager
def threads_for_load() -> Iterator[int]:
    """torch's intra-op threads for a whole job (a compile): `threads_beside` the cores other work held
    during a FIRST_LOOK_S look, restored after; yields the count. Pieces inside may back off further
    (ThreadBackoff); a machine without /proc/stat keeps torch's count."""
    import torch

    wanted = torch.get_num_threads()
    start = cpu_mark()
    if start is not None:
        time.sleep(FIRST_LOOK_S)
    threads = threads_beside(others_since(start), wanted, os.cpu_count() or 1)
    if threads != wanted:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads != wanted:
            torch.set_num_threads(wanted)
