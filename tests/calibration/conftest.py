"""The trained byte-level LM (benchmarks/train_tiny_lm.py) as a fixture for the calibration tests."""

from pathlib import Path

import pytest
import torch

TINY_LM = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "tiny_lm"


@pytest.fixture(scope="session")
def tiny_lm():
    """(model, calibration batches, held-out batches) of the trained tiny LM on its own text."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(TINY_LM).eval()
    text = (TINY_LM / "heldout.txt").read_text(encoding="utf-8").encode("utf-8")
    ids = torch.tensor(list(text[: 12 * 160]), dtype=torch.long).reshape(12, 160)
    batches = [{"input_ids": ids[i : i + 2]} for i in range(0, 12, 2)]
    return model, batches[:4], batches[4:]
