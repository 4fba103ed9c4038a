"""gla+window on the Triton kernels (forward): the window kernel and the GLA kernel, combined.

`attnopt.forms.gla_window.reference.gla_window_attention` is the window softmax's output o_W with its
log-sum-exp, and the gated sums [num_L, den_L] over the keys that left the window, combined under one
normaliser. Here each half runs on its own form's Triton kernel: the window form's forward kernel
(`attnopt_triton::window`, which writes the row log-sum-exp in log2 units for its backward) and the
gla form's chunked forward kernel on the shifted, pre-decayed keys and [v, 1] (unnormalised, scale
1) -- both built exactly as the reference op builds them (its `window_gate_sums`, `combine`). The
glue between them is a few elementwise PyTorch ops. A row whose window sees no key (a dropped
query with nothing kept in its band and no sink before it) has no log-sum-exp: it is found from
the key mask on the host (O(N)). Forward only: a call that needs gradients runs on the PyTorch path.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.gla.triton import MAX_FEATURES
from attnopt.forms.gla.triton import gated_linear_attention as gla_kernel
from attnopt.forms.gla_window.reference import beta_tensor, check_inputs, combine, window_gate_sums
from attnopt.forms.window.reference import sink_key_mask
from attnopt.forms.window.triton import window_forward, window_unsupported
from attnopt.kernels.triton.band import clamp_window, sink_range
from attnopt.kernels.triton.runtime import launch, require_runtime, scale_or_default, shared_checks

__all__ = ["gla_window_attention", "unsupported", "gla_window_unsupported"]


def gla_window_unsupported(q: Tensor, phi_q=None, phi_k=None, g=None, k=None, v=None, linear_weight=None,
                           **_) -> Optional[str]:
    """This composition's own limits (after the checks every form's kernels share), one line, or None."""
    who = "gla_window_attention"
    reason = window_unsupported(q)
    if reason:
        return reason
    if phi_k is not None and phi_k.shape[-1] > MAX_FEATURES:
        return f"{who}: {phi_k.shape[-1]} features exceed the GLA kernel's {MAX_FEATURES}"
    tensors = (q, k, v, phi_q, phi_k, g, linear_weight)
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors):
        return f"{who}: the Triton path is forward-only; a call that needs gradients runs on the PyTorch path"
    return None


unsupported = shared_checks(gla_window_unsupported)


def window_seen(keep_BN: Tensor, Nq: int, window: int, sinks: int) -> Tensor:
    """Bool [B, Nq]: the query's window holds a kept key (its band, or a sink before it)."""
    Nk = keep_BN.shape[1]
    count = F.pad(keep_BN.long().cumsum(1), (1, 0))  # count[j] = kept keys before position j
    p = (Nk - Nq) + torch.arange(Nq, device=keep_BN.device)
    before_band = count[:, (p - window + 1).clamp_min(0)]
    seen = count[:, p + 1] > before_band
    if sinks:
        seen = seen | (before_band > 0)
    return seen


def gla_window_attention(q: Tensor, k: Tensor, v: Tensor, phi_q: Tensor, phi_k: Tensor, g: Tensor, *, window: int,
                         sinks: int = 0, scale: Optional[float] = None, linear_weight: Union[float, Tensor] = 1.0,
                         key_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """`attnopt.forms.gla_window.reference.gla_window_attention` (forward) on the window and GLA
    Triton kernels; same arguments and result. `chunk_size` is accepted for compatibility."""
    who = "gla_window_attention"
    check_inputs(q, k, v, phi_q, phi_k, g, key_mask, window, sinks)
    require_runtime(who, q)
    beta = beta_tensor(linear_weight, q.shape[1], q)
    reason = unsupported(q, k=k, v=v, phi_q=phi_q, phi_k=phi_k, g=g, linear_weight=beta)
    if reason:
        raise ValueError(reason)
    B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
    keep = torch.ones(B, Nk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    sinkr = sink_range(key_mask, B, Nk, sinks, q.device)
    o_w, lse2 = launch("window", window_forward, q, k, v, key_mask, sinkr, clamp_window(window, Nq, Nk), True,
                       scale_or_default(q, scale))
    lse = torch.where(window_seen(keep, Nq, window, sinks)[:, None, :], lse2.float() * math.log(2.0), float("-inf"))

    g4 = (g if g.dim() == 4 else g[..., None]).float() * keep[:, None, :, None]
    lin_keep = (keep & ~sink_key_mask(key_mask, sinks, B, Nk, q.device))[:, None, :, None]
    fk = phi_k.float() * lin_keep * torch.exp(window_gate_sums(g4, window))
    v1 = torch.cat([v.float(), torch.ones_like(v[..., :1], dtype=torch.float32)], dim=-1) * lin_keep
    shift = min(window, Nk)
    fk, v1 = F.pad(fk, (0, 0, shift, 0))[:, :, :Nk], F.pad(v1, (0, 0, shift, 0))[:, :, :Nk]
    gg = g4 if g.dim() == 4 else g4[..., 0]
    lin = gla_kernel(phi_q.float(), fk.contiguous(), v1.contiguous(), gg.contiguous(), feature_map="identity",
                     normalize=False, scale=1.0)
    return combine(o_w.float(), lse, lin, beta.float()).to(q.dtype)
