"""exact: keep softmax attention as the model wrote it. The fallback of every other form."""

from __future__ import annotations

from attnopt.forms.common.base import CostAt, Form, SiteModule, io_elements


class ExactSite(SiteModule):
    form = "exact"

    def forward(self, q, k, v, mask=None, x=None):
        return self.exact(q, k, v, mask)

    def attend(self, q, k, v, keep, mask, x):  # forward never reaches it: exact needs no unfolding
        return self.exact(q, k, v, mask)


class ExactForm(Form):
    name = "exact"
    aliases = ("keep",)
    summary = "keep softmax attention as is"
    presets = ("exact",)
    default_tolerance = 0.0
    cost_rank = 99

    def check_site(self, site, params, sites):
        return None

    def why_not(self, site, params, sites=()):
        return None  # exact honours everything, dropout and softcaps included

    def acts_at(self, site, params, q_len, kv_len):
        return False

    def cost(self, site, params, B, Nq, Nk):
        H, D, Dv = site.heads, site.head_dim, site.v_head_dim
        return CostAt(2 * B * H * Nq * Nk * (D + Dv), B * H * Nq * Nk + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        return ExactSite(site, params)


FORM = ExactForm()
