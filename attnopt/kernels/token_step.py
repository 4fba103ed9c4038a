"""The in-place one-token decoding step of a packed [S ‖ z] state, shared by linear and ssm.

Built once per sequence (per cache layer, `SiteModule.token_stepper`): the views of the state, the
[v ‖ 1] and product buffers, φ, γ and ε are fixed then, so a token costs the handful of small ops
the sums need (φ(q), φ(k), the γ decay, one outer-product update, one product for numerator and
denominator, the ratio) and no Python beyond them. On a CPU such a step is as fast as it has few
ops: each one pays a fixed dispatch cost far above its arithmetic.

Letters: B batch, H query heads, Hf heads the features are computed for (kv heads, or query heads
for maps that differ per head), G = H / Hf, M feature count, W value columns (Dv, plus one when a
ones column carries the normaliser z).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def elu_plus_one(x: Tensor) -> Tensor:
    """φ(x) = ELU(x) + 1, the +1 added in place (one allocation, not two)."""
    return F.elu(x).add_(1.0)


class PackedStateStep:
    """Advance T = [S ‖ z] [B, H, M, W] by one token IN PLACE and return that token's output
    [B, 1, H, Dv], in the layout attention functions hand back (no transpose after it).

    T is per query head (the G heads of a kv head hold equal copies, as the general step keeps
    them); the update broadcasts φ(k) ⊗ [v ‖ 1] over G. `state` is the form state whose tensors
    are views of T: the cache layer keeps this step while its state is that very object.
    """

    __slots__ = ("state", "q_dtype", "_cdt", "_features", "_T", "_T_upd", "_T_bmm", "_v1", "_v_in", "_nd",
                 "_num", "_den", "_prod", "_prod_M", "_decay", "_guard", "_out_scale", "_shape", "_repeat_k",
                 "_phi", "_inference")

    def __init__(self, T_BHMW: Tensor, state, q_dtype: torch.dtype, features: Callable[[Tensor], Tensor], *,
                 kv_heads: int, per_head: bool = False, normalize: bool = True, eps: float = 0.0,
                 guard_zero: bool = False, decay_H: Optional[Tensor] = None, out_scale: float = 1.0):
        B, H, M, W = T_BHMW.shape
        Dv = W - 1 if normalize else W
        Hf = H if per_head else kv_heads
        G = H // Hf
        self.state, self.q_dtype, self._cdt = state, q_dtype, T_BHMW.dtype
        self._features = features
        self._T = T_BHMW
        self._T_upd = T_BHMW.view(B, Hf, G, M, W)
        self._T_bmm = T_BHMW.view(B * H, M, W)
        # [v ‖ 1] per feature head; v is copied into its first Dv columns (repeated G' = Hf / Hkv
        # times when the features are per query head), the ones column stays.
        self._v1 = T_BHMW.new_ones(B, Hf, 1, 1, W)
        # v [B, Hkv, 1, Dv] is copied in as it comes (no view per call) unless it must be repeated.
        r = Hf // kv_heads
        self._v_in = self._v1[:, :, 0, :, :Dv] if r == 1 else self._v1[..., :Dv].view(B, kv_heads, r, 1, Dv)
        self._nd = T_BHMW.new_empty(B * H, 1, W)
        # Read as [B, 1, H, ·] (Nq = 1 makes it the same memory): the ratio comes out [B, 1, H, Dv], dense.
        nd_B1HW = self._nd.view(B, H, 1, W).transpose(1, 2)
        self._num, self._den = nd_B1HW[..., :Dv], nd_B1HW[..., Dv:]
        # φ(q)ᵀT as a product and a sum over M, not a batched matmul: a gemm this small runs on the
        # thread pool (waking it costs more than the arithmetic), these two stay on the calling
        # thread. Row M of the product buffer holds [0 … 0 ε], so the sum adds ε with no op of its own.
        self._prod = T_BHMW.new_zeros(B * H, M + 1, W)
        if normalize:
            self._prod[:, M, Dv] = float(eps)
        self._prod_M = self._prod[:, :M]
        self._decay = None if decay_H is None else decay_H.to(T_BHMW.dtype).view(1, H, 1, 1)
        self._guard, self._out_scale = bool(guard_zero), float(out_scale)
        self._shape = (B, H, Hf, M, Dv, normalize)
        self._repeat_k = H // kv_heads if per_head and kv_heads != H else 0
        # ELU + 1 writes φ(q), φ(k) into the two halves of one buffer made here, then adds a 0-dim one
        # to both at once (a Python scalar costs a wrapped tensor per call); other maps return new tensors.
        self._phi = None
        if features is elu_plus_one:
            phi_qk = T_BHMW.new_empty(B * (H + Hf) * M)
            phi_q, phi_k = phi_qk[:B * H * M].view(B, H, 1, M), phi_qk[B * H * M:].view(B, Hf, 1, M)
            self._phi = (phi_qk, phi_q, phi_k, phi_q.view(B * H, M, 1), phi_k.view(B, Hf, 1, M, 1), T_BHMW.new_ones(()))
        # Inference tensors (a state or buffers made under torch.inference_mode) take in-place writes
        # only inside that mode: then the writes run in it. Otherwise they run as they are (the
        # layer steps only without grad), which spares the mode switch on every token.
        self._inference = T_BHMW.is_inference() or torch.is_inference_mode_enabled()

    def __call__(self, q_BH1D: Tensor, k_BHkv1D: Tensor, v_BHkv1D: Tensor) -> Tensor:
        if q_BH1D.dtype != self._cdt:
            q_BH1D, k_BHkv1D, v_BHkv1D = q_BH1D.to(self._cdt), k_BHkv1D.to(self._cdt), v_BHkv1D.to(self._cdt)
        if self._repeat_k:
            k_BHkv1D = k_BHkv1D.repeat_interleave(self._repeat_k, dim=1)
        if self._inference:
            with torch._C._InferenceMode(True):
                self._advance(q_BH1D, k_BHkv1D, v_BHkv1D)
        else:
            self._advance(q_BH1D, k_BHkv1D, v_BHkv1D)
        # The output is made outside inference mode: a normal tensor the model may modify.
        if self._shape[-1]:  # normalised
            den = self._den
            if self._guard:  # φ(q)ᵀz may be exactly 0 here: that row is 0, as the general step gives
                den = torch.where(den == 0, 1.0, den)
            out = torch.div(self._num, den)
        else:
            out = self._num * self._out_scale  # (W = Dv: the whole product)
        return out if out.dtype == self.q_dtype else out.to(self.q_dtype)

    def _advance(self, q_BH1D: Tensor, k_BH1D: Tensor, v_BHkv1D: Tensor) -> None:
        """T ← γ·T + φ(k) ⊗ [v ‖ 1]; then φ(q)ᵀT + [0 … 0 ε] into the product buffer."""
        if self._phi is not None:
            phi_qk, phi_q, phi_k, phi_q_col, phi_k_upd, one = self._phi
            torch._C._nn.elu(q_BH1D, out=phi_q)
            torch._C._nn.elu(k_BH1D, out=phi_k)
            phi_qk.add_(one)
        else:
            B, H, Hf, M, Dv, _ = self._shape
            phi_q_col = self._features(q_BH1D).view(B * H, M, 1)  # φ(q) [B, H, 1, M] as [B·H, M, 1]
            phi_k_upd = self._features(k_BH1D).view(B, Hf, 1, M, 1)  # φ(k) [B, Hf, 1, M]
        v_in = self._v_in
        v_in.copy_(v_BHkv1D if v_in.dim() == 4 else v_BHkv1D.view(v_in.shape[0], v_in.shape[1], 1, 1, v_in.shape[-1]))
        if self._decay is not None:
            self._T.mul_(self._decay)
        self._T_upd.addcmul_(phi_k_upd, self._v1)
        torch.mul(phi_q_col, self._T_bmm, out=self._prod_M)
        torch.sum(self._prod, 1, keepdim=True, out=self._nd)
