"""`attnopt compile`: writes the reports, and every bad input is one clear message with an exit code."""

import json
import os

from attnopt.cli import main

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_model.py")


def test_compile_factory_writes_html_and_json(tmp_path, capsys):
    html = tmp_path / "out" / "r.html"
    code = main(["compile", f"{EXAMPLE}:build", "--policy", "window:16+sinks:2", "--tolerance", "0.99",
                 "--html", str(html)])
    out = capsys.readouterr().out
    assert code == 0
    assert "4/4 sites rewritten" in out
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    assert [s["outcome"]["final_form"] for s in data["sites"]] == ["window"] * 4
    assert "<svg" in html.read_text()


def test_bad_policy_and_model_are_clear_errors(tmp_path, capsys):
    assert main(["compile", f"{EXAMPLE}:build", "--policy", "window:0", "--html", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "bad --policy" in err and "window" in err and "Traceback" not in err
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
    err = capsys.readouterr().err
    assert err.startswith("attnopt compile: no attention found in make()") and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()
