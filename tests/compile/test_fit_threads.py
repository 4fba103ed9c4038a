"""The compile-time fits run at the threads other work leaves free (passes/machine_load.ThreadBackoff):
a thread pool oversubscribed by busy neighbours made every small op wait at its barrier."""

import pytest
import torch

from attnopt.passes import machine_load
from attnopt.passes.machine_load import ThreadBackoff, threads_beside


@pytest.mark.parametrize("others, wanted, cores, expected", [
    (None, 2, 2, 2),  # load unknown: torch's own count
    (0.1, 2, 2, 2),  # quiet
    (0.7, 2, 2, 1),  # a core mostly taken
    (2.0, 2, 2, 1),  # two busy processes on two cores: never below 1
    (5.0, 8, 16, 8),  # plenty left: never above what torch was given
    (12.4, 8, 16, 4),
])
def test_threads_beside_other_work(others, wanted, cores, expected):
    assert threads_beside(others, wanted, cores) == expected


def test_each_piece_runs_at_the_threads_the_previous_reading_allows(monkeypatch):
    readings = iter([1.9, 0.0, 1.5, 0.0])  # the first look, then during each piece
    monkeypatch.setattr(machine_load, "cpu_mark", lambda: machine_load.CpuMark(0.0, 0.0, 0.0))
    monkeypatch.setattr(machine_load, "others_since", lambda mark: next(readings))
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        backoff = ThreadBackoff()
        seen = [backoff.run(torch.get_num_threads) for _ in range(3)]
        assert seen == [1, 2, 1] and backoff.used == [1, 2, 1]
        assert torch.get_num_threads() == 2  # restored after every piece
    finally:
        torch.set_num_threads(before)


def test_an_unknown_load_leaves_the_threads_alone(monkeypatch):
    monkeypatch.setattr(machine_load, "cpu_mark", lambda: None)
    backoff = ThreadBackoff()
    assert backoff.run(torch.get_num_threads) == torch.get_num_threads() == backoff.wanted


def test_a_compile_beside_busy_work_runs_every_step_at_the_free_threads(monkeypatch):
    """Not only the fits: capture, recording, the end-to-end check and the timing run at 1 thread
    when the first look finds both cores taken, and torch's count is back afterwards."""
    import attnopt

    seen = []
    monkeypatch.setattr(machine_load, "cpu_mark", lambda: machine_load.CpuMark(0.0, 0.0, 0.0))
    monkeypatch.setattr(machine_load, "others_since", lambda mark: 2.0)
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            seen.append(torch.get_num_threads())
            q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        opt = attnopt.compile(Tiny(), "linear", example_inputs=(torch.randn(2, 32, 16),), dispatch="off",
                              e2e_tolerance=None)
        assert seen and set(seen) == {1}
        assert opt.attnopt_report.conditions.threads == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
