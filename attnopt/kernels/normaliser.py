"""The normaliser z of a linear-state op carried as one more value column, and split off again.

A normalised op reads o = φ(q)ᵀS / (φ(q)ᵀz + ε) with z = the (decayed, gated) sum of φ(k). Giving v a
column of ones makes every product with the keys yield numerator and denominator together: the
state travels as one tensor T = [S ‖ z] [B, H, M, Dv + 1] (W = Dv + 1 value columns) and the output
as [num ‖ den]. Unnormalised, T is S itself and W = Dv. The forms' prefills, decode steps and
in-place token steps all keep their state this way; this module packs and unpacks it.

Letters: B batch, H heads of the state, N length, M feature count, Dv value width, W = Dv (+ 1).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.kernels.layout import ratio_or_zero


def with_ones(v_BHNDv: Tensor, normalize: bool) -> Tensor:
    """[v ‖ 1] [B, H, N, Dv + 1] when normalising (the ones column sums the denominator), else v."""
    return torch.cat([v_BHNDv, torch.ones_like(v_BHNDv[..., :1])], dim=-1) if normalize else v_BHNDv


def start_state(S0: Optional[Tensor], z0: Optional[Tensor], shape_BHMDv: tuple, like: Tensor,
                normalize: bool) -> Tensor:
    """T [B, H, M, W] entering a call in `like`'s dtype: the carried (S0, z0), or zeros (no earlier token)."""
    S = S0.to(like.dtype) if S0 is not None else like.new_zeros(shape_BHMDv)
    if not normalize:
        return S
    z = z0.to(like.dtype) if z0 is not None else like.new_zeros(shape_BHMDv[:-1])
    return torch.cat([S, z[..., None]], dim=-1)


def split_state(T_BHMW: Tensor, Dv: int, normalize: bool) -> tuple[Tensor, Optional[Tensor]]:
    """(S [B, H, M, Dv], z [B, H, M]) as views of T, or (T, None) unnormalised."""
    return (T_BHMW[..., :Dv], T_BHMW[..., Dv]) if normalize else (T_BHMW, None)


def join_state(S_BHMDv: Tensor, z_BHM: Optional[Tensor]) -> Tensor:
    """T = [S ‖ z] [B, H, M, Dv + 1]; S itself when there is no z."""
    return S_BHMDv if z_BHM is None else torch.cat([S_BHMDv, z_BHM[..., None]], dim=-1)


def normalised_out(out_BHNW: Tensor, T_BHMW: Tensor, Dv: int, normalize: bool,
                   eps: float) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(out, S, z) of a call that produced [num ‖ den] and the state T: out = num / (den + ε), a row
    whose denominator is exactly 0 being 0; unnormalised, (out, T, None) as they are."""
    if not normalize:
        return out_BHNW, T_BHMW, None
    S, z = split_state(T_BHMW, Dv, normalize)
    return ratio_or_zero(out_BHNW[..., :Dv], out_BHNW[..., Dv:], eps), S, z


def packed_state(S_BHMDv: Tensor, z_BHM: Optional[Tensor], cdt: torch.dtype) -> Tensor:
    """T = [S ‖ z] in `cdt`, the one buffer an in-place token step (`attnopt.kernels.token_step`) updates:
    the tensor (S, z) are views of when they are (then no copy), else made once. S itself (in `cdt`,
    contiguous) when there is no z."""
    if z_BHM is None:
        return S_BHMDv if S_BHMDv.dtype == cdt and S_BHMDv.is_contiguous() else S_BHMDv.to(cdt).contiguous()
    base = S_BHMDv._base
    if (base is not None and base is z_BHM._base and base.dtype == cdt and base.dim() == 4 and base.is_contiguous()
            and base.shape[-1] == S_BHMDv.shape[-1] + 1 and S_BHMDv.data_ptr() == base.data_ptr()
            and z_BHM.data_ptr() == base.data_ptr() + S_BHMDv.shape[-1] * base.element_size()):
        return base
    return join_state(S_BHMDv.to(cdt), z_BHM.to(cdt))


def check_state(who: str, state, sizes: dict, normalize: bool, init: str) -> tuple[Tensor, Optional[Tensor]]:
    """A carried state (S, z): a pair whose S has the four `sizes` ({letter: size}, in order: batch,
    heads, features, values) and whose z has the first three when normalising, else is None.
    TypeError/ValueError naming the fix otherwise (`init` is the function that makes a zero state)."""
    b, h, m, dv = sizes
    S_shape, z_shape, want = f"[{b}, {h}, {m}, {dv}]", f"[{b}, {h}, {m}]", list(sizes.values())
    if not isinstance(state, (tuple, list)) or len(state) != 2:
        raise TypeError(f"{who}: state must be a pair (S {S_shape}, z {z_shape} or None); see {init}")
    S, z = state
    if not isinstance(S, Tensor) or list(S.shape) != want:
        got = list(S.shape) if isinstance(S, Tensor) else type(S).__name__
        raise ValueError(f"{who}: state S must have shape {S_shape} = {want}, got {got}")
    if normalize:
        if not isinstance(z, Tensor) or list(z.shape) != want[:3]:
            raise ValueError(f"{who}: normalize=True needs state z of shape {z_shape} = {want[:3]}; use "
                             f"{init}(..., normalize=True)")
    elif z is not None:
        raise ValueError(f"{who}: state carries z but normalize=False; pass (S, None) or set normalize=True")
    return S, z
