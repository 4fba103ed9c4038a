"""Check that cached generation under torch.compile equals eager generation and decodes from the
sites' states (about a minute on 2 CPU cores, so it is not in the test suite).

    python benchmarks/check_compile_decode.py     # exits non-zero on a mismatch
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import transformers  # noqa: E402

import attnopt  # noqa: E402
from attnopt.hf.cache import SiteCacheLayer  # noqa: E402


def main() -> int:
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    am = torch.ones_like(ids)
    ids[1, :4], am[1, :4] = 0, 0  # left padding
    opt = attnopt.compile(base, "linear", example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False},
                          e2e_tolerance=None, dispatch="off")

    def generate():
        with torch.no_grad():
            out = opt.generate(input_ids=ids, attention_mask=am, max_new_tokens=10, do_sample=False, pad_token_id=0,
                               output_logits=True, return_dict_in_generate=True)
        return out.sequences, torch.stack(out.logits, 1), getattr(out, "cache", None) or out.past_key_values

    seq, logits, _ = generate()
    torch._dynamo.reset()
    opt.forward = torch.compile(opt.forward)
    seq_c, logits_c, cache = generate()
    err = (logits - logits_c).abs().max().item()
    stateful = all(isinstance(layer, SiteCacheLayer) for layer in cache.layers)
    print(f"sequences equal: {torch.equal(seq, seq_c)}, max logit difference {err:.2e}, every layer a SiteCacheLayer: {stateful}")
    return 0 if torch.equal(seq, seq_c) and err < 1e-5 and stateful else 1


if __name__ == "__main__":
    sys.exit(main())
