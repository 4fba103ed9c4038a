"""`attnopt bench` and the progress bar of `attnopt compile`."""

import json

import pytest

from attnopt.cli import main

FACTORY = (
    "import torch\n"
    "from torch import nn\n"
    "class A(nn.Module):\n"
    "    def forward(self, q, k, v):\n"
    "        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
    "def make():\n"
    "    g = torch.Generator().manual_seed(0)\n"
    "    q = 2 * torch.randn(1, 4, 48, 32, generator=g)  # k = q: each query peaks on itself, so a window fits\n"
    "    return A(), (q, q.clone(), torch.randn(1, 4, 48, 32, generator=g))\n"
)


@pytest.fixture
def factory(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(FACTORY)
    return f"{f}:make"


def test_bench_json_times_every_policy_at_the_factory_example(factory, capsys):
    assert main(["bench", factory, "--policy", "window:8", "--policy", "window:16+sinks:2", "--repeats", "2", "--json"]) == 0
    shown = capsys.readouterr()
    assert shown.err == ""  # no progress bar with --json
    data = json.loads(shown.out)
    [row] = data["rows"]
    assert row["tokens"] is None  # a factory's example cannot be resized
    assert list(row["seconds"]) == ["original", "window:8", "window:16+sinks:2"]
    assert all(0 < s < 60 for s in row["seconds"].values())
    assert row["speedup"]["original"] == 1.0
    assert data["rewritten"] == {"window:8": "1/1", "window:16+sinks:2": "1/1"}
    assert data["thresholds"] == {"window:8": [0], "window:16+sinks:2": [0]}  # tests run with dispatch off


@pytest.mark.parametrize("argv, words", [
    (["bench", "--lengths", "0,12"], "--lengths must be comma-separated positive token counts"),
    (["bench", "--lengths", "a"], "--lengths must be"),
    (["bench", "--policy", "window:0"], "bad --policy"),
    (["bench", "--repeats", "0"], "--repeats"),
])
def test_bench_bad_arguments_are_one_line_errors(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and words in err, err


def test_compile_shows_each_step_and_the_sites_verified(factory, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats stderr as a terminal
    monkeypatch.setenv("COLUMNS", "240")  # wide enough for the bar's count column
    assert main(["compile", factory, "--policy", "window:8", "--html", str(tmp_path / "r.html")]) == 0
    err = capsys.readouterr().err
    for step in ("capture + detect", "record", "verifying site graph#0", "splice + end-to-end check",
                 "dispatch thresholds"):
        assert step in err, (step, err[-2000:])
    assert "0/1" in err  # the bar counts the sites verified


def test_compile_dispatch_option_measures_thresholds(factory, tmp_path, monkeypatch, capsys):
    from attnopt.passes import crossover

    monkeypatch.setenv("ATTNOPT_CROSSOVER_CACHE", str(tmp_path / "xo.json"))
    # injected timings: the form loses below 256 tokens and wins from there (nothing is timed)
    monkeypatch.setattr(crossover, "module_timer", lambda module, geometry: lambda n: (2.0 if n < 256 else 0.5, 1.0))
    monkeypatch.setattr(crossover, "load_average", lambda: 0.0)  # a quiet machine, whatever this one runs
    assert main(["compile", factory, "--policy", "window:8", "--dispatch", "auto", "--html",
                 str(tmp_path / "r.html"), "--md", str(tmp_path / "r.md")]) == 0
    assert "| 256 (measured) |" in (tmp_path / "r.md").read_text()
    [site] = json.loads((tmp_path / "r.json").read_text())["sites"]
    assert (site["threshold"]["min_seq_len"], site["threshold"]["source"]) == (256, "measured")
    assert main(["compile", factory, "--policy", "window:8", "--dispatch", "off", "--html",
                 str(tmp_path / "r.html")]) == 0
    [site] = json.loads((tmp_path / "r.json").read_text())["sites"]
    assert (site["threshold"]["min_seq_len"], site["threshold"]["source"]) == (0, "off")
    assert main(["compile", factory, "--dispatch", "fast"]) == 2


def test_bench_help_names_one_default_model(capsys):
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "[default: decoder]" in out and "(default)" not in out and "default: minilm" not in out


def test_bench_recalibrate_dispatch_makes_the_compiles_measure_again(monkeypatch):
    import attnopt.cli as cli

    seen = []
    monkeypatch.setenv("ATTNOPT_RECALIBRATE", "")  # restored after the test
    monkeypatch.setattr(cli, "run_bench", lambda *a, **k: seen.append(cli.os.environ["ATTNOPT_RECALIBRATE"]) or 0)
    assert main(["bench", "--policy", "linear"]) == 0
    assert main(["bench", "--policy", "linear", "--recalibrate-dispatch"]) == 0
    assert seen == ["", "1"]  # attnopt.passes.crossover.stale() then re-measures every entry a compile reads
