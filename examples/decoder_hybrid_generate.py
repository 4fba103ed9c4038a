"""A long-context Llama-style decoder under the hybrid policy: compile, then prefill + generate().

    python examples/decoder_hybrid_generate.py                     # 4096-token prompt, 16 new tokens
    python examples/decoder_hybrid_generate.py --prompt 128 --layers 3 --hidden 64 --new 4

The weights are random (built from a config, nothing downloaded), so only the mechanics and the
timings mean something: the compiled model keeps its class, so `generate()` and its KV cache work.
`hybrid` keeps the first and last layers exact, windows the first third (window:64+sinks:4) and
linearises the rest; each rewritten site runs exact attention below its measured crossover length.
"""

import argparse
import time
import warnings

import torch
import transformers

import attnopt


def build(layers: int, hidden: int, max_len: int):
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=max_len)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    p.add_argument("--new", type=int, default=16, help="tokens to generate")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args(argv)
    model = build(a.layers, a.hidden, max(a.prompt + a.new, 2048))
    example = {"input_ids": torch.randint(1, 1000, (1, 128), generator=torch.Generator().manual_seed(0)),
               "use_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: the budget is off, so no warning says anything
        opt = attnopt.compile(model, "hybrid", example_inputs=example, e2e_tolerance=None)
    report = opt.attnopt_report
    for r in report.sites:
        th = "" if r.threshold is None else f", exact below {r.threshold.min_seq_len} ({r.threshold.source})"
        print(f"layer {r.site.layer}: {r.outcome.final_form}{th}")

    prompt = torch.randint(1, 1000, (1, a.prompt), generator=torch.Generator().manual_seed(1))
    results = {}
    for name, m in (("original", model), ("hybrid", opt)):
        with torch.inference_mode():
            t = time.perf_counter()
            out = m.generate(prompt, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
            results[name] = (out[0, a.prompt:], time.perf_counter() - t)
        print(f"{name}: {a.prompt}-token prompt + {a.new} new tokens in {results[name][1]:.2f} s")
    return report, results


if __name__ == "__main__":
    main()
