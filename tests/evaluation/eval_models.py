"""Hand-made models for the audit's tests: one that retrieves by construction, one that cannot."""

import numpy as np
import torch
from torch import nn


class InductionLM(nn.Module):
    """Perfect copying without attention: at each position, predict the token that followed the longest
    earlier match (up to `k` tokens) of the suffix ending there; no match, no preference (all logits 0).
    Token ids in, logits [B, N, vocab] out; no generate()."""

    def __init__(self, vocab: int = 256, k: int = 16):
        super().__init__()
        self.vocab, self.k = vocab, k
        self.register_buffer("anchor", torch.zeros(1))  # a device for the audit to read

    def forward(self, ids_BN: torch.Tensor) -> torch.Tensor:
        b, n = ids_BN.shape
        logits = torch.zeros(b, n, self.vocab)
        for row in range(b):
            seq = ids_BN[row].cpu().numpy()
            match = np.zeros(n, dtype=np.int64)  # match[j]: length of the common suffix ending at j and at t
            for t in range(n):
                prev = np.concatenate([[0], match[:-1]])
                match = np.where(seq == seq[t], np.minimum(prev + 1, self.k), 0)
                match[t:] = 0  # only earlier positions, and j + 1 must exist before t + 1
                if match.max() > 0:
                    j = np.flatnonzero(match == match.max())[-1]  # the longest, then the latest
                    logits[row, t, int(seq[j + 1])] = 1.0
        return logits


class ConstantLM(nn.Module):
    """Always predicts token `token` (never a digit or a letter): retrieves nothing."""

    def __init__(self, vocab: int = 256, token: int = ord("~")):
        super().__init__()
        self.vocab, self.token = vocab, token
        self.register_buffer("anchor", torch.zeros(1))

    def forward(self, ids_BN: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids_BN.shape, self.vocab)
        logits[..., self.token] = 1.0
        return logits


def induction_causal_lm(vocab_size: int = 256):
    """InductionLM as a transformers causal LM with generate() (no cache: each step reads the whole
    sequence), so the audit's generate() scoring runs on a model that retrieves."""
    from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class InductionConfig(PretrainedConfig):
        model_type = "attnopt_test_induction"

        def __init__(self, vocab_size: int = 256, **kwargs):
            self.vocab_size = vocab_size
            super().__init__(**kwargs)

    class InductionForCausalLM(PreTrainedModel, GenerationMixin):
        config_class = InductionConfig

        def __init__(self, config):
            super().__init__(config)
            self.core = InductionLM(config.vocab_size)
            self.unused = torch.nn.Parameter(torch.zeros(1))  # transformers reads the device from a parameter
            self.post_init()

        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            return CausalLMOutputWithPast(logits=self.core(input_ids))

    model = InductionForCausalLM(InductionConfig(vocab_size=vocab_size, use_cache=False)).eval()
    model.generation_config = GenerationConfig(use_cache=False)
    return model


def forgetful_decoder(window: int = 64):
    """induction_causal_lm whose generate() reads only the last `window` tokens: a decode path that has
    lost what the full forward still sees (a broken decode state, made on purpose)."""
    model = induction_causal_lm()
    plain_forward, plain_generate = model.forward, model.generate

    def forward(input_ids=None, **kwargs):
        return plain_forward(input_ids[:, -window:] if model.decoding else input_ids, **kwargs)

    def generate(*args, **kwargs):
        model.decoding = True
        try:
            return plain_generate(*args, **kwargs)
        finally:
            model.decoding = False

    model.decoding = False
    model.forward, model.generate = forward, generate
    return model
