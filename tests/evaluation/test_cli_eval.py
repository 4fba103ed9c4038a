"""`attnopt eval`: the summary, the JSON and HTML it writes, progress lines off a terminal, a compiled and a
saved model beside their reference, and one-line errors with exit code 2."""

import json
from pathlib import Path

import pytest

from attnopt.cli import main

TINY = str(Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "tiny_lm")
FACTORY = f"{Path(__file__).resolve().parents[2] / 'examples' / 'custom_model.py'}:build"  # embeddings in, not ids
SMALL = ["--lengths", "256", "--probes", "copy,passkey", "--depths", "0,1", "--samples", "1"]


def test_eval_writes_json_and_html_and_prints_progress_lines(tmp_path, capsys):
    out_json, out_html = tmp_path / "a.json", tmp_path / "a.html"
    assert main(["eval", TINY, *SMALL, "--json", str(out_json), "--html", str(out_html)]) == 0
    captured = capsys.readouterr()
    assert f"capability audit of {TINY}: 2 probes x 1 lengths x 2 depths x 1 samples" in captured.out
    assert "copy     exact match by length  256: 0%" in captured.out  # padded to "passkey"
    assert f"wrote {out_html} and {out_json}" in captured.out
    lines = captured.err.splitlines()
    # stderr is not a terminal here: plain lines, counted, the last one the last model call
    assert lines[-1] == f"attnopt eval: [5/5] {TINY}: perplexity"
    assert any(line.startswith("attnopt eval: [1/5] ") for line in lines)
    data = json.loads(out_json.read_text())
    assert data["probes"] == ["copy", "passkey"] and data["lengths"] == [256] and data["depths"] == [0.0, 1.0]
    assert set(data["model"]["retrieval"]["copy"]["256"]) == {"0.0", "1.0"} and data["reference"] is None
    assert out_html.read_text().startswith("<!DOCTYPE html>") and "<svg" in out_html.read_text()


def test_quiet_prints_nothing_on_stderr(capsys):
    assert main(["eval", TINY, *SMALL, "--probes", "copy", "--quiet"]) == 0
    # (transformers' own "Loading weights" bar shows when an earlier test imported it before main() turned it off)
    assert "attnopt" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_compiled_and_a_saved_model_beside_their_original(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["eval", TINY, "--policy", "linear", "--tolerance", "10", "--e2e-tolerance", "none", "--reference",
                 *SMALL, "--json", str(out), "--quiet"]) == 0
    assert f"compiled Hugging Face model from {TINY}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["model"]["name"] == f"{TINY} [linear]" and data["reference"]["name"] == f"{TINY} (original)"
    assert data["model"]["perplexity"]["overall"] != data["reference"]["perplexity"]["overall"]
    assert data["model"]["decode_disagreements"] == 0

    import attnopt
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(TINY).eval()
    ids = torch.tensor([list(b"The river flows past the old mill and on to the sea. " * 3)])
    opt = attnopt.compile(model, "linear", example_inputs={"input_ids": ids}, tolerance=10, e2e_tolerance=None)
    attnopt.save(opt, tmp_path / "saved")
    saved_json = tmp_path / "s.json"
    assert main(["eval", str(tmp_path / "saved"), "--reference", *SMALL, "--json", str(saved_json), "--quiet"]) == 0
    saved = json.loads(saved_json.read_text())
    # the saved directory's own weights are the original: the same perplexity as the directory it came from
    assert saved["reference"]["perplexity"]["overall"] == pytest.approx(data["reference"]["perplexity"]["overall"],
                                                                       rel=1e-6)
    assert saved["model"]["perplexity"]["overall"] != saved["reference"]["perplexity"]["overall"]


@pytest.mark.parametrize("args, message", [
    ([TINY, "--probes", "copy,niah"], "--probes: unknown probe 'niah'; known probes: passkey, needle, multikey, mqar, copy"),
    ([TINY, "--lengths", "4096", "--probes", "copy"], f"length 4096 is beyond what {TINY} can embed "
                                                      "(1024 positions"),
    ([TINY, "--lengths", "64,x"], "--lengths must be comma-separated positive token counts"),
    ([TINY, "--depths", "0,1.5"], "--depths must be comma-separated fractions from 0 (start) to 1"),
    ([TINY, "--reference"], "--reference audits the model before conversion beside the converted one: give --policy"),
    ([TINY, "--tolerance", "3"], "--tolerance and --e2e-tolerance are compile options: give them with --policy"),
    ([TINY, "--policy", "linear", "--e2e-tolerance", "-1"], "--e2e-tolerance must be a finite number > 0 or 'none'"),
    ([TINY, "--samples", "0"], "--samples must be >= 1"),
    ([TINY, "--texts", "no/such/file.txt"], "--texts no/such/file.txt: no such file"),
    ([TINY, "--lengths", "100"], "length 100 is too short for probe 'passkey': it needs at least"),
    (["minilm", "--lengths", "128"], "BertModel is not a causal language model"),
    (["no/such/dir"], "bad MODEL: unknown MODEL 'no/such/dir'"),
    ([f"{FACTORY}", "--lengths", "256"], f"{FACTORY} cannot be called with token ids [batch, tokens] (ValueError: "),
])
def test_bad_arguments_are_one_line_errors(args, message, capsys):
    assert main(["eval", *args, "--quiet"]) == 2
    ours = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(ours) == 1 and ours[0].startswith("attnopt eval: ") and message in ours[0], ours


def test_a_report_path_that_is_a_directory_is_refused_before_any_work(tmp_path, capsys):
    assert main(["eval", "no/such/dir", "--html", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"attnopt eval: --html {tmp_path} is a directory; give a file path\n"


def test_eval_is_listed_with_its_example(capsys):
    assert main(["eval", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "attnopt eval benchmarks/data/recall_lm --policy gla+window:64 --reference --lengths 512,2048" in out
