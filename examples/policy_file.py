"""A policy file with per-layer rules (examples/hybrid_policy.yaml), applied to a decoder.

    python examples/policy_file.py                                   # the YAML beside this script
    python examples/policy_file.py my_policy.yaml --layers 6 --tokens 256

Rules are tried in order, first match wins; `layers` takes indices, ranges and percentages of the
depth ("1..33%"), negative indices count from the end. The report says which rule chose each site.
"""

import argparse
import os
import warnings

import torch
import transformers

import attnopt
from attnopt.policy import Policy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("policy", nargs="?", default=os.path.join(os.path.dirname(__file__), "hybrid_policy.yaml"))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens of the example input")
    p.add_argument("--positions", type=int, default=4096, help="the model's position limit")
    a = p.parse_args(argv)
    policy = Policy.from_file(a.policy)
    print(policy.describe())
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=2,
                                      max_position_embeddings=a.positions)
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    example = {"input_ids": torch.randint(1, 1000, (1, a.tokens), generator=torch.Generator().manual_seed(0)),
               "use_cache": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: the numbers below say what a warning would
        opt = attnopt.compile(model, policy, example_inputs=example, e2e_tolerance=None)
    for r in opt.attnopt_report.sites:
        print(f"layer {r.site.layer}: {r.plan.rule or 'no rule'} -> {r.outcome.final_form} ({r.outcome.status})")
    return opt.attnopt_report


if __name__ == "__main__":
    main()
