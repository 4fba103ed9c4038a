"""`attnopt calibrate`: real MiniLM at 64 tokens, a few steps; the saved model holds the trained tensors."""

import json

import torch

from attnopt.cli import main


def test_cli_calibrates_saves_and_reports(tmp_path, capsys):
    from safetensors.torch import load_file

    import attnopt
    from attnopt.calibration.targets import site_modules
    from attnopt.calibration.train import trainable_tensors

    rc = main(["calibrate", "minilm", "--policy", "linear+window:16+fit_steps:5", "--seq-len", "64", "--steps", "4", "--json",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    cal = json.loads(out)
    report = json.loads((tmp_path / "report.json").read_text())
    rewritten = [r["site"]["id"] for r in report["sites"] if r["outcome"]["status"] == "rewritten"]
    assert cal["train_batches"] == 3 and cal["held_out_batches"] == 1
    assert rewritten and [s["site_id"] for s in cal["sites"]] == rewritten
    assert all(s["status"] in ("trained", "unchanged") for s in cal["sites"])
    assert (tmp_path / "report.html").read_text().count("<h2>Calibration</h2>") == 1
    saved = load_file(str(tmp_path / "checkpoint" / "calibration.safetensors"))
    loaded = attnopt.load(tmp_path / "model")
    assert loaded.attnopt_report.calibration["steps"] == 4
    tensors = {f"{sid}/{n}": t for sid, m in site_modules(loaded).items() for n, t in trainable_tensors(m).items()}
    assert tensors.keys() == saved.keys() and all(torch.equal(tensors[k], saved[k]) for k in saved)


def test_cli_calibrate_errors_in_one_line(capsys, tmp_path):
    rc = main(["calibrate", "minilm", "--policy", "window:16", "--seq-len", "64"])
    err = capsys.readouterr().err.strip()
    # In-process, transformers (imported by earlier tests) may print its own loading bar first.
    assert rc == 2 and "Traceback" not in err
    err = err.splitlines()[-1]
    assert err.startswith("attnopt calibrate: nothing to calibrate") and "linear:hedgehog" in err
    assert main(["calibrate", "minilm", "--policy", "nope"]) == 2
    assert "bad --policy" in capsys.readouterr().err
    assert main(["calibrate", "minilm", "--params", "everything"]) == 2  # refused before any compile
    assert "bad --params 'everything': choose one of forms, forms+lora" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["calibrate", "minilm", "--out", str(afile)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert main(["calibrate", "--help"]) == 0
    assert "torchrun --nproc_per_node=2" in capsys.readouterr().out
