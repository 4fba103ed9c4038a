"""Small decoders for the calibration tests: a seeded random Llama and its token batches."""

import torch


def random_llama(seed: int = 0, layers: int = 2):
    import transformers

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def id_batches(n: int, length: int = 48, batch: int = 2, seed: int = 0, vocab: int = 97):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (batch, length), generator=g)} for _ in range(n)]


_COMPILED: dict = {}


def compiled_llama(policy: str, layers: int = 2, batches=None):
    """A fresh copy of random_llama(layers) compiled with `policy` on id_batches(4)[0] (compiled once per
    process: torch.export dominates the cost, and calibrate changes its model in place)."""
    import copy

    import attnopt

    key = (policy, layers)
    if key not in _COMPILED:
        _COMPILED[key] = attnopt.compile(random_llama(layers=layers), policy, example_inputs=id_batches(4)[0],
                                         tolerance=10.0, e2e_tolerance=None)
    return copy.deepcopy(_COMPILED[key])
