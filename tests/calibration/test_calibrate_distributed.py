"""Two CPU processes on gloo under torch.distributed.run: identical trained tensors, same held-out quality."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def test_two_gloo_ranks_end_identical(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).with_name("dist_worker.py")), str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2 and r0["train_batches"] == 8
    assert r0["probe"] == r1["probe"] == [1.5, 1.5, 1.5]  # the mean of 1 and 2, not their sum
    t0, t1 = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert t0.keys() == t1.keys() and len(t0) == 8  # 4 sites × (hedgehog map, β)
    assert all(torch.equal(t0[k], t1[k]) for k in t0)
    assert r0["after"] == r1["after"] and r0["curves"] == r1["curves"]
    assert r0["after"] < r0["before"]
    saved = load_file(str(tmp_path / "checkpoint" / "calibration.safetensors"))
    assert all(torch.equal(saved[k], t0[k]) for k in t0)
