"""One current result file per benchmark and machine: `benchmarks/results/<benchmark>/<machine>.json`.

Every benchmark writes through `write_result`, which wraps its payload with what makes a number
readable later: the command line, the commit (and whether the tree had uncommitted changes), the date,
and a measured machine fingerprint (a Python loop's time, one small torch op's latency, an sgemm
rate), the figures that tell two VMs of the same name apart. A new run replaces the file; git keeps the
old ones.

    from resultfile import write_result           # benchmarks/ is on sys.path when run as a script
    path = write_result("decode_cpu", payload)     # -> benchmarks/results/decode_cpu/amd-epyc-2c.json
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo (or platform) gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_name() -> str:
    """A stable file name for this machine type: `$ATTNOPT_MACHINE`, else the CPU model and core count
    (`amd-epyc-2c`), or the GPU's name when torch sees one (`nvidia-h200`)."""
    if os.environ.get("ATTNOPT_MACHINE"):
        return os.environ["ATTNOPT_MACHINE"]
    try:
        import torch

        if torch.cuda.is_available():
            return _slug(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    return f"{_slug(cpu_model())}-{os.cpu_count()}c"


def _slug(text: str) -> str:
    text = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "machine"


def fingerprint(repeats: int = 5) -> dict[str, Any]:
    """Measured figures of this machine (best of `repeats`): what a result's speed depends on."""
    loop = min(_time(lambda: sum(range(200_000))) for _ in range(repeats)) / 200_000 * 1e9
    out: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "python_loop_ns_per_iter": round(loop, 2),
    }
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = torch.__version__
    out["torch_threads"] = torch.get_num_threads()
    one = torch.ones(1)
    small = min(_time(lambda: [torch.add(one, one) for _ in range(1000)]) for _ in range(repeats)) / 1000 * 1e6
    out["small_op_us"] = round(small, 3)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(a, b)
    mm = min(_time(lambda: [torch.mm(a, b) for _ in range(10)]) for _ in range(repeats)) / 10
    out["sgemm_512_gflops"] = round(2 * 512 ** 3 / mm / 1e9, 2)
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def commit() -> dict[str, Any]:
    """The checked-out commit and whether tracked files differ from it; `$ATTNOPT_COMMIT` where the
    copy has no git history (a device machine's copy of the work tree)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", None
    if not head:
        return {"commit": os.environ.get("ATTNOPT_COMMIT") or None, "dirty": None}
    return {"commit": head, "dirty": dirty}


def result_path(benchmark: str, machine: Optional[str] = None) -> Path:
    return RESULTS / benchmark / f"{machine or machine_name()}.json"


def write_result(benchmark: str, payload: dict, *, argv: Optional[list[str]] = None,
                 machine: Optional[str] = None, path: Optional[Path] = None, launcher: str = "python") -> Path:
    """Write `payload` under `meta` (command, commit, date, machine, fingerprint) to the benchmark's
    current file for this machine, replacing the previous run's; returns the path. `launcher` is what
    ran the script (e.g. "torchrun --nproc_per_node=2")."""
    argv = sys.argv if argv is None else argv
    meta = {
        "benchmark": benchmark,
        "command": launcher + " " + " ".join(shlex.quote(a) for a in [_relative(argv[0]), *argv[1:]]),
        **commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine or machine_name(),
        "fingerprint": fingerprint(),
    }
    path = Path(path) if path is not None else result_path(benchmark, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1, default=_jsonable) + "\n")
    return path


def adopt_result(benchmark: str, payload: dict, *, command: str, commit: str, date: str, machine: str,
                 source: str) -> Path:
    """Move a result measured before this module existed into the layout, saying what is known of it.

    `command` is rebuilt from the settings the old file records, `commit` is the commit that added the
    old file (the run itself recorded neither), `date` is that commit's date; no fingerprint was
    measured, so none is invented."""
    meta = {
        "benchmark": benchmark,
        "command": command,
        "command_note": "rebuilt from the settings the result records; the run did not record its command line",
        "commit": commit,
        "commit_note": "the commit that added the result; the run did not record the commit it measured",
        "dirty": None,
        "date": date,
        "machine": machine,
        "fingerprint": None,
        "fingerprint_note": "not recorded (measured before benchmarks/resultfile.py existed)",
        "adopted_from": source,
    }
    path = result_path(benchmark, machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1, default=_jsonable) + "\n")
    return path


def read_result(benchmark: str, machine: Optional[str] = None) -> dict:
    return json.loads(result_path(benchmark, machine).read_text())


def current_results() -> dict[str, dict[str, dict]]:
    """{benchmark: {machine: result}} of every file in the layout (a folder per benchmark)."""
    found: dict[str, dict[str, dict]] = {}
    for path in sorted(RESULTS.glob("*/*.json")):
        found.setdefault(path.parent.name, {})[path.stem] = json.loads(path.read_text())
    return found


def _relative(script: str) -> str:
    try:
        return str(Path(script).resolve().relative_to(ROOT))
    except ValueError:
        return script


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
