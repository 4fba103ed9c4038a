"""A hand-written model for `attnopt inspect examples/custom_model.py:build` and `attnopt compile ...`."""

import math

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, n, c = x.shape
        d = c // self.heads
        q = self.q(x).view(b, n, self.heads, d).transpose(1, 2)
        k = self.k(x).view(b, n, self.heads, d).transpose(1, 2)
        v = self.v(x).view(b, n, self.heads, d).transpose(1, 2)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = (q * d**-0.5) @ k.transpose(-2, -1)
        scores = scores.masked_fill(~causal, float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return x + self.o(y.transpose(1, 2).reshape(b, n, c))


class TinyLM(nn.Module):
    def __init__(self, layers=4, dim=64):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build():
    """(model, example_args) for the attnopt CLI."""
    torch.manual_seed(0)
    return TinyLM().eval(), (torch.randn(2, 96, 64),)
