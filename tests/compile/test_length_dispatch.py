"""Length-adaptive dispatch (attnopt.passes.crossover): thresholds from injected timings, never real ones."""

import json
import os

import pytest
import torch

import attnopt
from attnopt.kernels import native
from attnopt.passes import crossover, machine_load
from attnopt.report import CompileReport

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dispatch_auto
VOCAB = 97


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _ids(n, seed=1):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


class FakeTimer:
    """A timer factory whose form is slower than exact below `cross` tokens and faster from it on."""

    def __init__(self, cross):
        self.cross, self.lengths, self.geometries = cross, [], []

    def __call__(self, module, geometry):
        self.geometries.append(geometry)

        def time_pair(n):
            self.lengths.append(n)
            return (2.0 if n < self.cross else 0.5), 1.0

        return time_pair


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "crossover.json"
    monkeypatch.setenv("ATTNOPT_CROSSOVER_CACHE", str(path))
    monkeypatch.delenv("ATTNOPT_DISPATCH", raising=False)
    monkeypatch.delenv("ATTNOPT_RECALIBRATE", raising=False)
    # No test times anything or reads the machine's load: the decoding step's timer and the load
    # source are injected too (a quiet machine unless a test says otherwise).
    monkeypatch.setattr(crossover, "decode_timer", FakeTimer(cross=128))
    monkeypatch.setattr(crossover, "load_average", lambda: 0.0)
    return path


def test_crossover_is_the_start_of_the_last_winning_run():
    # wins at 256, loses again at 512 (noise or a kernel switch), wins from 1024 on
    timings = [(64, 2, 1), (128, 1.5, 1), (256, 0.9, 1), (512, 1.1, 1), (1024, 0.5, 1), (2048, 0.4, 1)]
    assert crossover.crossover(timings) == 1024
    assert crossover.crossover([(64, 0.5, 1), (128, 0.4, 1)]) == 0
    assert crossover.crossover([(64, 0.5, 1), (128, 1.4, 1)]) is None


def test_measure_stops_after_two_wins_and_bounds_a_form_that_never_wins():
    seen = []
    value, detail, timings = crossover.measure(lambda n: (seen.append(n), (1.0 if n < 512 else 0.2, 0.5))[1])
    assert value == 512 and seen == [64, 128, 256, 512, 1024] and len(timings) == 5
    assert "from 512 tokens" in detail
    value, detail, _ = crossover.measure(lambda n: (2.0, 1.0), lengths=(64, 128, 256))
    assert value == 512 and "slower than exact attention at every length measured up to 256" in detail
    assert crossover.measure(lambda n: (0.1, 1.0))[0] == 0


def test_a_decoding_step_must_win_by_the_margin():
    """A near tie at the op level (the form 5% faster) is a loss for a decoding step: in the model its
    step pays fixed costs the timed op does not. The prefill rule still counts it a win."""
    step = {64: (1.5, 1.0), 128: (1.0, 1.05), 256: (1.0, 1.6), 512: (1.0, 2.2), 1024: (1.0, 3.0)}
    assert crossover.measure(lambda n: step[n], lengths=tuple(step))[0] == 128
    value, detail, timings = crossover.measure(lambda n: step[n], lengths=tuple(step), win=crossover.DECODE_WIN)
    assert value == 256 and [t[0] for t in timings] == [64, 128, 256, 512]
    assert "by 1.11x or more from 256 tokens" in detail
    assert crossover.crossover([(64, 0.95, 1.0), (128, 0.5, 1.0)], win=0.9) == 128


def test_compile_measures_caches_and_reports_the_threshold(llama, cache, monkeypatch):
    timer = FakeTimer(cross=256)
    monkeypatch.setattr(crossover, "module_timer", timer)  # compile's default timer, swapped for the fake
    example = {"input_ids": _ids(64), "use_cache": False}
    opt = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    report = opt.attnopt_report
    ths = [r.threshold for r in report.sites]
    # both layers share one geometry: timed once (64, 128 lose; 256, 512 win), the second is a cache hit
    assert [(t.min_seq_len, t.source) for t in ths] == [(256, "measured"), (256, "cached")]
    assert timer.lengths == [64, 128, 256, 512]
    g = timer.geometries[0]
    assert (g.heads, g.kv_heads, g.head_dim, g.causal) == (6, 2, 8, True)
    assert report.counts["dispatch"] == {"mode": "auto", "given": 0, "measured": 1, "cached": 1, "off": 0, "fixed": 0}
    assert all(r.outcome.params["min_seq_len"] == 256 for r in report.sites)
    assert all(s.attnopt_site.min_seq_len == 256 for s in (opt.model.layers[0].self_attn, opt.model.layers[1].self_attn))
    # the cache file holds one entry keyed by device, torch version, timed-code revision, form parameters
    # and geometry
    data = json.loads(cache.read_text())
    (key, entry), = data.items()
    assert f"torch {torch.__version__}" in key and "linear(" in key and "H=6, Hkv=2, D=8" in key
    steps = " native" if native.library() is not None else ""  # the C token steps time differently
    assert f"attnopt timing r{crossover.TIMED_CODE_REVISION}{steps} |" in key
    assert entry["min_seq_len"] == 256 and [t[0] for t in entry["timings"]] == [64, 128, 256, 512]
    # report: JSON round trip, Markdown and HTML show it
    again = CompileReport.from_dict(json.loads(report.to_json()))
    assert again.sites[0].threshold == ths[0]
    assert "256 (measured)" in report.to_markdown() and "256 (cached)" in report.to_html()
    assert ('title="faster than exact attention from 256 tokens on (measured 64..512); decoding: faster than exact '
            'attention by 1.11x or more from 128 tokens on (measured 64..256)"') in report.to_html()
    assert ths[0].decode == 128 and ths[0].load == 0.0 and not ths[0].loaded
    # below the threshold the compiled model is the original, exactly; from it on the form acts
    short = _ids(200, seed=2)
    assert torch.equal(_logits(opt, short), _logits(llama, short))
    long = _ids(300, seed=3)
    assert not torch.allclose(_logits(opt, long), _logits(llama, long), atol=1e-3)

    # a second compile reads the file and times nothing
    never = FakeTimer(cross=0)
    monkeypatch.setattr(crossover, "module_timer", never)
    opt2 = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert never.lengths == []
    assert [(r.threshold.min_seq_len, r.threshold.source) for r in opt2.attnopt_report.sites] == [(256, "cached")] * 2


def test_reuse_is_timed_only_where_it_reads_fewer_blocks_than_it_could(cache, monkeypatch):
    # Blocks of 32, 4 read per query block: up to 128 tokens reuse is exact attention, so 64 and 128
    # are not timed (a tie there would read as a win); it loses at 256 and wins at 512 and 1024. A
    # reused row costs the same at any position, an exact one grows with it: rows from 256 on reuse.
    timer = FakeTimer(cross=512)
    monkeypatch.setattr(crossover, "module_timer", timer)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    opt = attnopt.compile(model, "reuse:1+block:32+anchor:-1", example_inputs={"input_ids": _ids(300), "use_cache": False},
                          tolerance=10.0, e2e_tolerance=None)
    report = opt.attnopt_report
    assert timer.lengths == [256, 512, 1024]
    assert [(r.threshold.min_seq_len, r.threshold.source) for r in report.sites if r.threshold] == \
        [(256, "measured"), (256, "cached")]
    assert "half the crossover" in report.sites[1].threshold.detail
    short, long = _ids(256, seed=2), _ids(600, seed=3)
    site = opt.model.layers[1].self_attn.attnopt_site
    with monkeypatch.context() as patch:  # a call without a cache below it makes no selection at all
        patch.setattr(type(site), "select", lambda *a, **k: pytest.fail("a selection was made below the threshold"))
        assert torch.equal(_logits(opt, short), _logits(model, short))  # below it: the original, exactly
    assert not torch.allclose(_logits(opt, long)[:, -1], _logits(model, long)[:, -1], atol=1e-4)
    # What the real timer times of a reused layer: its selection from its own q and k, then the form
    # (not the threshold's exact rows), no anchor needed.
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 160, 8, generator=g) for h in (6, 2, 2))
    with torch.no_grad():
        timed = site.timed_attend(q, k, v)
        site.min_seq_len = 0
        assert torch.equal(timed, site(q, k, v, anchor=(q, k)))


def test_given_and_off_thresholds_time_nothing(llama, cache, monkeypatch):
    timer = FakeTimer(cross=256)
    monkeypatch.setattr(crossover, "module_timer", timer)
    example = {"input_ids": _ids(64), "use_cache": False}
    given = attnopt.compile(llama, {"rules": [{"layers": "0", "form": "linear", "min_seq_len": 0},
                                              {"form": "window", "window": 8, "min_seq_len": 40}]},
                            example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert [(r.threshold.min_seq_len, r.threshold.source) for r in given.attnopt_report.sites] == [(0, "given"),
                                                                                                    (40, "given")]
    off = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None, dispatch="off")
    assert [(r.threshold.min_seq_len, r.threshold.source) for r in off.attnopt_report.sites] == [(0, "off")] * 2
    monkeypatch.setenv("ATTNOPT_DISPATCH", "off")
    env_off = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert [r.threshold.source for r in env_off.attnopt_report.sites] == ["off"] * 2
    assert timer.lengths == [] and not cache.exists()


def test_bad_dispatch_values_are_one_line_errors(llama, cache, monkeypatch):
    example = {"input_ids": _ids(16), "use_cache": False}
    with pytest.raises(ValueError, match=r"dispatch must be 'auto' .* or 'off' .*got 'fast'"):
        attnopt.compile(llama, "linear", example_inputs=example, dispatch="fast")
    monkeypatch.setenv("ATTNOPT_DISPATCH", "0")
    with pytest.raises(ValueError, match=r"\$ATTNOPT_DISPATCH must be 'auto'"):
        attnopt.compile(llama, "linear", example_inputs=example)
    monkeypatch.delenv("ATTNOPT_DISPATCH")
    cache.write_text("{not json")
    with pytest.raises(ValueError, match="crossover cache .* cannot be read"):
        crossover.load_cache()


class LoadDependentTimer:
    """The form wins from 256 tokens on a quiet machine; under load (another job on the cores) every
    timing of it is noisy and it seems to lose up to the longest length."""

    def __init__(self, load):
        self.load, self.calls = load, 0

    def __call__(self, module, geometry):
        self.calls += 1

        def time_pair(n):
            if self.load[0] > 1:
                return 2.0, 1.0
            return (2.0 if n < 256 else 0.5), 1.0

        return time_pair


def test_a_cache_written_under_load_is_measured_again_when_quiet(llama, cache, monkeypatch):
    load = [100.0]
    timer = LoadDependentTimer(load)
    monkeypatch.setattr(crossover, "module_timer", timer)
    monkeypatch.setattr(crossover, "decode_timer", LoadDependentTimer(load))
    monkeypatch.setattr(crossover, "load_average", lambda: load[0])
    example = {"input_ids": _ids(64), "use_cache": False}
    busy = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    t = busy.attnopt_report.sites[0].threshold
    assert (t.min_seq_len, t.source, t.loaded, t.load) == (1024, "measured", True, 100.0)  # exact at every length
    assert "timed on a loaded machine (load 100.0" in t.detail
    assert "1024 (measured, loaded machine)" in busy.attnopt_report.to_markdown()
    busy_calls = timer.calls  # 2 when the cost model rules the loss out and the site is timed again
    load[0] = 0.2  # quiet now: the loaded entry is measured again, and the form acts from 256 on
    quiet = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert [(r.threshold.min_seq_len, r.threshold.source, r.threshold.loaded) for r in quiet.attnopt_report.sites] == \
        [(256, "measured", False), (256, "cached", False)]
    load[0] = 100.0  # a quiet entry is not replaced by a loaded measurement
    again = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert [r.threshold.source for r in again.attnopt_report.sites] == ["cached", "cached"] and timer.calls == busy_calls + 1
    monkeypatch.setenv("ATTNOPT_RECALIBRATE", "1")  # attnopt bench --recalibrate-dispatch
    load[0] = 0.0
    forced = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert [r.threshold.source for r in forced.attnopt_report.sites] == ["measured", "cached"] and timer.calls == busy_calls + 2


def test_other_work_on_the_cores_marks_an_entry_loaded_where_the_load_average_reads_quiet(llama, cache, monkeypatch):
    # Two busy jobs started a minute before: the 1-minute load average reads 2.0 on 2 cores, what our
    # own two timing threads give, but other work held 1.1 cores while the site was timed.
    others = [1.1]
    timer = LoadDependentTimer(others)
    monkeypatch.setattr(crossover, "module_timer", timer)
    monkeypatch.setattr(crossover, "decode_timer", LoadDependentTimer(others))
    monkeypatch.setattr(crossover, "load_average", lambda: 2.0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine_load, "cpu_mark", lambda: machine_load.CpuMark(0.0, 0.0, 0.0))
    monkeypatch.setattr(machine_load, "others_since", lambda mark: others[0])
    monkeypatch.setattr(crossover, "QUIET_SAMPLE_S", 0.0)
    assert not crossover.is_loaded(2.0)  # the load average alone takes this machine for quiet
    example = {"input_ids": _ids(64), "use_cache": False}
    busy = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    t = busy.attnopt_report.sites[0].threshold
    assert (t.source, t.loaded, t.load, t.others) == ("measured", True, 2.0, 1.1)
    assert "other work holding 1.1 cores" in t.detail
    others[0] = 0.05  # quiet now: measured again, and the entry is no longer loaded
    quiet = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert [(r.threshold.min_seq_len, r.threshold.source, r.threshold.loaded, r.threshold.others)
            for r in quiet.attnopt_report.sites] == [(256, "measured", False, 0.05), (256, "cached", False, 0.05)]


def test_other_cores_are_the_busy_time_of_all_cores_less_our_own():
    line = "cpu  500 20 80 9000 100 0 0 0 0 0"  # user nice system idle iowait irq softirq steal guest guest_nice
    assert machine_load.busy_seconds(line) == pytest.approx(600 / machine_load._TICKS)
    start, end = machine_load.CpuMark(10.0, 1.0, 100.0), machine_load.CpuMark(14.0, 3.0, 102.0)
    assert machine_load.others_cores(start, end) == pytest.approx(1.0)  # 4 busy core-seconds, 2 of them ours, in 2 s
    assert machine_load.others_cores(start, machine_load.CpuMark(11.0, 3.5, 102.0)) == 0.0  # never negative
    assert machine_load.others_cores(None, end) is None and machine_load.others_cores(end, start) is None
    if os.path.exists("/proc/stat"):  # the real first line parses (the mark itself is stubbed in tests)
        with open("/proc/stat") as f:
            assert machine_load.busy_seconds(f.readline()) > 0


def test_the_decoding_crossover_raises_the_threshold_of_a_decoding_site(llama, cache, monkeypatch):
    monkeypatch.setattr(crossover, "module_timer", FakeTimer(cross=128))
    monkeypatch.setattr(crossover, "decode_timer", FakeTimer(cross=512))
    example = {"input_ids": _ids(64), "use_cache": False}
    opt = attnopt.compile(llama, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    t = opt.attnopt_report.sites[0].threshold
    assert (t.min_seq_len, t.decode, [x[0] for x in t.decode_timings]) == (512, 512, [64, 128, 256, 512])
    assert json.loads(cache.read_text()).popitem()[1]["prefill"] == 128


def test_a_result_the_cost_model_rules_out_is_measured_again():
    from attnopt import forms

    class Site:  # what the cost model reads of a site
        heads, kv_heads, head_dim, v_head_dim, causal = 4, 2, 8, 8, True

    linear = forms.get("linear")
    params = linear.validate({})
    assert crossover.contradicts_model(linear, Site, params, [(64, 1.0, 1.0), (8192, 2.0, 1.0)])
    assert not crossover.contradicts_model(linear, Site, params, [(8192, 0.5, 1.0)])  # it wins: agrees
    assert not crossover.contradicts_model(linear, Site, params, [(64, 2.0, 1.0)])  # short: the model allows it
    runs = iter([lambda n: (2.0, 1.0), lambda n: (0.5 if n >= 4096 else 2.0, 1.0)])  # a busy first run
    steps = []
    entry = crossover.measure_entry(None, None, Site, params, (1024, 4096, 8192), False, lambda m, g: next(runs),
                                    None, steps.append, "linear")
    assert entry["min_seq_len"] == 4096 and "timed twice" in entry["detail"]
    assert any("cost model rules out" in s for s in steps)


def test_a_crossover_timed_with_the_native_steps_is_not_reused_without_them(monkeypatch):
    """The C token steps make a decoding step 2-4x cheaper on CPU: a threshold timed with them
    would be too low for the torch step, so the cache key says which step was timed."""
    g = crossover.Geometry(4, 2, 32, 32, True, None, "torch.float32", "cpu")
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    off = crossover.cache_key("linear", {"feature_map": "elu"}, g)
    monkeypatch.setenv(native.ENV_SWITCH, "1")
    on = crossover.cache_key("linear", {"feature_map": "elu"}, g)
    assert " native |" not in off
    assert (on != off) == (native.library() is not None)
