"""Detection on sequences longer than the replay sample (REPLAY_ROWS query rows)."""

import torch
import torch.nn.functional as F

import attnopt
from attnopt.passes.replay import REPLAY_ROWS

B, H, N, D = 2, 3, REPLAY_ROWS + 45, 8


class CausalSdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


class MaskedSdpa(torch.nn.Module):
    """HF-style: a [B, 1, N, N] additive mask built inside from a [B, N] padding input."""

    def forward(self, q, k, v, keep_BN):
        n = q.shape[-2]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        keep = causal[None, None] & keep_BN[:, None, None, :].bool()
        mask = torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g) for _ in range(3))


def test_long_causal_site_is_checked_on_sampled_rows():
    (site,) = attnopt.inspect(CausalSdpa(), *_qkv(), dynamic=False).sites
    assert (site.q_len, site.kv_len, site.heads, site.causal, site.scale) == (N, N, H, True, 0.3)


def test_long_padded_causal_mask_is_classified_once_per_batch():
    keep = torch.ones(B, N, dtype=torch.long)
    keep[1, :7] = 0
    (site,) = attnopt.inspect(MaskedSdpa(), *_qkv(), keep, dynamic=False).sites
    assert site.causal and site.mask.padding and not site.mask.arbitrary and site.window is None
