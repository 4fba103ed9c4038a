"""Feature maps φ for linear attention: φ(q)ᵀφ(k) stands in for the softmax kernel exp(s·qᵀk).

Letters: B batch, H query heads, Hkv key/value heads, N sequence length, D head dim, M feature count
(the width φ outputs), P hedgehog projection width (M = 2P), s the softmax scale.

Each map is a small `nn.Module` (so a learnable one can be calibrated) with

* ``num_features(head_dim)`` -- M, the width of φ's output;
* ``forward(x_BHND, scale)`` -- the raw features [B, H, N, M] (for FAVOR+ the unbiased, unstabilised
  estimate; the attention kernel uses the stabilised pair from `query_key_features`);
* ``op_weight()`` -- the one tensor the `attnopt::linear_attention` op needs to rebuild φ
  (FAVOR+ ω [D, M], hedgehog W [H, D, P], else None), so the op stays one graph node.

The functional forms (`FeatureMap.features`) are what the op calls; the modules only hold weights.
Costs per head and position: elu/relu O(D), favor O(D·M), hedgehog O(D·P), taylor O(D²).
"""

from __future__ import annotations

import abc
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FEATURE_MAP_NAMES",
    "resolve_feature_map",
    "FeatureMap",
    "EluFeatureMap",
    "ReluFeatureMap",
    "FavorFeatureMap",
    "HedgehogFeatureMap",
    "TaylorFeatureMap",
    "favor_projection",
    "make_feature_map",
    "feature_map_class",
    "query_key_features",
    "feature_map_of",
]

FEATURE_MAP_NAMES = ("elu", "relu", "favor", "hedgehog", "taylor")


class FeatureMap(nn.Module, abc.ABC):
    """Base class: a named φ with a functional form the custom op can call without the module."""

    name: str = ""
    # True when φ differs per query head (hedgehog): keys are then featurised once per query head.
    per_head: bool = False

    @abc.abstractmethod
    def num_features(self, head_dim: int) -> int:
        """Width M of φ(x) for head dim D."""

    def op_weight(self) -> Optional[Tensor]:
        return None

    def forward(self, x_BHND: Tensor, scale: float) -> Tensor:
        return self.features(x_BHND, scale, self.op_weight())

    @staticmethod
    @abc.abstractmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        """Raw φ(x) [B, H, N, M] from the op's arguments."""


class EluFeatureMap(FeatureMap):
    """φ(x) = ELU(x) + 1 > 0 (Katharopoulos et al. 2020).

    The scale is ignored: this map is a positive kernel in its own right, not an approximation of
    exp(s·qᵀk), so a temperature would only rescale both φ(q) and φ(k) and change nothing useful.
    """

    name = "elu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    @staticmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        return F.elu(x_BHND) + 1.0


class ReluFeatureMap(FeatureMap):
    """φ(x) = ReLU(x) ≥ 0; the scale is ignored as for elu.

    A query orthogonal to every positive part of the keys gets a zero denominator; the `eps` added
    to φ(q)ᵀz keeps the ratio finite (the output row is then 0).
    """

    name = "relu"

    def num_features(self, head_dim: int) -> int:
        return head_dim

    @staticmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        return F.relu(x_BHND)


def favor_projection(head_dim: int, num_features: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """FAVOR+ orthogonal random features ω [D, M], deterministic in `seed`.

    Columns come in blocks of D that are exactly orthogonal (QR of a Gaussian matrix, sign-fixed so
    the block is Haar-distributed), each column rescaled to a chi(D)-distributed norm so that every
    ω_m is marginally N(0, I): that keeps E[φ(q)ᵀφ(k)] = exp(s·qᵀk) while orthogonality lowers the
    variance. Drawn in fp64 on the CPU from an explicit generator, then cast. Cost O(M·D²).
    """
    if head_dim < 1 or num_features < 1:
        raise ValueError(f"favor_projection needs head_dim >= 1 and num_features >= 1, got {head_dim}, {num_features}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    num_blocks = math.ceil(num_features / head_dim)
    gauss = torch.randn(num_blocks, head_dim, head_dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)  # batched over blocks
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    rows_MD = (q * signs[:, None, :]).transpose(-1, -2).reshape(num_blocks * head_dim, head_dim)[:num_features]
    norms_M = torch.randn(num_features, head_dim, generator=gen, dtype=torch.float64).norm(dim=1)
    return (rows_MD * norms_M[:, None]).T.contiguous().to(dtype)


class FavorFeatureMap(FeatureMap):
    """FAVOR+ positive random features (Choromanski et al. 2021).

    φ(x) = exp(ωᵀx' − ‖x'‖²/2) / √M with x' = s^½·x, so E_ω[φ(q)ᵀφ(k)] = exp(s·qᵀk) exactly.
    Default M = 2·D: a common Performer choice that keeps the O(N·D·M) cost within 2× of the
    projections while the estimate's variance is already usable; pass `num_features` to change it.
    ω is a buffer (not trained), regenerated identically from `seed`.
    """

    name = "favor"

    def __init__(self, head_dim: int, num_features: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.head_dim = head_dim
        self.seed = seed
        m = num_features if num_features > 0 else 2 * head_dim
        self.register_buffer("omega_DM", favor_projection(head_dim, m, seed, dtype))

    def num_features(self, head_dim: int) -> int:
        return self.omega_DM.shape[1]

    def op_weight(self) -> Optional[Tensor]:
        return self.omega_DM

    @staticmethod
    def exponent(x_BHND: Tensor, scale: float, omega_DM: Tensor) -> Tensor:
        """ωᵀx' − ‖x'‖²/2 [B, H, N, M]: the log of √M·φ(x)."""
        x = x_BHND * math.sqrt(scale)
        return x @ omega_DM.to(x.dtype) - 0.5 * (x * x).sum(-1, keepdim=True)

    @staticmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        m = weight.shape[1]
        return torch.exp(FavorFeatureMap.exponent(x_BHND, scale, weight)) / math.sqrt(m)


class HedgehogFeatureMap(FeatureMap):
    """Learnable φ(x) = [softmax(x' W_h), softmax(−x' W_h)] with x' = s^½·x (Zhang et al. 2024).

    W [H, D, P] is a parameter, one matrix per query head, so M = 2P. Initialised to the identity
    (padded with seeded N(0, 1/D) columns when P > D, truncated when P < D): at init each half is a
    softmax over s^½-scaled coordinates, a spiky, monotone map that calibration then refines. The
    scale is applied in `forward` rather than folded into W so that W stays scale-free.
    """

    name = "hedgehog"
    per_head = True

    def __init__(
        self, head_dim: int, heads: int, num_features: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32
    ):
        super().__init__()
        if heads < 1:
            raise ValueError(f"hedgehog feature map needs heads >= 1 (one W per query head), got {heads}")
        p = num_features if num_features > 0 else head_dim
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        w_DP = torch.randn(head_dim, p, generator=gen, dtype=torch.float64) / math.sqrt(head_dim)
        eye = min(head_dim, p)
        w_DP[:, :eye] = torch.eye(head_dim, dtype=torch.float64)[:, :eye]
        self.weight_HDP = nn.Parameter(w_DP.expand(heads, head_dim, p).clone().to(dtype))

    def num_features(self, head_dim: int) -> int:
        return 2 * self.weight_HDP.shape[2]

    def op_weight(self) -> Optional[Tensor]:
        return self.weight_HDP

    @staticmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        if weight.shape[0] != x_BHND.shape[1]:
            raise ValueError(
                f"hedgehog weight has {weight.shape[0]} heads but the input has {x_BHND.shape[1]}; "
                f"build the map with heads = number of query heads"
            )
        proj = (x_BHND * math.sqrt(scale)) @ weight.to(x_BHND.dtype)[None]  # [B, H, N, P]
        return torch.cat([torch.softmax(proj, dim=-1), torch.softmax(-proj, dim=-1)], dim=-1)


class TaylorFeatureMap(FeatureMap):
    """Second-order Taylor features of exp (Based, Arora et al. 2024): M = 1 + D + D².

    φ(x) = [1, √s·x, (s/√2)·vec(x xᵀ)], so φ(x)ᵀφ(y) = 1 + t + t²/2 with t = s·xᵀy, which is ≥ 1/2
    for every t: the kernel value is strictly positive even though φ has negative entries.
    """

    name = "taylor"

    def num_features(self, head_dim: int) -> int:
        return 1 + head_dim + head_dim * head_dim

    @staticmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        b, h, n, d = x_BHND.shape
        ones = x_BHND.new_ones(b, h, n, 1)
        outer = (x_BHND[..., :, None] * x_BHND[..., None, :]).reshape(b, h, n, d * d)
        return torch.cat([ones, math.sqrt(scale) * x_BHND, (scale / math.sqrt(2.0)) * outer], dim=-1)


_CLASSES: dict[str, type[FeatureMap]] = {
    "elu": EluFeatureMap,
    "relu": ReluFeatureMap,
    "favor": FavorFeatureMap,
    "hedgehog": HedgehogFeatureMap,
    "taylor": TaylorFeatureMap,
}


class _GivenWeightMap(FeatureMap):
    """A map rebuilt from an op's arguments (its name and weight) rather than from its constructor."""

    def __init__(self, name: str, weight: Optional[Tensor]):
        super().__init__()
        self.name = name
        self.per_head = feature_map_class(name).per_head
        self.weight = weight

    def num_features(self, head_dim: int) -> int:
        cls = feature_map_class(self.name)
        if cls is FavorFeatureMap:
            return self.weight.shape[1]
        if cls is HedgehogFeatureMap:
            return 2 * self.weight.shape[2]
        return cls().num_features(head_dim)

    def op_weight(self) -> Optional[Tensor]:
        return self.weight

    def forward(self, x_BHND: Tensor, scale: float) -> Tensor:
        return feature_map_class(self.name).features(x_BHND, scale, self.weight)

    @staticmethod
    def features(x_BHND: Tensor, scale: float, weight: Optional[Tensor]) -> Tensor:
        raise NotImplementedError("call the module: it knows its map's name")


def feature_map_of(name: str, weight: Optional[Tensor]) -> FeatureMap:
    """The φ module an op's (feature_map, weight) arguments describe, for calling the map's functions."""
    feature_map_class(name)
    return _GivenWeightMap(name, weight)


def feature_map_class(name: str) -> type[FeatureMap]:
    """The class behind a feature-map name; ValueError naming the allowed names otherwise."""
    if not isinstance(name, str) or name not in _CLASSES:
        raise ValueError(f"unknown feature map {name!r}; allowed: {', '.join(FEATURE_MAP_NAMES)}")
    return _CLASSES[name]


def make_feature_map(name: str, head_dim: int, heads: int, num_features: int = 0, seed: int = 0) -> FeatureMap:
    """Build a φ module by name. `num_features` 0 means the map's default (favor 2·D, hedgehog P = D);
    elu, relu and taylor have a fixed width and ignore it. `heads` is used by hedgehog (one W per head)."""
    cls = feature_map_class(name)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if not isinstance(num_features, int) or num_features < 0:
        raise ValueError(f"num_features must be an int >= 0 (0 = default), got {num_features!r}")
    if cls is FavorFeatureMap:
        return FavorFeatureMap(head_dim, num_features, seed)
    if cls is HedgehogFeatureMap:
        return HedgehogFeatureMap(head_dim, heads, num_features, seed)
    return cls()


def check_weight(name: str, weight: Optional[Tensor], head_dim: int) -> None:
    needs = {"favor": "ω [D, M] (FavorFeatureMap.omega_DM)", "hedgehog": "W [H, D, P] (HedgehogFeatureMap.weight_HDP)"}
    if name in needs:
        if weight is None:
            raise ValueError(f"feature map {name!r} needs its weight {needs[name]}; build it with make_feature_map")
        want_dim = 2 if name == "favor" else 3
        if weight.dim() != want_dim or weight.shape[-2] != head_dim:
            raise ValueError(
                f"feature map {name!r} weight has shape {tuple(weight.shape)}; "
                f"expected {needs[name]} with D = {head_dim}"
            )
    elif weight is not None:
        raise ValueError(f"feature map {name!r} takes no weight, got a tensor of shape {tuple(weight.shape)}")


def query_key_features(
    name: str,
    q_BHND: Tensor,
    k_BHkvND: Tensor,
    scale: float,
    weight: Optional[Tensor],
    key_keep_BN: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """φ(q) [B, H, Nq, M], φ(k) [B, Hf, Nk, M] and the keys' log-scale, as linear attention uses them.

    Hf = H for per-head maps (hedgehog: keys are repeated to the query heads first), else Hkv.
    Masked keys (key_keep False) get φ = 0. For FAVOR+ both sides are stabilised before exp with
    constants that cancel in the ratio φ(q)ᵀS / φ(q)ᵀz: each query row subtracts its own max, and
    all keys of one (batch, kv head) share one constant c (the max over kept keys and features) --
    a per-key constant would reweight keys and change the result. The true key features are
    φ(k)·exp(c); c [B, Hf, 1, 1] is returned so a carried state can be kept in true units. Other
    maps return None (no rescaling). Cost: see each map.
    """
    cls = feature_map_class(name)
    check_weight(name, weight, q_BHND.shape[-1])
    if cls.per_head and k_BHkvND.shape[1] != q_BHND.shape[1]:
        k_BHkvND = k_BHkvND.repeat_interleave(q_BHND.shape[1] // k_BHkvND.shape[1], dim=1)
    keep = None if key_keep_BN is None else key_keep_BN[:, None, :, None]  # [B, 1, Nk, 1]
    if cls is not FavorFeatureMap:
        phi_q = cls.features(q_BHND, scale, weight)
        phi_k = cls.features(k_BHkvND, scale, weight)
        if keep is not None:
            phi_k = phi_k * keep.to(phi_k.dtype)
        return phi_q, phi_k, None
    inv_sqrt_m = 1.0 / math.sqrt(weight.shape[1])
    a_q = FavorFeatureMap.exponent(q_BHND, scale, weight)
    phi_q = torch.exp(a_q - a_q.amax(dim=-1, keepdim=True)) * inv_sqrt_m
    a_k = FavorFeatureMap.exponent(k_BHkvND, scale, weight)
    if keep is not None:
        a_k = a_k.masked_fill(~keep, float("-inf"))
    c_k = a_k.amax(dim=(-2, -1), keepdim=True) if a_k.shape[-2] > 0 else a_k.new_zeros(*a_k.shape[:2], 1, 1)
    c_k = torch.where(torch.isfinite(c_k), c_k, torch.zeros_like(c_k))  # no kept key: nothing to scale
    phi_k = torch.exp(a_k - c_k) * inv_sqrt_m  # exp(-inf) = 0 for masked keys
    return phi_q, phi_k, c_k


def resolve_feature_map(feature_map: Union[str, FeatureMap], head_dim: int, heads: int) -> FeatureMap:
    if isinstance(feature_map, FeatureMap):
        feature_map_class(feature_map.name)  # a subclass must keep one of the op's names
        return feature_map
    if isinstance(feature_map, str):
        return make_feature_map(feature_map, head_dim, heads)
    raise TypeError(
        f"feature_map must be a name ({', '.join(FEATURE_MAP_NAMES)}) or a module from make_feature_map, "
        f"got {type(feature_map).__name__}"
    )
