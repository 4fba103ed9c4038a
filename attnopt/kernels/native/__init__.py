"""The native (C) one-token steps: `token_step.c`, built once with the system C compiler and loaded
with ctypes.

A decoding step on a CPU is a handful of tiny ops, and each pays a fixed dispatch cost far above
its arithmetic; one C call does the whole step. Optional: without a compiler (or with
ATTNOPT_NATIVE=0) the steppers run their torch ops, which compute the same thing.
The library is cached under ~/.cache/attnopt/native (moved by $ATTNOPT_NATIVE_DIR), named by a hash
of the source, the compiler and the platform, so it is built once per machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).with_name("token_step.c")
ENV_SWITCH = "ATTNOPT_NATIVE"  # "0": never build or load it
ENV_DIR = "ATTNOPT_NATIVE_DIR"
NATIVE_DIR = Path("~/.cache/attnopt/native")
MAX_DIM = 1024  # ATTNOPT_MAX_DIM in token_step.c: the widest φ, Dv or ring the C steps take
# Reassociation lets the compiler vectorise the dot products (a sum in order waits on each add);
# no finite-math assumption, so inf and nan pass through as in torch.
CFLAGS = ("-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class PackedStep(ctypes.Structure):
    """token_step.c's PackedStep: the [S ‖ z] step's fixed arguments."""

    _fields_ = [("T", _P), ("gamma", _P), ("B", _I), ("H", _I), ("Hkv", _I), ("M", _I), ("Dv", _I),
                ("normalize", _I), ("guard_zero", _I), ("eps", _F), ("out_scale", _F)]


class RingStep(ctypes.Structure):
    """token_step.c's RingStep: the ring step's fixed arguments."""

    _fields_ = [("K", _P), ("V", _P), ("B", _I), ("H", _I), ("Hkv", _I), ("S", _I), ("D", _I), ("Dv", _I),
                ("scale", _F)]


_SIGNATURES = {  # (the address of the fixed arguments, q, k, v, out[, slot]): plain ints, the cheapest to pass
    "attnopt_packed_step": [_P, _P, _P, _P, _P],
    "attnopt_ring_step": [_P, _P, _P, _P, _P, _I],
}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, or None (switched off, no compiler, or the build failed: `why_not()` says)."""
    if not enabled():
        return None
    lib, _ = _load()
    return lib


def why_not() -> str:
    """Why `library()` is None ("" when it is loaded)."""
    if not enabled():
        return f"${ENV_SWITCH}=0"
    return _load()[1]


@functools.cache
def _load() -> tuple[Optional[ctypes.CDLL], str]:
    try:
        path = _built()
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return lib, ""
    except Exception as e:  # optional: the torch steps run instead
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _compiler() -> str:
    cc = os.environ.get("CC") or (sysconfig.get_config_var("CC") or "cc").split()[0]
    found = shutil.which(cc) or shutil.which("cc")
    if found is None:
        raise RuntimeError(f"no C compiler ({cc!r} or 'cc') on PATH")
    return found


def _built() -> Path:
    """The shared library for this source, compiler and platform, compiled on first use (written under
    a temporary name, then renamed, so concurrent processes never load a half-written file)."""
    cc = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cc, *CFLAGS, platform.platform(), platform.machine())).encode())
    folder = Path(os.environ.get(ENV_DIR) or NATIVE_DIR).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir()) / "attnopt-native"
        folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"token_step-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        cmd = [cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[:200]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
