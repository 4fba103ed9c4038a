"""Decayed linear attention (RetNet retention / diagonal SSM) prefill on the Triton chunk scan.

o_t = s Σ_{j<=t} γ_h^(t-j) (φ(q_t)·φ(k_j)) v_j (normalize=False, s = scale, default 1/√D), or
the same sum over Σ_{j<=t} γ_h^(t-j) φ(q_t)·φ(k_j) + eps (normalize=True, no scale): the semantics
of `attnopt.forms.ssm.reference.decay_attention`, whose checks this reuses. Queries are the last Nq
positions (Nq <= Nk); a dropped key (key_mask False) adds nothing but its position still decays.
Forward and backward are the Triton kernels of `chunk_scan` with HAS_DECAY; γ enters as log2 γ.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor
from torch.library import triton_op

from attnopt.forms.ssm.schedule import DECAY_FEATURE_MAPS, retnet_decay
from attnopt.kernels.triton.chunk_scan import chunk_backward, chunk_forward
from attnopt.kernels.triton.differentiable import differentiable
from attnopt.kernels.triton.runtime import FMAP_CODES, checked_call, concrete, scale_or_default, shared_checks
from attnopt.kernels.triton.state_step import check_one_token, state_step


def _gamma(decay, H: int) -> Tensor:
    """None / "retnet" / float / H floats / tensor [H] -> float64 [H] in (0, 1] (a tensor keeps its device)."""
    if decay is None or (isinstance(decay, str) and decay == "retnet"):
        gamma = retnet_decay(H)
    elif isinstance(decay, Tensor):
        gamma = decay.detach().to(torch.float64).reshape(-1)
        gamma = gamma.expand(H) if gamma.numel() == 1 else gamma
        if not concrete(gamma):  # traced: shape checked, values unknown
            if tuple(gamma.shape) != (H,):
                raise ValueError(f"decay_attention: need one decay per query head (H={H}), got {tuple(gamma.shape)}")
            return gamma
    elif isinstance(decay, (int, float)) and not isinstance(decay, bool):
        gamma = torch.full((H,), float(decay), dtype=torch.float64)
    elif isinstance(decay, Sequence) and not isinstance(decay, str):
        gamma = torch.tensor([float(g) for g in decay], dtype=torch.float64)
    else:
        raise TypeError(f"decay_attention: decay must be None, 'retnet', a float, {H} floats or a tensor [H]; got {decay!r}")
    if tuple(gamma.shape) != (H,):
        raise ValueError(f"decay_attention: need one decay per query head (H={H}), got shape {tuple(gamma.shape)}")
    if not bool(((gamma > 0) & (gamma <= 1)).all()):
        raise ValueError(f"decay_attention: every decay γ must lie in (0, 1]; got {gamma.tolist()}")
    return gamma


@triton_op("attnopt_triton::decay", mutates_args={})
def _decay_op(
    q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], log2g: Tensor, fmap: int, normalize: bool,
    scale: float, eps: float,
) -> tuple[Tensor, Tensor]:
    return chunk_forward(q, k, v, keep, log2g, fmap, normalize, scale, eps, wrap=True)


@triton_op("attnopt_triton::decay_backward", mutates_args={})
def _decay_backward_op(
    g: Tensor, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor], log2g: Tensor, out: Tensor, den: Tensor,
    fmap: int, normalize: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return chunk_backward(g, q, k, v, keep, log2g, out, den, fmap, normalize, scale, wrap=True)


# the backward reads q, k, v, keep, log2g, (out, den) and the options fmap, normalize, scale
_decay = differentiable(_decay_op, _decay_backward_op, chunk_forward, chunk_backward, saved=5, opts=(5, 6, 7))


def decay_unsupported(q: Tensor, feature_map="identity", state=None, **_) -> Optional[str]:
    if state is not None:
        return "decay_attention: a carried state (decoding / chunked prefill) runs on the PyTorch path"
    if feature_map not in DECAY_FEATURE_MAPS:
        return f"decay_attention: unknown feature map {feature_map!r}"
    return None


unsupported = shared_checks(decay_unsupported)


def decay_attention(q: Tensor, k: Tensor, v: Tensor, *, decay: Union[None, float, Sequence[float], Tensor] = None,
                    feature_map: str = "identity", normalize: bool = False, scale: Optional[float] = None,
                    eps: float = 1e-6, key_mask: Optional[Tensor] = None, chunk_size: int = 64) -> Tensor:
    """`attnopt.forms.ssm.reference.decay_attention` (stateless) on the Triton kernels; same arguments and
    result. `chunk_size` is accepted for compatibility: the kernels pick their own."""
    checked_call("decay_attention", q, k, v, key_mask, lambda: decay_unsupported(q, feature_map), causal="decay")
    log2g = torch.log2(_gamma(decay, q.shape[1])).to(device=q.device, dtype=torch.float32)
    return _decay(q, k, v, key_mask, log2g, FMAP_CODES[feature_map], bool(normalize), scale_or_default(q, scale),
                  float(eps))


def decay_decode_step(q_t: Tensor, k_t: Tensor, v_t: Tensor, state: Optional[tuple], *,
                      decay: Union[None, float, Sequence[float], Tensor] = None, feature_map: str = "identity",
                      normalize: bool = False, scale: Optional[float] = None, eps: float = 1e-6):
    """`attnopt.forms.ssm.reference.decay_attention_step` on a Triton kernel; same arguments and result."""
    who = "decay_decode_step"
    check_one_token(who, q_t, k_t, v_t)
    B, H, _, D = q_t.shape
    Dv = v_t.shape[3]
    if state is None:
        state = (q_t.new_zeros(B, H, D, Dv, dtype=torch.float32),
                 q_t.new_zeros(B, H, D, dtype=torch.float32) if normalize else None)
    S, z = state
    if normalize and z is None:
        raise ValueError(f"{who}: normalize=True needs the state's z [B, H, D]")
    log2g = torch.log2(_gamma(decay, H)).to(device=q_t.device, dtype=torch.float32)
    out, S, z = state_step(q_t, k_t, v_t, S, z if normalize else None, log2g, FMAP_CODES[feature_map],
                            bool(normalize), scale_or_default(q_t, scale), float(eps))
    return out, (S, z)
