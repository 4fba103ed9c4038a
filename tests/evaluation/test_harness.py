"""lm-evaluation-harness model "attnopt": under `exact` it scores what lm-eval's own `hf` model scores on
the same directory (the same log-likelihood for every choice), and a rewritten policy gets its own; the
local task tests/evaluation/lm_eval_task runs offline."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "benchmarks" / "data" / "tiny_lm"
TASKS = ROOT / "tests" / "evaluation" / "lm_eval_task"
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """tiny_lm with recall_lm's byte-level tokenizer (token id = byte), so lm-eval's `hf` can load it too."""
    pytest.importorskip("lm_eval")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_recall_lm

    path = tmp_path_factory.mktemp("tiny_tok")
    for f in TINY.iterdir():
        shutil.copy(f, path / f.name)
    train_recall_lm.byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tasks():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS), include_defaults=False)  # lm-eval's own tasks take ~20 s to index


def _run(lm, tasks):
    import lm_eval

    out = lm_eval.simple_evaluate(model=lm, tasks=["attnopt_recall"], task_manager=tasks, log_samples=True)
    samples = sorted(out["samples"]["attnopt_recall"], key=lambda s: s["doc_id"])
    return out["results"]["attnopt_recall"]["acc,none"], [float(r[0][0]) for s in samples for r in s["resps"]]


@pytest.mark.slow
def test_exact_scores_what_hf_scores_and_a_rewritten_policy_its_own(tiny_dir, tasks, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository root
    import attnopt
    import torch
    import transformers
    from lm_eval.models.huggingface import HFLM

    from attnopt.evaluation import lm_eval_model
    from attnopt.evaluation.harness import AttnoptLM

    args = {"prefix_token_id": 10, "device": "cpu", "batch_size": 8}
    acc_hf, ll_hf = _run(HFLM(pretrained=str(tiny_dir), **args), tasks)
    acc_exact, ll_exact = _run(AttnoptLM(pretrained=str(tiny_dir), policy="exact", **args), tasks)
    assert len(ll_hf) == 160 and acc_exact == acc_hf
    assert max(abs(a - b) for a, b in zip(ll_hf, ll_exact)) < 1e-4

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.tensor([tok("The river flows past the old mill and on to the sea. " * 3)["input_ids"]])
    opt = attnopt.compile(model, "linear", example_inputs={"input_ids": ids}, tolerance=10, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 4
    acc_linear, ll_linear = _run(lm_eval_model(opt, tok, prefix_token_id=10, batch_size=8), tasks)
    assert max(abs(a - b) for a, b in zip(ll_hf, ll_linear)) > 1.0  # its own log-likelihoods
    assert 0.0 <= acc_linear <= 1.0


def test_in_memory_model_must_be_a_transformers_model():
    pytest.importorskip("lm_eval")
    import torch

    from attnopt.evaluation import lm_eval_model

    with pytest.raises(TypeError, match="lm_eval_model needs a transformers model"):
        lm_eval_model(torch.nn.Linear(2, 2), None)


def test_a_transformers_directory_needs_a_policy(tiny_dir):
    from attnopt.evaluation.harness import AttnoptLM

    with pytest.raises(ValueError, match=r"is a transformers directory: give policy=\.\.\."):
        AttnoptLM(pretrained=str(tiny_dir), prefix_token_id=10, device="cpu")


def test_missing_lm_eval_is_one_line():
    code = "import sys; sys.modules['lm_eval'] = None\nfrom attnopt.lm_eval import main\nsys.exit(main(['--help']))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 2
    assert run.stderr == ("attnopt.lm_eval: attnopt's lm-evaluation-harness model needs lm-eval: "
                          "pip install 'attnopt[eval]'\n")


def _cli(args, out: Path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", *args, "--tasks", "attnopt_recall", "--include_path", str(TASKS),
                          "--device", "cpu", "--batch_size", "8", "--output_path", str(out)],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = next(out.rglob("results_*.json"))
    return json.loads(result.read_text())["results"]["attnopt_recall"]["acc,none"], run.stderr


@pytest.mark.slow
def test_the_command_line_is_lm_evals_own_with_attnopt_registered(tiny_dir, tmp_path):
    hf, _ = _cli(["lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny_dir},prefix_token_id=10"],
                 tmp_path / "hf")
    exact, _ = _cli(["attnopt.lm_eval", "--model", "attnopt", "--model_args",
                     f"pretrained={tiny_dir},prefix_token_id=10,policy=exact"], tmp_path / "exact")
    assert exact == hf
    _, err = _cli(["attnopt.lm_eval", "--model", "attnopt", "--model_args",
                   f"pretrained={tiny_dir},prefix_token_id=10,policy=linear,tolerance=10,e2e_tolerance=none"],
                  tmp_path / "linear")
    assert f"attnopt: {tiny_dir} compiled with linear: 4/4 sites rewritten" in err
