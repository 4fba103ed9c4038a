"""`attnopt compile`: a short summary on stdout, the full report in the files, progress lines on stderr,
and every bad input is one clear message with an exit code."""

import json
import os
import re

from attnopt.cli import main

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_model.py")


PROGRESS_LINE = re.compile(r"^attnopt compile: \[\d+:\d\d\] ")


def test_compile_prints_a_short_summary_and_writes_the_full_report_to_files(tmp_path, capsys):
    html, md = tmp_path / "out" / "r.html", tmp_path / "out" / "r.md"
    code = main(["compile", f"{EXAMPLE}:build", "--policy", "window:16+sinks:2", "--tolerance", "0.99",
                 "--html", str(html), "--md", str(md)])
    shown = capsys.readouterr()
    assert code == 0
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    assert [s["outcome"]["final_form"] for s in data["sites"]] == ["window"] * 4
    assert "<svg" in html.read_text()
    lines = shown.out.splitlines()
    assert len(lines) == 4, shown.out  # sites, drift, time, files: the report itself is in the files
    name = data["model_name"]
    assert lines[0] == f"{name}: 4/4 sites rewritten"
    worst = data["end_to_end"]["worst"]["rel_rms"]
    assert lines[1] == f"drift: worst output relative RMS {worst:.4g} (end-to-end budget 0.5)"
    ft = data["forward_time"]
    assert lines[2].startswith(f"time: forward on the verification input [{'×'.join(map(str, ft['input_shape']))}]")
    assert f"({ft['speedup']:.2f}x), best of {ft['repeats']}" in lines[2] and " thread" in lines[2]
    assert lines[3].startswith(f"wrote {html}, {tmp_path / 'out' / 'r.json'} and {md} ")
    report = md.read_text()
    assert report.startswith(f"# attnopt report: {name}") and "## Measured time" in report
    assert report.count("4/4 sites rewritten") == 0 and "| blocks.0#0 |" in report
    # stderr is not a terminal here: plain progress lines, one per step at most every 2 s
    err = shown.err.splitlines()
    assert err and all(PROGRESS_LINE.match(line) for line in err), err
    assert PROGRESS_LINE.sub("", err[0]) == f"loading {EXAMPLE}:build ...", err  # the clock is the machine's
    assert any(line.endswith(f"] compiling {name} with window:16+sinks:2") for line in err), err
    assert main(["compile", f"{EXAMPLE}:build", "--policy", "window:16+sinks:2", "--tolerance", "0.99",
                 "--html", str(html), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_bad_policy_and_model_are_clear_errors(tmp_path, capsys):
    assert main(["compile", f"{EXAMPLE}:build", "--policy", "window:0", "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "bad --policy" in err and "window" in err and "Traceback" not in err
    assert main(["compile", f"{EXAMPLE}:build", "--policy", "gla+windw:16", "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(did you mean 'gla+window:16'?)" in err
    assert main(["compile", str(tmp_path / "nope"), "--html", str(tmp_path / "r.html")]) == 2
    assert "unknown MODEL" in capsys.readouterr().err
    assert main(["compile", f"{EXAMPLE}:missing_factory", "--html", str(tmp_path / "r.html")]) == 2
    assert "missing_factory" in capsys.readouterr().err


def test_bad_numbers_are_one_line_errors(tmp_path, capsys):
    html = str(tmp_path / "r.html")
    for flag, value, words in (("--tolerance", "-1", "--tolerance"), ("--tolerance", "nan", "--tolerance"),
                               ("--e2e-tolerance", "0", "--e2e-tolerance"), ("--e2e-tolerance", "x", "--e2e-tolerance")):
        assert main(["compile", f"{EXAMPLE}:build", flag, value, "--html", html]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_seq_len_beyond_the_models_positions_is_a_clear_error(minilm, capsys, tmp_path):
    assert main(["compile", "minilm", "--seq-len", "1024", "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "512 positions" in err and "Traceback" not in err


def test_json_path_and_no_budget(tmp_path, capsys):
    html, js = tmp_path / "a" / "r.html", tmp_path / "b" / "other.json"
    code = main(["compile", f"{EXAMPLE}:build", "--policy", "window:16+sinks:2", "--tolerance", "0.99",
                 "--e2e-tolerance", "none", "--html", str(html), "--json", str(js)])
    out = capsys.readouterr().out
    assert code == 0 and f"wrote {html} and {js}" in out
    data = json.loads(js.read_text())
    assert data["counts"]["budget"] == {"e2e_tolerance": None, "reverted": 0}
    assert not (tmp_path / "a" / "r.json").exists()


def test_model_without_attention_is_code_4(tmp_path, capsys):
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 3), (torch.randn(2, 4),)\n")
    assert main(["compile", f"{plain}:make", "--html", str(tmp_path / "r.html")]) == 4
    err = [line for line in capsys.readouterr().err.splitlines() if not PROGRESS_LINE.match(line)]
    assert len(err) == 1 and err[0].startswith("attnopt compile: no attention found in make()")
    assert not (tmp_path / "r.html").exists()


TINY_LM = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "tiny_lm")


def test_a_causal_lm_directory_loads_its_head_and_is_judged_by_logits_and_perplexity(tmp_path, capsys):
    html = tmp_path / "r.html"
    code = main(["compile", TINY_LM, "--policy", "linear+window:16", "--seq-len", "48", "--html", str(html)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "UNEXPECTED" not in captured.out + captured.err
    summary = captured.out.strip().splitlines()[1]
    assert summary.startswith("drift: logits relative RMS drift") and "embedding cosine" not in summary
    assert "perplexity on the built-in text (4x48 tokens, in-sample)" in summary
    data = json.loads((tmp_path / "r.json").read_text())
    assert "LlamaForCausalLM" in data["model_name"]
    [note] = [note for note in data["notes"] if "perplexity" in note]
    assert note == f"4/4 sites rewritten; {summary.removeprefix('drift: ')}"  # the line printed, once
    ratios = [float(part.split("(")[1].rstrip("x)")) for part in summary.split(", ") if part.endswith("x)")]
    assert ratios and all(0.5 < r < 2.0 for r in ratios)


def test_an_unwritable_report_path_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import attnopt.cli as cli

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the report path was checked")

    monkeypatch.setattr(cli, "_load", no_load)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv, words in ((["--html", str(tmp_path)], "is a directory"),
                        (["--html", str(blocker / "r.html")], "cannot be written"),
                        (["--html", str(tmp_path / "ok.html"), "--json", str(blocker / "r.json")], "--json")):
        assert main(["compile", f"{EXAMPLE}:build", *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ok.html").exists()
