"""The contract every rewrite form implements, and the few pieces all forms share.

A form is one folder `attnopt/forms/<form>/` that holds everything about one way of computing a site.
Its `form.py` defines the Form (parameters with types, ranges, defaults and preset syntax; the one
applicability check `why_not` that explicit rules and `auto` both use; its cost model; the site
module it builds; its optional fit step); beside it live the op (`reference.py`), the decode state
(`decode.py`), the Triton kernels (`triton.py`) and the ONNX lowerings (`onnx.py`). `attnopt.forms`
discovers the folders, so a new form is one new folder.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D head dim of q and
k, Dv head dim of v. Tensors are in SDPA layout [B, H, N, D] unless a name says otherwise.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import importlib.util
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
from torch import nn

from attnopt.forms.common.decoding import (
    DecodeState,
    ExactPrefix,
    exact_on_prefix,
    extend_prefix,
    kv_cache_bytes,
    real_positions,
)
from attnopt.ir.calls import SiteCall
from attnopt.ir.errors import PolicyError
from attnopt.ir.masks import carries_a_bias, exact_attention, site_key_keep
from attnopt.ir.site import AttentionSite


@dataclass(frozen=True)
class Param:
    """One parameter of a form: its type, default and (optionally) the allowed values or bounds."""

    type: type | tuple  # int, float, str, bool, or a tuple of accepted types
    default: Any
    choices: Optional[tuple] = None
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    doc: str = ""
    above: Optional[float] = None  # an exclusive lower bound (a share that must be positive)
    # False: the default is not written into a validated dict (absent means default), so the params
    # of sites that never use the parameter -- saved models, cache keys, reports -- stay as they were.
    fill: bool = True
    # Turns an accepted spelling into the canonical value (e.g. "0,3" -> [0, 3]); may raise PolicyError.
    convert: Optional[Callable[[str, str, Any], Any]] = None

    def check(self, form: str, name: str, value: Any) -> Any:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        if float in types and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if bool not in types and isinstance(value, bool):
            raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; expected {_type_names(types)}")
        if not isinstance(value, types):
            raise PolicyError(
                f"form {form!r}: parameter {name!r} got {value!r} ({type(value).__name__}); expected {_type_names(types)}"
            )
        if self.choices is not None and value not in self.choices:
            raise PolicyError(
                f"form {form!r}: parameter {name!r} got {value!r}; allowed values: " + ", ".join(repr(c) for c in self.choices)
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != value:  # NaN passes every comparison below
                raise PolicyError(f"form {form!r}: parameter {name!r} got nan; expected a number")
            if self.minimum is not None and value < self.minimum:
                raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; must be >= {self.minimum:g}")
            if self.above is not None and value <= self.above:
                raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; must be > {self.above:g}")
            if self.maximum is not None and value > self.maximum:
                raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; must be <= {self.maximum:g}")
        return value if self.convert is None else self.convert(form, name, value)


def with_defaults(params: Mapping[str, Param], **defaults: Any) -> dict[str, Param]:
    """`params` with some defaults changed: a family's parameters at one form's own defaults."""
    return {name: dataclasses.replace(p, default=defaults[name]) if name in defaults else p
            for name, p in params.items()}


def _type_names(types: tuple) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


# Parameters every form accepts: run-time fallback to exact below `min_seq_len`, and a per-rule
# drift tolerance (relative RMS of the site output) overriding the form's default.
COMMON_PARAMS: dict[str, Param] = {
    # None: compile resolves it to the form's measured crossover against exact attention
    # (attnopt.passes.crossover); 0: the form at every length.
    "min_seq_len": Param((int, type(None)), None, minimum=0,
                         doc="below this query length the site runs exact attention (null: the measured crossover)"),
    "tolerance": Param((float, type(None)), None, minimum=0.0, doc="max relative RMS drift of the site output"),
    # Per-head sites (attnopt.forms.common.mixed_heads): the KV-head groups kept exact, given or
    # chosen by measurement (attnopt.selection). Absent from a site's params unless given.
    "exact_heads": Param((list, tuple, str, int, type(None)), None, fill=False, convert=lambda f, n, v: kv_head_list(f, n, v),
                         doc="KV-head indices kept exact softmax attention, e.g. 0,3 (their query heads too)"),
    "keep": Param((str, type(None)), None, choices=(None, "recall"), fill=False,
                  doc="recall: choose the exact heads by measured retrieval under a quality budget"),
    "exact": Param(float, 0.25, minimum=0.0, maximum=1.0, fill=False,
                   doc="keep:recall: at most this share of the KV heads exact"),
    "recall": Param(float, 0.95, minimum=0.0, maximum=1.0, fill=False,
                    doc="keep:recall: probe accuracy to hold, as a share of the original's"),
    "by": Param(str, "head", choices=("head", "layer"), fill=False,
                doc="keep:recall: choose KV heads, or whole layers"),
}
# The per-head parameters, and the forms a site cannot mix with exact heads (and why).
HEAD_PARAMS = ("exact_heads", "keep", "exact", "recall", "by")
NO_HEAD_MIXING = {
    "exact": "every head of an exact site is exact already",
    "reuse": "a reuse site reads its anchor's q and k for every head",
}


def kv_head_list(form: str, name: str, value: Any) -> Optional[list]:
    """KV-head indices as a sorted list of distinct ints: 3, "0,3", [0, 3]; None stays None."""
    if value is None:
        return None
    items = value.replace(" ", "").split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) \
        else [value]
    out = []
    for item in items:
        if isinstance(item, str) and item.lstrip("+").isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise PolicyError(f"form {form!r}: parameter {name!r} got {value!r}; expected KV-head indices >= 0 such "
                              "as 0,3 (a list in a rule)")
        out.append(item)
    if not out:
        raise PolicyError(f"form {form!r}: parameter {name!r} is empty; name at least one KV head (e.g. 0), or leave "
                          "it out")
    return sorted(set(out))


@dataclass(frozen=True)
class SiteGeometry:
    """What a rewritten site must know about the attention it replaces (copied from AttentionSite)."""

    site_id: str
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    model_window: Optional[int]  # the model's own sliding window, if any
    keep_when: str
    v_head_dim: int = 0  # 0: same as head_dim (geometries saved before this field existed)

    @classmethod
    def of(cls, site: AttentionSite) -> "SiteGeometry":
        return cls(
            site_id=site.id, heads=site.heads, kv_heads=site.kv_heads, head_dim=site.head_dim,
            scale=float(site.scale), causal=bool(site.causal), model_window=site.window,
            keep_when=site.mask.keep_when, v_head_dim=int(getattr(site, "v_head_dim", 0) or site.head_dim),
        )

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim


@dataclass
class BuildContext:
    """What building a site may need beyond the site: the other sites and their recorded calls.

    `memo` holds what a form works out once for all the sites of one build (reuse's measured plan
    of anchors); `Form.plan_report` reads it back for the report.
    """

    sites: Sequence[AttentionSite] = ()
    calls: Mapping[str, list] = field(default_factory=dict)  # site id -> [SiteCall]
    memo: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FitResult:
    """Relative RMS of the site output before and after fitting, and the steps taken."""

    what: str  # e.g. "hedgehog map"
    rel_rms_before: float
    rel_rms_after: float
    steps: int


class SiteModule(nn.Module, abc.ABC):
    """One site in a cheap form; exact below `min_seq_len`. Takes and returns the site's own layout.

    Subclasses implement `attend` on 4-D tensors; this class handles the bmm spelling [B·H, N, D],
    the run-time key padding read from the site's mask, and the exact fallback.
    """

    form: ClassVar[str] = ""
    # forward() takes anchor=: an earlier site's (q, k) of the same call, or what the mechanism made of
    # them (reuse: its block selection); `anchor_id` names that site.
    uses_anchor_qk: ClassVar[bool] = False
    # `attend` reads the mask only as key padding (keep [B, Nk]) and applies causality itself, so a
    # [B, 1, 1, Nk] keep mask serves it (exporters then build no [B, 1, Nq, Nk] mask for the site).
    reads_padding_only: ClassVar[bool] = False
    # `attend` returns a tensor of its own (never a view of q, k or v): the exact prefix under
    # min_seq_len is then written into it in place instead of copying the whole output.
    attend_output_is_fresh: ClassVar[bool] = False
    # True on a module that is part of another site module (a per-head site's inner form,
    # forms/common/mixed_heads.py): the outer one is the site, listed, saved and reported.
    nested = False

    def __init__(self, site: AttentionSite, params: Mapping[str, Any]):
        super().__init__()
        self.geometry = SiteGeometry.of(site)
        self.params = dict(params)
        self.min_seq_len = int(self.params.get("min_seq_len", 0) or 0)
        # Set by the reuse form: the id of the site whose q and k this one reads (None otherwise).
        self.anchor_id: Optional[str] = None

    def extra_repr(self) -> str:
        return f"site={self.geometry.site_id!r}, form={self.form!r}, params={self.params}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                x: Optional[torch.Tensor] = None) -> torch.Tensor:
        g = self.geometry
        if self.min_seq_len and not g.causal and q.shape[-2] < self.min_seq_len:
            return self.exact(q, k, v, mask)
        if self.biased(mask):
            return self.exact(q, k, v, mask)
        folded = q.dim() == 3
        if folded:  # bmm spelling [B*H, N, D]: heads are folded into the batch
            q, k, v = self.unfold_heads(q), self.unfold_heads(k), self.unfold_heads(v)
        keep = None
        if mask is not None:  # padding may appear at run time even if the example had none
            keep = site_key_keep(mask, g.keep_when, q, k.shape[-2], folded)
        mask4 = None if folded else mask
        out = self._by_threshold(q, k, v, keep, mask, folded, lambda: self.attend(q, k, v, keep, mask4, x))
        return out.reshape(-1, out.shape[-2], out.shape[-1]) if folded else out

    def biased(self, mask: Optional[torch.Tensor]) -> bool:
        """Whether this call's mask brings a bias (ir/masks.carries_a_bias): the call then runs exact."""
        if not carries_a_bias(mask, self.geometry.keep_when):
            return False
        warnings.warn(f"site {self.geometry.site_id}: its mask carries a bias on this call, which only exact "
                      f"attention honours; this call ran exact, not {self.form!r}", RuntimeWarning, stacklevel=3)
        return True

    def _by_threshold(self, q, k, v, keep, mask, folded: bool, form: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Causal under min_seq_len: the rows among each row's first T real tokens exact, the rest
        `form()` (4-D q, k, v; `mask` the caller's, `folded` whether it came as [B·H, N, D])."""
        exact_q, all_exact = None, False
        if self.min_seq_len and self.geometry.causal:
            # Decided from the shapes when they suffice (a real position never exceeds its column), so
            # torch.export sees no data-dependent branch for inputs shorter than the threshold.
            all_exact = k.shape[-2] <= self.min_seq_len
            if not all_exact:
                exact_q = self.exact_queries(q, k, keep)
                all_exact = bool(exact_q.all())
        if all_exact:  # short input: exactly the original attention
            return self.exact(q, k, v, mask) if not folded else self._exact_rows(q, k, v, keep, q.shape[-2])
        out = form()
        if exact_q is not None and bool(exact_q.any()):
            out = self._with_exact_prefix(out, q, k, v, keep, None if folded else mask, exact_q)
        return out

    def exact_queries(self, q: torch.Tensor, k: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
        """Bool [B, Nq]: the queries that attend exactly under `min_seq_len` -- those among the first
        min_seq_len REAL tokens of their row, so a left-padded row dispatches as it would alone, and a
        prefill and token-by-token decoding (`decode`) take the same rows exact."""
        Nq, Nk = q.shape[-2], k.shape[-2]
        if keep is None:
            pos = (Nk - Nq) + torch.arange(Nq, device=q.device)
            return (pos < self.min_seq_len).expand(q.shape[0], Nq)
        real = keep.long().cumsum(-1)[:, Nk - Nq:] - 1
        return real < self.min_seq_len

    def _exact_rows(self, q, k, v, keep, rows: int) -> torch.Tensor:
        """Exact causal attention of the first `rows` queries over the keys they can reach."""
        Nq, Nk = q.shape[-2], k.shape[-2]
        nk = Nk - Nq + rows
        keep_rows = torch.ones(q.shape[0], nk, dtype=torch.bool, device=q.device) if keep is None else keep[:, :nk]
        prefix = ExactPrefix(k[:, :, :nk], v[:, :, :nk], keep_rows)
        return exact_on_prefix(q[:, :, :rows], prefix, self.geometry.scale).to(q.dtype)

    def _with_exact_prefix(self, out, q, k, v, keep, mask, exact_q) -> torch.Tensor:
        rows = int(exact_q.any(0).nonzero().max()) + 1  # queries past this one all use the form
        exact = self._exact_rows(q, k, v, keep, rows)
        # Without padding every row up to `rows` is exact (positions are columns).
        head = exact if keep is None else torch.where(exact_q[:, None, :rows, None], exact, out[:, :, :rows])
        if self.attend_output_is_fresh:
            out[:, :, :rows] = head
            return out
        return torch.cat([head, out[:, :, rows:]], dim=2)

    # -- decoding: the form's state replaces the site's KV cache (causal sites)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor],
               state: Optional[DecodeState]) -> tuple[torch.Tensor, DecodeState]:
        """Attend the new tokens (q [B, H, Nq, D], k/v [B, Hkv, Nq, ·], the last Nq columns; `keep`
        [B, Nq] marks the real ones) to `state` plus themselves; return (out, the advanced state).

        A prefill (state None) then any split into steps equals one `forward` over the whole
        sequence. Under `min_seq_len` = T the state also keeps the exact prefix until every row has
        T real tokens, then drops it: the rows inside it attend exactly, as `forward` does.
        """
        g = self.geometry
        if not g.causal:
            raise ValueError(f"site {g.site_id}: decoding needs a causal site; this one is bidirectional")
        B, Nq = q.shape[0], q.shape[2]
        keep_BN = torch.ones(B, Nq, dtype=torch.bool, device=q.device) if keep is None else keep
        if state is not None and state.form != self.form:
            raise ValueError(f"site {g.site_id}: the decode state was made by form {state.form!r}, not {self.form!r}")
        real_before = torch.zeros(B, dtype=torch.long, device=q.device) if state is None else state.real_B
        exact_q = None
        if self.min_seq_len and (state is None or state.prefix is not None):
            exact_q = real_positions(real_before, keep_BN) < self.min_seq_len
        # A prompt inside min_seq_len runs exact: the form then only has to build its state, which
        # its prefill path does from the keys, bottom-right aligned, with just the last query.
        # (Shapes decide it when they can: a prompt no longer than min_seq_len; no graph break then.)
        state_only = state is None and exact_q is not None and (k.shape[-2] <= self.min_seq_len or bool(exact_q.all()))
        out, form_state = self.decode_step(q[:, :, -1:] if state_only else q, k, v,
                                           None if keep is None and state is None else keep_BN,
                                           None if state is None else state.form_state)
        prefix = None
        if self.min_seq_len:
            prefix = state.prefix if state is not None else None
            if state is None or prefix is not None:
                prefix = extend_prefix(prefix, k, v, keep_BN)
                if state_only:
                    out = exact_on_prefix(q, prefix, g.scale, all_kept=keep is None and state is None)
                elif Nq == 1:  # one decoding step: blend per row, asking the data nothing (no graph break)
                    out = torch.where(exact_q[:, None, :, None], exact_on_prefix(q, prefix, g.scale).to(out.dtype), out)
                elif bool(exact_q.any()):  # only the rows up to the last exact one, over the keys they reach
                    rows = int(exact_q.any(0).nonzero().max()) + 1
                    nk = prefix.k_BHkvND.shape[2] - Nq + rows
                    reach = ExactPrefix(prefix.k_BHkvND[:, :, :nk], prefix.v_BHkvND[:, :, :nk], prefix.keep_BN[:, :nk])
                    exact = exact_on_prefix(q[:, :, :rows], reach, g.scale).to(out.dtype)
                    head = torch.where(exact_q[:, None, :rows, None], exact, out[:, :, :rows])
                    out = torch.cat([head, out[:, :, rows:]], dim=2)
        real_after = real_before + keep_BN.long().sum(-1)
        state = DecodeState(self.form, form_state, real_after, (0 if state is None else state.columns) + Nq, prefix)
        # Under torch.compile the question is left to settle(), which the caller asks outside the graph.
        return out, state if torch.compiler.is_compiling() else self.settle(state)

    def runs_exact(self, nq: int, nk: int) -> bool:
        """Whether a call of these shapes is exact attention throughout under min_seq_len, decided
        from the shapes alone (a real position never exceeds its column), as `forward` decides it:
        then the caller may run the model's own attention instead of this module."""
        T = self.min_seq_len
        return bool(T) and (nk <= T if self.geometry.causal else nq < T)

    def decode_from_keys(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         keep: Optional[torch.Tensor]) -> tuple[torch.Tensor, DecodeState]:
        """`decode` for a sequence whose first columns a cache layer kept as plain K/V while it was
        inside min_seq_len (they ran the model's own attention): q [B, H, Nq, D] the new queries,
        k/v [B, Hkv, Nk, ·] every column so far (the new ones last), keep [B, Nk] or None. Returns
        (out for the new queries, the state after all Nk columns), as `decode` over the whole
        sequence would: the new queries among a row's first min_seq_len real tokens stay exact."""
        g = self.geometry
        B, Nq, Nk = q.shape[0], q.shape[2], k.shape[2]
        keep_BN = torch.ones(B, Nk, dtype=torch.bool, device=q.device) if keep is None else keep
        out, form_state = self.decode_step(q, k, v, keep, None)  # bottom-right aligned: the state of all Nk keys
        exact_q = real_positions(torch.zeros(B, dtype=torch.long, device=q.device), keep_BN)[:, Nk - Nq:] < self.min_seq_len
        prefix = ExactPrefix(k, v, keep_BN)
        if torch.compiler.is_compiling() or bool(exact_q.any()):
            out = torch.where(exact_q[:, None, :, None], exact_on_prefix(q, prefix, g.scale).to(out.dtype), out)
        state = DecodeState(self.form, form_state, keep_BN.long().sum(-1), Nk, prefix)
        return out, state if torch.compiler.is_compiling() else self.settle(state)

    def settle(self, state: Optional[DecodeState]) -> Optional[DecodeState]:
        """`state` without its exact prefix once every row is past min_seq_len (then only the form's
        own state is needed). `decode` does it itself, except inside a torch.compile graph."""
        if state is not None and state.prefix is not None and bool((state.real_B >= self.min_seq_len).all()):
            return DecodeState(state.form, state.form_state, state.real_B, state.columns, None)
        return state

    def decode_token(self, q, k, v, form_state):
        """The cache layer's fast path: one new real token in every row of a batch that never had
        padding, past min_seq_len (q [B, H, 1, D], k/v [B, Hkv, 1, ·]). Returns (out [B, H, 1, Dv],
        the form state advanced IN PLACE -- possibly another object holding it, such as a packed
        buffer made on the first step, which `decode_step` must accept), or None where the form
        has no such step (the layer then runs `decode`). Equal to `decode` up to rounding."""
        step = self.token_stepper(form_state, q, k)
        return None if step is None else (step(q, k, v).transpose(1, 2), step.state)

    def token_stepper(self, form_state, q, k):
        """`decode_token` made once per sequence: a callable (q, k, v) -> out [B, 1, H, Dv] (the
        layout attention functions return, so the hot path needs no transpose) that advances
        `.state` (`form_state`, or the object now holding it) IN PLACE, with every static choice
        already made, and `.q_dtype`, the query dtype it was built for (q and k: the first token's,
        for their heads and dtype). The cache layer keeps it while its state is `.state`. None
        where the form has none (or not yet, for this state)."""
        return None

    def decode_step(self, q, k, v, keep, form_state):
        """The form's own decoding: (out, new form state). Forms with a fixed-size state override it."""
        raise ValueError(f"site {self.geometry.site_id}: form {self.form!r} keeps a normal KV cache; it has no decode "
                         "state of its own")

    @property
    def decodes(self) -> bool:
        """Whether this module decodes from its own state (else the site keeps the normal KV cache)."""
        return self.geometry.causal and type(self).decode_step is not SiteModule.decode_step

    @abc.abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Optional[torch.Tensor],
               mask: Optional[torch.Tensor], x: Optional[torch.Tensor]) -> torch.Tensor:
        """The form's attention on q [B, H, Nq, D], k/v [B, Hkv, Nk, D]; keep [B, Nk] bool or None."""

    def unfold_heads(self, x_XND: torch.Tensor) -> torch.Tensor:
        h = self.geometry.heads if x_XND.shape[0] % max(self.geometry.heads, 1) == 0 else 1
        return x_XND.reshape(x_XND.shape[0] // h, h, x_XND.shape[-2], x_XND.shape[-1])

    def exact(self, q, k, v, mask, scale: Optional[float] = None):
        g = self.geometry
        # No mask tensor on a causal site: causality came as a flag (SDPA is_causal, or HF skipping
        # a mask it could prove unneeded).
        return exact_attention(q, k, v, mask, keep_when=g.keep_when, is_causal=mask is None and g.causal,
                               scale=g.scale if scale is None else scale)


def io_elements(B: int, H: int, Nq: int, Nk: int, Dqk: int, Dv: int) -> int:
    """Elements of q, k, v read and o written (k/v counted at H heads, as the kernels expand them)."""
    return B * H * (Nq * Dqk + Nk * Dqk + Nk * Dv + Nq * Dv)


@dataclass(frozen=True)
class CostAt:
    """Attention-only work of one site at one length: FLOPs (multiply-adds × 2) and elements moved."""

    flops: float
    elements: float


class Form(abc.ABC):
    """One rewrite form. Subclasses set the class attributes and implement the abstract hooks."""

    name: ClassVar[str]
    aliases: ClassVar[tuple] = ()
    summary: ClassVar[str]  # one line for the CLI help and the README policy table
    presets: ClassVar[tuple] = ()  # example preset strings, shown in the help
    params: ClassVar[Mapping[str, Param]] = {}
    preset_arg: ClassVar[Optional[str]] = None  # the positional knob: "window:64" sets window=64
    preset_keys: ClassVar[Mapping[str, str]] = {}  # short keys allowed in presets: {"map": "feature_map"}
    required: ClassVar[tuple] = ()
    # Relative RMS drift of the site output (given the original inputs) at which it reverts. Every
    # default is below 1 with a margin: an all-zero output has drift exactly 1 and an output
    # uncorrelated with the reference at least 1 in expectation, so both always revert. The
    # defaults only stop a site that is broken on its own (window 0.6, linear/ssm/reuse 0.8);
    # quality is the end-to-end budget's job (compile(e2e_tolerance=...)).
    default_tolerance: ClassVar[float]
    cost_rank: ClassVar[int]  # order "auto" tries forms in: lower is cheaper at long lengths
    auto_params: ClassVar[Optional[Mapping[str, Any]]] = None  # what "auto" tries; None: never tried

    # -- parameters

    def all_params(self) -> dict[str, Param]:
        return {**self.params, **COMMON_PARAMS}

    def validate(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Fill defaults and check every value; raise PolicyError naming the field and allowed values."""
        allowed = self.all_params()
        out: dict[str, Any] = {}
        for key, value in params.items():
            key = self.preset_keys.get(key, key)
            if key not in allowed:
                raise PolicyError(f"form {self.name!r} has no parameter {key!r}; allowed: {', '.join(sorted(allowed))}")
            if key in out:
                raise PolicyError(f"form {self.name!r}: parameter {key!r} given twice; give it once")
            out[key] = allowed[key].check(self.name, key, value)
        for key in self.required:
            if key not in out:
                raise PolicyError(f"form {self.name!r} needs parameter {key!r} ({allowed[key].doc})")
        for key, p in allowed.items():
            if p.fill:
                out.setdefault(key, p.default)
        self.check_head_params(out)
        self.check_params(out)
        return out

    def check_head_params(self, params: dict) -> None:
        """PolicyError for per-head parameters this form cannot take, or that contradict each other."""
        given = [k for k in HEAD_PARAMS if params.get(k) is not None]
        if not given:
            return
        if self.name in NO_HEAD_MIXING:
            raise PolicyError(f"form {self.name!r} takes no {given[0]!r}: {NO_HEAD_MIXING[self.name]}; give it to a "
                              "cheap form, e.g. 'gla+window:64+keep:recall'")
        if params.get("exact_heads") is not None and params.get("keep") is not None:
            raise PolicyError(f"form {self.name!r}: give 'exact_heads' (heads you choose) or 'keep:recall' (heads "
                              "chosen by measurement), not both")
        loose = [k for k in ("exact", "recall", "by") if k in params]
        if loose and params.get("keep") is None:
            raise PolicyError(f"form {self.name!r}: {loose[0]!r} is a budget of keep:recall; add '+keep:recall' "
                              f"(e.g. '{self.name}+keep:recall+{loose[0]}:...')")

    def check_params(self, params: dict) -> None:
        """Cross-field checks after defaults are filled; raise PolicyError. Default: none."""

    def preset_rule(self, params: dict) -> tuple[dict, Optional[tuple]]:
        """(params, layers) of the one rule a preset string makes; a form may restrict its layers."""
        return params, None

    def unmatched_hint(self, params: Mapping[str, Any], layers: int) -> str:
        """What to change when a rule of this form with `params` matches no site of a model with
        `layers` attention layers ("" when nothing in the parameters explains it)."""
        return ""

    # -- applicability

    def why_not(self, site: AttentionSite, params: Mapping[str, Any], sites: Sequence[AttentionSite] = ()) -> Optional[str]:
        """None when this form can replace `site`; otherwise the reason in plain words.

        The one check: explicit rules, `auto` and `hf.register` all ask it.
        """
        if site.dropout_p > 0:
            return f"the site applies dropout p={site.dropout_p:g} (training mode); rewrites are for inference"
        if site.runtime_inputs:
            source = f" ({site.runtime_reason})" if site.runtime_reason else ""
            return (f"the site's {', '.join(site.runtime_inputs)} is read at run time{source} and may change per "
                    "call; a rewrite would freeze the example's value, so only exact attention honours it")
        if site.softcap:
            return f"the site caps its logits (softcap {site.softcap:g}); no cheap form honours a softcap"
        heads = params.get("exact_heads")
        if heads:
            if max(heads) >= site.kv_heads:
                return (f"exact_heads {heads} names KV head {max(heads)}, and the site has {site.kv_heads} KV heads "
                        f"(0..{site.kv_heads - 1})")
            if len(heads) == site.kv_heads:
                return f"exact_heads {heads} keeps every KV head exact; use form 'exact' for this site"
        return self.check_site(site, params, sites)

    @abc.abstractmethod
    def check_site(self, site: AttentionSite, params: Mapping[str, Any], sites: Sequence[AttentionSite]) -> Optional[str]:
        """The form's own conditions on a site (after the checks shared by all forms)."""

    def keeps_exact(self, site: AttentionSite, params: Mapping[str, Any],
                    sites: Sequence[AttentionSite]) -> Optional[str]:
        """Why the form's own plan keeps a site it could serve exact (reuse: an anchor), or None. Such a
        site is kept, not unsupported. `build` raises KeptByPlan where this is decided only then."""
        return None

    def acts_at(self, site: AttentionSite, params: Mapping[str, Any], q_len: int, kv_len: int) -> bool:
        """Whether the form computes anything different from exact attention at these lengths.

        Under min_seq_len = T a causal site runs its first T positions exact, so it acts only past T."""
        T = int(params.get("min_seq_len", 0) or 0)
        return (kv_len > T) if site.causal and T else q_len >= T

    def dispatch_threshold(self, site: AttentionSite, crossover: int) -> tuple[int, str]:
        """(min_seq_len, why) from the length at which the form, timed over whole inputs, starts to win
        (passes/crossover.py): that length itself, unless a form's rows cost otherwise."""
        return crossover, ""

    def acting_length(self, site: AttentionSite, params: Mapping[str, Any]) -> int:
        """A sequence length at which to verify the form when the example inputs are too short for it
        to act: where it acts, and long enough for its approximation to show."""
        T = int(params.get("min_seq_len", 0) or 0)
        return max(1, 2 * T if site.causal else T)  # causal: half the rows past the exact prefix

    # -- cost

    @abc.abstractmethod
    def cost(self, site: AttentionSite, params: Mapping[str, Any], B: int, Nq: int, Nk: int) -> CostAt:
        """Attention-only FLOPs and elements moved at these lengths (projections excluded)."""

    # -- building

    @abc.abstractmethod
    def build(self, site: AttentionSite, params: Mapping[str, Any], context: BuildContext) -> SiteModule:
        """The site module; raise SiteUnsupported when this mechanism cannot build it for the site."""

    # -- decoding

    def decode_state_bytes(self, site: AttentionSite, params: Mapping[str, Any], context: int,
                           element_bytes: int) -> int:
        """Bytes one batch row of this site holds while decoding at `context` tokens: its KV cache
        unless the form keeps a state of its own (`state_bytes`; a causal site), then that state plus
        the exact prefix a min_seq_len site keeps until `context` passes it."""
        kv = kv_cache_bytes(site.kv_heads, site.head_dim, site.v_head_dim or site.head_dim, context, element_bytes)
        own = self.state_bytes(site, params, context, element_bytes) if site.causal else None
        if own is None:
            return kv
        return own if context >= int(params.get("min_seq_len", 0) or 0) else own + kv

    def state_bytes(self, site: AttentionSite, params: Mapping[str, Any], context: int,
                    element_bytes: int) -> Optional[int]:
        """Bytes of one row's own decode state at `context` tokens (accumulators in fp32 at least);
        None: the form keeps the site's KV cache. Forms that decode from a state override it."""
        return None

    def fit(self, module: SiteModule, calls: list[SiteCall]) -> Optional[FitResult]:
        """Fit the module's own parameters to the recorded calls (in place); None when nothing to fit."""
        return None

    def plan_report(self, context: BuildContext) -> Optional[dict]:
        """What the form planned across the sites of one build, for the report (None: nothing)."""
        return None

    # -- public API

    def public_ops(self) -> dict[str, Callable]:
        """The functions `attnopt.ops` exports for this form (its kernels and their helpers)."""
        return {}

    # -- what the form's folder holds besides form.py

    def folder_module(self, name: str) -> Optional[ModuleType]:
        """`attnopt/forms/<form>/<name>.py` of this form (e.g. "triton", "onnx"), imported; None when
        the folder has no such file. An optional dependency it needs raises ImportError."""
        package = type(self).__module__.rpartition(".")[0]
        if importlib.util.find_spec(f"{package}.{name}") is None:
            return None
        return importlib.import_module(f"{package}.{name}")

    def triton_supported(self, q: torch.Tensor, **kwargs) -> Optional[str]:
        """None when this form's Triton kernels can run a call of its op with these keywords (plus k=
        to check the key length); otherwise the reason in one line."""
        try:
            kernels = self.folder_module("triton")
        except ImportError as exc:
            return f"form {self.name!r}: Triton is not usable here ({exc})"
        if kernels is None:
            return f"form {self.name!r} has no Triton kernels; its op runs on the PyTorch path"
        return kernels.unsupported(q, **kwargs)

    def onnx_lowering(self):
        """How this form's custom op leaves PyTorch: the `LOWERING` (an OpLowering: the op and one
        onnxscript function per ONNX target) of its folder's onnx.py, or None when it adds no op."""
        module = self.folder_module("onnx")
        return None if module is None else getattr(module, "LOWERING", None)

    def graph_step(self):
        """How a site of this form runs in an exported decode graph: the `STEP` (forms.common.graph.
        GraphStep: its state tensors and the call of its step op) of its folder's step.py, or None when
        the form has none (the decode export then refuses its sites)."""
        module = self.folder_module("step")
        return None if module is None else module.STEP

    def onnx_decode_lowering(self):
        """The ONNX lowering of this form's step op: `DECODE_LOWERING` of its folder's onnx.py, or None."""
        module = self.folder_module("onnx")
        return None if module is None else getattr(module, "DECODE_LOWERING", None)


def no_arbitrary_mask(site: AttentionSite) -> Optional[str]:
    """The condition every form that recomputes the scores shares: causal, window or padding masks only."""
    if site.mask.arbitrary:
        why = f" ({site.mask.why})" if getattr(site.mask, "why", None) else ""
        return (f"the site's mask ({site.mask.form}) is not causal, windowed or padding{why}; only exact attention "
                "honours it")
    return None
