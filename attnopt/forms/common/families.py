"""What the forms of one kind declare alike, written once: a form subclasses its family instead of `Form`.

RecurrentForm: a state carried forward through the sequence (ssm, gla, gla+window, delta), so only
causal self-attention sites. FittedForm: sites that fit their own tensors (φ, gates, β) to the site's
recorded calls at compile time (linear+window, gla, gla+window, delta). The windowed family (window,
linear+window, gla+window) lives with the window's parameters, in forms/window/form.py.
"""

from __future__ import annotations

from typing import Optional

from attnopt.forms.common.base import Form, no_arbitrary_mask


def causal_self_attention_reason(form: str, site) -> Optional[str]:
    """The conditions of a recurrent form: a causal self-attention site with a causal/padding mask."""
    if not site.causal:
        # The recurrence only carries the past: on a bidirectional site it would drop every later key.
        return f"{form} is causal by construction and this site is bidirectional; use linear or window there"
    if str(site.q_len) != str(site.kv_len):
        return f"{form} needs self-attention (query length == key length); this site is cross-attention"
    return no_arbitrary_mask(site)


class RecurrentForm(Form):
    """A form whose state runs forward over the keys: causal self-attention sites only. Its state
    has a fixed size, so "auto" tries it after plain linear attention and before a window."""

    cost_rank = 1

    def check_site(self, site, params, sites):
        return causal_self_attention_reason(self.name, site)


class FittedForm(Form):
    """A form whose sites fit φ (and gates, β) to their recorded calls at compile time (`fit`)."""

    preset_keys = {"map": "feature_map"}  # "gla+map:elu"
    auto_params = None  # its fit is a compile-time cost "auto" should not pay per site and form
