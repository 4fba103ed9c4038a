"""The site module a selection measures with: the site's accepted all-heads module of its form, and
exact softmax on the KV heads named in `exact_kv`, switched between measurements without a rebuild.

Each head of a form is computed on its own (tests/forms/test_mixed_heads.py checks it), so a head
set measured this way computes what the per-head site of those heads computes, except that the
final site's form is fitted on its own heads only (attnopt.forms.common.mixed_heads.fit_site).
"""

from __future__ import annotations

import torch

from attnopt.forms.common.base import SiteModule
from attnopt.forms.common.mixed_heads import softmax_heads


class HeadMask(SiteModule):
    """`module`'s form on every head, exact attention on the query heads of the KV heads in `exact_kv`."""

    def __init__(self, site, module: SiteModule):
        super().__init__(site, {**module.params, "min_seq_len": 0})
        self.form = module.form
        module.nested = True
        self.module = module
        self.reads_padding_only = module.reads_padding_only
        self.exact_kv: set = set()

    def attend(self, q, k, v, keep, mask, x):
        out = self.module.attend(q, k, v, keep, mask, x)
        if not self.exact_kv:
            return out
        G = q.shape[1] // k.shape[1]
        kv = sorted(self.exact_kv)
        heads = torch.tensor([h for j in kv for h in range(j * G, (j + 1) * G)], device=q.device)
        exact = softmax_heads(self.geometry, q.index_select(1, heads), k[:, kv], v[:, kv], keep)
        out = out.clone()
        out[:, heads] = exact.to(out.dtype)
        return out
