"""Progress off a terminal (attnopt.progress): rate-limited plain lines on stderr, a ticker for held-back
news and a heartbeat for a long step; and the CLI module imports neither torch nor transformers."""

import io
import subprocess
import sys
import time

import pytest

from attnopt import progress
from attnopt.progress import LinePrinter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _printer(**kwargs):
    clock, out = Clock(), io.StringIO()
    return LinePrinter("attnopt compile", "compiling m with linear", stream=out, interval=2.0, heartbeat=30.0,
                       clock=clock, **kwargs), clock, out


def test_lines_are_rate_limited_newest_first_with_a_heartbeat():
    p, clock, out = _printer()
    p.update("capture + detect")  # the first update prints at once
    clock.now += 0.5
    p.update("record")  # held back: within 2 s of the last line
    p.update("verifying site s0", 0, 3)  # the newest replaces it
    clock.now += 1.4
    p.poll()
    assert out.getvalue().splitlines() == ["attnopt compile: [0:00] compiling m with linear: capture + detect"]
    clock.now += 0.1  # 2.0 s after the first line: the held-back news, as it is now
    p.poll()
    clock.now += 10
    p.poll()  # nothing new: nothing printed
    clock.now += 20  # 30 s without news: the same step again, with its elapsed time
    p.poll()
    assert out.getvalue().splitlines()[1:] == [
        "attnopt compile: [0:02] compiling m with linear: verifying site s0 (0/3)",
        "attnopt compile: [0:32] compiling m with linear: verifying site s0 (0/3)"]


def test_a_fit_of_many_steps_prints_one_line_per_interval():
    p, clock, out = _printer()
    for step in range(200):  # a 200-step fit over 12.5 s, told at every step
        p.update("fitting site s0 (gla)", step, 200)
        clock.now += 1 / 16
    lines = out.getvalue().splitlines()
    assert [line.split("] ")[0] for line in lines] == [f"attnopt compile: [0:{s:02d}" for s in range(0, 13, 2)]
    assert [line.rsplit("(", 1)[1] for line in lines] == [f"{32 * i}/200)" for i in range(7)]


def test_off_a_terminal_a_step_prints_its_title_then_its_news_from_the_ticker(monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.05)
    monkeypatch.setattr(progress, "TICK_S", 0.01)
    with progress.step_bar("loading m", "attnopt demo") as update:  # capsys: stderr is not a terminal
        update("weights", 1, 2)  # held back, then printed by the ticker without another update
        deadline = time.monotonic() + 10
        seen = ""
        while "weights" not in seen and time.monotonic() < deadline:
            time.sleep(0.02)
            seen += capsys.readouterr().err
    assert seen.splitlines() == ["attnopt demo: [0:00] loading m", "attnopt demo: [0:00] loading m: weights (1/2)"]
    with progress.step_bar("loading m", "attnopt demo", quiet=True) as update:
        update("weights")
    assert capsys.readouterr().err == ""


def test_importing_the_cli_and_its_help_import_neither_torch_nor_transformers():
    code = ("import sys\n"
            "import attnopt.cli\n"
            "from attnopt.cli import main\n"
            "assert main(['compile', '--help']) == 0 and main(['--help']) == 0 and main(['eval', '--help']) == 0\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_cli_preset_list_is_the_forms_registry():
    from attnopt import forms
    from attnopt.cli import POLICY_PRESETS

    registry = [p for f in forms.registry().values() for p in f.presets] + ["hybrid", "auto"]
    assert list(POLICY_PRESETS) == registry, "update attnopt.cli.POLICY_PRESETS to the forms registry's presets"


def test_the_clock_of_every_step_counts_from_the_commands_start(capsys):
    start = time.monotonic() - 75  # the command started 75 s ago
    with progress.step_bar("timing", "attnopt demo", start=start):
        pass
    assert capsys.readouterr().err == "attnopt demo: [1:15] timing\n"
