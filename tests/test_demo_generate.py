"""The demo's generate() timing: the prefill and the per-token time come from one clock read per step."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")


def test_generate_timing_reads_the_clock_at_every_step(monkeypatch):
    from attnopt import demo

    now = [0.0]
    monkeypatch.setattr(demo, "time", SimpleNamespace(perf_counter=lambda: now[0]))  # a fake clock, demo only
    order = []

    class Fake(torch.nn.Module):
        config = SimpleNamespace(vocab_size=50)

        def __init__(self, name, prefill, step):
            super().__init__()
            self.name, self.prefill, self.step = name, prefill, step

        def generate(self, ids, max_new_tokens, logits_processor, **kwargs):
            order.append(self.name)
            now[0] += self.prefill
            for _ in range(max_new_tokens):
                logits_processor[0](ids, torch.zeros(1, 50))
                now[0] += self.step

    t = demo.time_generate({"original": Fake("original", 2.0, 0.5), "fast": Fake("fast", 1.0, 0.125)},
                           prompt=8, new_tokens=4, repeats=2)
    assert order == ["original", "fast", "original", "fast"]  # taking turns
    assert t.prefill == {"original": 2.0, "fast": 1.0}
    assert t.per_token == {"original": 0.5, "fast": 0.125}
    assert (t.prompt, t.new_tokens) == (8, 4)
