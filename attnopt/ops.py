"""Public ops: each rewrite form as a function over SDPA-layout tensors (q [B, H, N, D], k/v [B, Hkv, N, D]).

Each is backed by a `torch.library` custom op (one node under torch.export, fake and autograd
registered) and has an explicit quadratic reference alongside for testing.
"""

from attnopt.kernels.decay import decay_attention, decay_attention_step, retnet_decay
from attnopt.kernels.feature_maps import favor_projection, make_feature_map
from attnopt.kernels.linear import linear_attention
from attnopt.kernels.reuse import init_reuse_factors, reuse_attention, reuse_savings
from attnopt.kernels.window import window_attention

__all__ = [
    "linear_attention",
    "window_attention",
    "decay_attention",
    "decay_attention_step",
    "retnet_decay",
    "reuse_attention",
    "init_reuse_factors",
    "reuse_savings",
    "make_feature_map",
    "favor_projection",
]
