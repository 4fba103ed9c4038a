"""window: softmax over a band of W keys (plus the first S real tokens, StreamingLLM's sinks), O(N·W).

`window=W` counts keys including self: causal i−W < j ≤ i, bidirectional |i−j| < W (ORT's
GroupQueryAttention.local_window_size counts the same way; ONNX Attention's left_window_size is W−1).
"""

from __future__ import annotations

from attnopt.forms.common.base import CostAt, Form, Param, SiteModule, io_elements, no_arbitrary_mask
from attnopt.forms.common.decoding import kv_cache_bytes
from attnopt.forms.window.decode import RingStep, WindowRing, ring_of, ring_ready, window_decode
from attnopt.forms.window.reference import window_attention

WINDOW_PARAMS = {
    "window": Param(int, 256, minimum=1, doc="keys visible per query, incl. self (causal); half-width+1 otherwise"),
    "sinks": Param(int, 0, minimum=0, doc="first real tokens every query also sees (StreamingLLM)"),
}


def effective_window(params, model_window) -> int:
    """A model that already slides a window keeps its own when it is the narrower one."""
    return params["window"] if model_window is None else min(params["window"], model_window)


def visible_keys(params, causal: bool, Nk: int) -> int:
    """Keys one query sees at most: the band plus the sinks, capped by the key length."""
    band = params["window"] if causal else 2 * params["window"] - 1
    return min(band + params["sinks"], Nk)


def aligned_positions_reason(site) -> str | None:
    """Bands need query i and key i to be the same token: self-attention, or a model's own window."""
    if site.mask.window is None and not site.causal and str(site.q_len) != str(site.kv_len):
        return "a window needs aligned query and key positions; this is cross-attention"
    return None


def window_cache_bytes(site, params, context: int, element_bytes: int) -> int:
    """One row's window cache at `context` tokens: S sinks + the last W − 1 keys and values (+ flags);
    from W + S − 1 tokens on, decoding without padding holds it as a ring of S + W slots (no flags)."""
    W, S = effective_window(params, site.window), params["sinks"]
    if context >= W + S - 1:
        return kv_cache_bytes(site.kv_heads, site.head_dim, site.v_head_dim, S + W, element_bytes)
    keys = min(context, W - 1) + S
    return kv_cache_bytes(site.kv_heads, site.head_dim, site.v_head_dim, keys, element_bytes) + keys + S * 9


class WindowSite(SiteModule):
    form = "window"
    reads_padding_only = True

    def attend(self, q, k, v, keep, mask, x):
        g, p = self.geometry, self.params
        return window_attention(q, k, v, window=effective_window(p, g.model_window), causal=g.causal,
                                sinks=p["sinks"], scale=g.scale, key_mask=keep)

    def decode_step(self, q, k, v, keep, form_state):
        """Each row's sinks and last W − 1 columns (window_decode.WindowCache): O(S + W) per token."""
        g, p = self.geometry, self.params
        return window_decode(q, k, v, form_state, window=effective_window(p, g.model_window), sinks=p["sinks"],
                             scale=g.scale, key_mask=keep)

    def token_stepper(self, form_state, q, k):
        """A ring buffer of the band written in place, once the band is full and the sinks lie outside it."""
        if not isinstance(form_state, WindowRing):
            if not ring_ready(form_state):
                return None
            form_state = ring_of(form_state)
        return RingStep(form_state, q.dtype, self.geometry.scale, k.shape[1] != q.shape[1])


class WindowedForm(Form):
    """A form with a softmax band of `window` keys (plus `sinks`): it differs from exact attention only
    once a query's keys outnumber them, and needs query i and key i to be one token."""

    def check_site(self, site, params, sites):
        return no_arbitrary_mask(site) or aligned_positions_reason(site)

    def acts_at(self, site, params, q_len, kv_len):
        return super().acts_at(site, params, q_len, kv_len) and kv_len > params["window"] + params["sinks"]

    def acting_length(self, site, params):
        # Four bands: most queries then miss most keys, so the drift measured is the form's own.
        return max(super().acting_length(site, params), 4 * (params["window"] + params["sinks"]))


class WindowForm(WindowedForm):
    name = "window"
    aliases = ("windowed",)
    summary = "softmax restricted to a band of keys (plus sink tokens), O(N·W)"
    presets = ("window:256", "window:256+sinks:4")
    params = WINDOW_PARAMS
    preset_arg = "window"
    default_tolerance = 0.6
    cost_rank = 2
    auto_params = {"window": 64, "sinks": 4}

    def cost(self, site, params, B, Nq, Nk):
        H, D, Dv = site.heads, site.head_dim, site.v_head_dim
        keys = visible_keys(params, site.causal, Nk)
        return CostAt(2 * B * H * Nq * keys * (D + Dv), B * H * Nq * keys + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        return WindowSite(site, params)

    def state_bytes(self, site, params, context, element_bytes):
        return window_cache_bytes(site, params, context, element_bytes)

    def public_ops(self):
        return {"window_attention": window_attention, "window_decode": window_decode}


FORM = WindowForm()
