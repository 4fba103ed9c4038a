"""attnopt.bench, the timing behind `attnopt bench`, the demo and benchmarks/: taking turns, warm-ups,
best of the repeats, progress, results. Nothing is timed: every clock here is a fake one."""

from types import SimpleNamespace

import torch

from attnopt import bench


class FakeClock:
    """A clock that moves only when a fake model says it has worked."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted(torch.nn.Module):
    """A model whose forwards take the scripted seconds, in turn (the first is the warm-up)."""

    config = SimpleNamespace(vocab_size=50, max_position_embeddings=64, to_dict=lambda: {"use_cache": True})

    def __init__(self, name, clock, seconds, calls):
        super().__init__()
        self.name, self.clock, self.seconds, self.calls = name, clock, list(seconds), calls

    def forward(self, input_ids, use_cache=True, attention_mask=None):
        self.calls.append((self.name, input_ids.shape[1], use_cache, attention_mask is None))
        self.clock.now += self.seconds.pop(0)
        return input_ids


def test_take_turns_interleaves_skips_warmups_and_keeps_the_fastest():
    order = []
    script = {"a": [9.0, 3.0, 1.0, 2.0], "b": [9.0, 5.0, 6.0, 4.0]}

    def run(name):
        def call():
            order.append(name)
            return script[name].pop(0)

        return call

    turns = bench.take_turns({"a": run("a"), "b": run("b")}, repeats=3, warmups=1)
    assert order == ["a", "b"] * 4  # a warm-up round, then every subject once per round
    assert turns.values() == {"a": [3.0, 1.0, 2.0], "b": [5.0, 6.0, 4.0]}  # the warm-up is not kept
    assert turns.best() == {"a": 1.0, "b": 4.0}
    assert turns.worst() == {"a": 3.0, "b": 6.0}
    assert turns.spread() == {"a": 3.0, "b": 1.5}


def test_take_turns_rotates_who_goes_first_and_reads_named_measurements():
    order, seen = [], []
    runs = {name: (lambda name=name: order.append(name) or {"seconds": 1.0, "rss": len(order)}) for name in "abc"}
    turns = bench.take_turns(runs, repeats=4, rotate=True, progress=seen.append)
    assert order == list("abc" "bca" "cab" "abc")
    assert seen == order  # told before every call
    assert turns.values("rss") == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}
    assert turns.best("missing") == {"a": float("inf"), "b": float("inf"), "c": float("inf")}


def test_time_forward_best_of_repeats_per_length_with_progress():
    clock, calls, told = FakeClock(), [], []
    models = {"original": Scripted("original", clock, [8, 4, 2, 3, 8, 5, 6, 7], calls),
              "fast": Scripted("fast", clock, [8, 1, 2, 0.5, 8, 1, 1, 2], calls)}
    rows = bench.time_forward(models, [5, 7], lambda n: ((), {"input_ids": torch.zeros(1, n, dtype=torch.long),
                                                              "use_cache": False}),
                              repeats=3, progress=lambda *a: told.append(a), clock=clock)
    assert [c[:2] for c in calls] == [("original", 5), ("fast", 5)] * 4 + [("original", 7), ("fast", 7)] * 4
    assert [r.length for r in rows] == [5, 7]
    assert rows[0].seconds == {"original": 2, "fast": 0.5} and rows[1].seconds == {"original": 5, "fast": 1}
    assert rows[0].samples == {"original": [4, 2, 3], "fast": [1, 2, 0.5]}
    assert rows[0].spread == {"original": 2.0, "fast": 4.0}
    assert rows[1].speedup == {"original": 1.0, "fast": 5.0}
    assert rows[1].to_dict() == {"tokens": 7, "seconds": {"original": 5, "fast": 1},
                                 "speedup": {"original": 1.0, "fast": 5.0}}
    assert told[0] == ("N=5 original", 0, 16) and told[-1] == ("N=7 fast", 15, 16)


def test_time_generate_takes_turns_and_keeps_the_best_prefill_and_per_token():
    clock, order = FakeClock(), []

    class Gen(torch.nn.Module):
        def __init__(self, name, prefills, step):
            super().__init__()
            self.name, self.prefills, self.step = name, list(prefills), step

        def generate(self, ids, max_new_tokens, logits_processor, **kwargs):
            order.append(self.name)
            clock.now += self.prefills.pop(0)
            for _ in range(max_new_tokens):
                logits_processor[0](ids, torch.zeros(1, 50))
                clock.now += self.step

    t = bench.time_generate({"original": Gen("original", [3.0, 2.0], 0.5), "fast": Gen("fast", [1.0, 1.5], 0.25)},
                            torch.zeros(1, 6, dtype=torch.long), new_tokens=3, repeats=2, clock=clock)
    assert order == ["original", "fast", "original", "fast"]  # no warm-up round
    assert t.prefill == {"original": 2.0, "fast": 1.0} and t.per_token == {"original": 0.5, "fast": 0.25}
    assert t.to_dict() == {"prompt": 6, "new_tokens": 3, "prefill": t.prefill, "per_token": t.per_token}


def test_compare_compiles_each_policy_and_returns_the_bench_json():
    clock, calls, compiled = FakeClock(), [], []
    model = Scripted("original", clock, [1.0] * 8, calls)

    def compiler(m, policy, example_inputs, **options):
        compiled.append((policy, example_inputs[1], options))
        fast = Scripted(policy, clock, [0.5] * 8, calls)
        site = SimpleNamespace(threshold=SimpleNamespace(min_seq_len=16))
        fast.attnopt_report = SimpleNamespace(sites=[site, SimpleNamespace(threshold=None)],
                                              count=lambda status: 1)
        return fast

    example = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3)}
    workload = bench.Workload(model, (), example, "fake", random_weights=True)
    assert workload.resizable and workload.positions == 64
    result = bench.compare(workload, ["p"], [9], repeats=2, compiler=compiler, clock=clock, dispatch="off")
    assert compiled == [("p", {**example, "use_cache": False}, {"e2e_tolerance": None, "dispatch": "off"})]
    assert {c[1:] for c in calls} == {(9, False, True)}  # random ids of 9 tokens; the example's mask dropped
    assert result.to_dict() == {
        "model": "fake", "threads": torch.get_num_threads(), "repeats": 2,
        "rows": [{"tokens": 9, "seconds": {"original": 1.0, "p": 0.5}, "speedup": {"original": 1.0, "p": 2.0}}],
        "rewritten": {"p": "1/2"}, "thresholds": {"p": [16, None]}}
    ids = workload.inputs(9)[1]["input_ids"]
    assert torch.equal(ids, bench.random_ids(9, 50, seed=9))  # seeded by the length


def test_a_workload_called_with_positional_args_is_timed_at_its_own_example():
    workload = bench.Workload(torch.nn.Identity(), (torch.zeros(2, 3),), {}, "identity")
    assert not workload.resizable and workload.lengths([8, 16]) == [None]
    assert workload.inputs(None) == (workload.args, {})


def test_the_cli_default_policies_are_the_library_ones():
    from attnopt.cli import BENCH_POLICIES

    assert BENCH_POLICIES == bench.DEFAULT_POLICIES
