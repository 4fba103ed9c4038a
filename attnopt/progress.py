"""Progress on stderr for the command line and the demo: a rich bar or spinner on a terminal, plain
lines when stderr is a file or a pipe (a log of a long run still says what it is doing), nothing
when quiet.

Plain lines look like "attnopt compile: [0:42] compiling m with linear: verifying site s3 (3/12)"
and are rate-limited: the first update prints at once, later ones at most one line every
LINE_INTERVAL_S (the newest text wins), and a step that goes HEARTBEAT_S without news is printed
again with its elapsed time. A ticker thread prints a held-back update when its turn comes, so a
step that starts just after another and then runs for minutes is still shown.

Nothing here imports torch: the CLI imports this module, and `attnopt --help` stays fast.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, Optional

LINE_INTERVAL_S = 2.0
HEARTBEAT_S = 30.0
TICK_S = 0.5

Update = Callable[..., None]  # update(text, done=None, total=None)


def no_update(text: str = "", done: Optional[int] = None, total: Optional[int] = None) -> None:
    pass


class LinePrinter:
    """update(text, done, total) as rate-limited plain lines "<prefix>: [m:ss] <title>: <text> (done/total)".

    m:ss counts from `start` (the command's start, on `clock`; default: now). stream: where lines go
    (default: sys.stderr at the time of printing); clock: monotonic seconds (tests inject one and
    call `poll()` themselves instead of running the ticker)."""

    def __init__(self, prefix: str, title: str = "", stream=None, interval: Optional[float] = None,
                 heartbeat: Optional[float] = None, clock: Callable[[], float] = time.monotonic,
                 start: Optional[float] = None):
        self.prefix, self.title, self.stream, self.clock = prefix, title, stream, clock
        self.interval = LINE_INTERVAL_S if interval is None else interval
        self.heartbeat = HEARTBEAT_S if heartbeat is None else heartbeat
        self._lock = threading.Lock()
        self._start = clock() if start is None else start
        self._state: Optional[tuple] = None  # the newest (text, done, total)
        self._shown: Optional[tuple] = None  # the last printed
        self._last: Optional[float] = None  # when the last line was printed

    def update(self, text: str = "", done: Optional[int] = None, total: Optional[int] = None) -> None:
        with self._lock:
            self._state = (text, done, total)
            self._print_due()

    def poll(self) -> None:
        """Print a held-back update whose turn has come, or the heartbeat (the ticker calls this)."""
        with self._lock:
            self._print_due()

    def _print_due(self) -> None:
        if self._state is None:
            return
        now = self.clock()
        since = None if self._last is None else now - self._last
        if since is None or (self._state != self._shown and since >= self.interval) or since >= self.heartbeat:
            print(self.line(self._state, now), file=self.stream or sys.stderr, flush=True)
            self._shown, self._last = self._state, now

    def line(self, state: tuple, now: float) -> str:
        text, done, total = state
        minutes, seconds = divmod(int(now - self._start), 60)
        what = ": ".join(t for t in (self.title, text) if t)
        count = f" ({done}/{total})" if total else ""
        return f"{self.prefix}: [{minutes}:{seconds:02d}] {what}{count}"


@contextlib.contextmanager
def ticking(printer: LinePrinter, tick: Optional[float] = None) -> Iterator[Update]:
    """Yield printer.update while a daemon thread polls it every `tick` seconds (default TICK_S)."""
    tick = TICK_S if tick is None else tick
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(tick):
            printer.poll()

    thread = threading.Thread(target=loop, name="attnopt-progress", daemon=True)
    thread.start()
    try:
        yield printer.update
    finally:
        stop.set()
        thread.join()


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


@contextlib.contextmanager
def step_bar(title: str, prefix: str = "attnopt", quiet: bool = False, start: Optional[float] = None
             ) -> Iterator[Update]:
    """A job of named steps (compile: capture, record, one tick per site verified or fit step, dispatch
    timings; bench: one tick per forward). Yields update(text, done, total): a rich bar on a
    terminal, plain lines "<prefix>: [m:ss] <title>: <text> (done/total)" otherwise (the title
    alone first; m:ss from `start`, time.monotonic() of the command's start), nothing when quiet."""
    if quiet:
        yield no_update
        return
    console = _stderr_console()
    if not console.is_terminal:
        with ticking(LinePrinter(prefix, title, start=start)) as update:
            update()  # the step's title at once; its first news follows within LINE_INTERVAL_S
            yield update
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(title, total=None)

        def update(text: str = "", done: Optional[int] = None, total: Optional[int] = None) -> None:
            # A step without a count shows a pulsing bar; verification and timings count up.
            bar.update(task, description=f"{title}: {text}" if text else title, completed=done or 0, total=total,
                       refresh=True)

        yield update


@contextlib.contextmanager
def spinner(message: str, prefix: str = "attnopt", quiet: bool = False, start: Optional[float] = None
            ) -> Iterator[Update]:
    """One slow step (loading a model, a capture): a rich spinner on a terminal, a plain line (again
    every HEARTBEAT_S while it runs) otherwise, nothing when quiet. Yields update(text, done, total)
    for the step's own news."""
    if quiet:
        yield no_update
        return
    console = _stderr_console()
    if not console.is_terminal:
        with step_bar(message, prefix, start=start) as update:
            yield update
        return
    with console.status(message) as status:
        def update(text: str = "", done: Optional[int] = None, total: Optional[int] = None) -> None:
            count = f" ({done}/{total})" if total else ""
            status.update(f"{message}: {text}{count}" if text else message)

        yield update
