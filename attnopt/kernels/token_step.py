"""The in-place one-token decoding step of a packed [S ‖ z] state, shared by linear and ssm.

Built once per sequence (per cache layer, `SiteModule.token_stepper`): the views of the state, the
[v ‖ 1] and product buffers, φ, γ and ε are fixed then, so a token costs the handful of small ops
the sums need (φ(q), φ(k), the γ decay, one outer-product update, one product for numerator and
denominator, the ratio) and no Python beyond them. On a CPU such a step is as fast as it has few
ops: each one pays a fixed dispatch cost far above its arithmetic. So where the C library of
`attnopt/kernels/native` loads, a float32 CPU step (φ = ELU + 1) is one C call instead (`NativeCall`,
which the window's ring step uses too).

Letters: B batch, H query heads, Hf heads the features are computed for (kv heads, or query heads
for maps that differ per head), G = H / Hf, M feature count, W value columns (Dv, plus one when a
ones column carries the normaliser z).
"""

from __future__ import annotations

import ctypes
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.kernels import native


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
                 "_phi", "_inference", "_native")

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
        self._native = None
        if self._phi is not None and Hf == kv_heads and q_dtype == torch.float32:
            self._native = NativeCall.packed(T_BHMW, self._decay, kv_heads, Dv, normalize, eps, guard_zero, out_scale)

    def __call__(self, q_BH1D: Tensor, k_BHkv1D: Tensor, v_BHkv1D: Tensor) -> Tensor:
        nat = self._native
        if nat is not None and nat.takes(q_BH1D, k_BHkv1D, v_BHkv1D):
            return nat(q_BH1D, k_BHkv1D, v_BHkv1D)
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


class NativeCall:
    """One C step (`attnopt/kernels/native/token_step.c`) bound to a state's buffers: the whole step in
    one call, for float32 CPU inputs of the shapes it was made for (anything else takes the torch ops,
    which compute the same). The ring's step also takes the slot to write."""

    __slots__ = ("_fn", "_args", "_address", "_shapes", "_out", "_keep")

    def __init__(self, fn, args, shapes: tuple, out_shape: tuple, keep: tuple):
        self._fn, self._args, self._address = fn, args, ctypes.addressof(args)
        self._shapes, self._keep = shapes, keep  # (keep: what the pointers point into)
        self._out = torch.empty(out_shape)  # the output's pattern: empty_like is the cheapest allocation

    @classmethod
    def packed(cls, T_BHMW: Tensor, decay: Optional[Tensor], kv_heads: int, Dv: int, normalize: bool,
               eps: float, guard_zero: bool, out_scale: float) -> Optional["NativeCall"]:
        """The [S ‖ z] step (φ = ELU + 1, features per kv head), or None where the C step cannot take it."""
        lib = native.library()
        B, H, M, W = T_BHMW.shape
        if lib is None or not _dense_f32_cpu(T_BHMW) or max(M, Dv) > native.MAX_DIM or H % kv_heads:
            return None
        gamma = None if decay is None else decay.reshape(H).to(torch.float32).contiguous()
        args = native.PackedStep(T_BHMW.data_ptr(), None if gamma is None else gamma.data_ptr(), B, H, kv_heads, M, Dv,
                                 int(normalize), int(guard_zero), float(eps), float(out_scale))
        return cls(lib.attnopt_packed_step, args, ((B, H, 1, M), (B, kv_heads, 1, M), (B, kv_heads, 1, Dv)),
                   (B, 1, H, Dv), (T_BHMW, gamma))

    @classmethod
    def ring(cls, k_BHkvSD: Tensor, v_BHkvSD: Tensor, H: int, scale: float) -> Optional["NativeCall"]:
        """The ring's step (write the slot, softmax over every slot), or None where the C step cannot take it."""
        lib = native.library()
        B, Hkv, S, D = k_BHkvSD.shape
        Dv = v_BHkvSD.shape[-1]
        if (lib is None or not (_dense_f32_cpu(k_BHkvSD) and _dense_f32_cpu(v_BHkvSD)) or S > native.MAX_DIM
                or H % Hkv):
            return None
        args = native.RingStep(k_BHkvSD.data_ptr(), v_BHkvSD.data_ptr(), B, H, Hkv, S, D, Dv, float(scale))
        return cls(lib.attnopt_ring_step, args, ((B, H, 1, D), (B, Hkv, 1, D), (B, Hkv, 1, Dv)), (B, 1, H, Dv),
                   (k_BHkvSD, v_BHkvSD))

    def takes(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """float32 CPU tensors of the bound shapes, each dense (Nq = 1: a [B, 1, H, D] tensor seen as
        [B, H, 1, D] is dense too)."""
        sq, sk, sv = self._shapes
        return (q.dtype is k.dtype is v.dtype is torch.float32 and q.is_cpu and k.is_cpu and v.is_cpu
                and q.shape == sq and k.shape == sk and v.shape == sv
                and q.is_contiguous() and k.is_contiguous() and v.is_contiguous())

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *slot: int) -> Tensor:
        """out [B, 1, H, Dv], a new tensor; the state's buffers advanced in place."""
        out = torch.empty_like(self._out)
        if self._fn(self._address, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), *slot):
            raise RuntimeError(f"attnopt: the native token step refused its inputs (a dimension over {native.MAX_DIM}); "
                               f"set {native.ENV_SWITCH}=0 to run the torch step")
        return out


def _dense_f32_cpu(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
