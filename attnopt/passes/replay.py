"""Replay a matched candidate in plain PyTorch on the recorded values: q·kᵀ, the scores chain
(scale factors, mask terms, reshapes), the softmax, the probabilities chain, P·V. The numeric check
compares this with the recorded output; the mask reading replays the mask terms on zero scores.

Letters: B batch, H query heads, Nq/Nk query/key length, D/Dv head dims.
"""

from __future__ import annotations

from typing import Optional

import torch

from attnopt.passes.candidate import Candidate


def replay_explicit(c: Candidate, values: dict, qf, kf, vf, zero_scores: bool = False):
    """softmax(steps(q·kᵀ)) · v for an explicit chain (q, k [B, H, N, D] or [B*H, N, D], k not
    transposed); with `zero_scores`, the scores chain applied to zeros: the mask as a bias."""
    s = qf @ kf.transpose(-2, -1)
    for f in c.qk_factors:
        s = s * f.resolve(values)
    if zero_scores:
        s = torch.zeros_like(s)
    s = _apply_steps(c.score_steps, values, s)
    if zero_scores:
        return s
    p = torch.softmax(s, dim=-1)
    for _, node in c.prob_steps:
        p = p.reshape(values[node.name].shape)
    return p @ vf


def _apply_steps(steps: list, values: dict, s):
    """The scores chain's ("scale" | "term" | "reshape", x) steps, in forward order, applied to `s`."""
    for kind, x in steps:
        if kind == "scale":
            s = s * x.resolve(values)
        elif kind == "reshape":
            s = s.reshape(values[x.name].shape)
        else:
            t = values[x.node.name]
            if x.kind == "additive":
                s = s + (t.to(s.dtype) if t.dtype != torch.bool else t)
            elif x.kind == "masked_fill":
                s = s.masked_fill(t.bool(), x.fill)
            elif x.kind == "where_keep":
                s = torch.where(t.bool(), s, torch.tensor(x.fill, dtype=s.dtype))
            else:
                s = torch.where(t.bool(), torch.tensor(x.fill, dtype=s.dtype), s)
    return s


# Beyond this many queries the numeric replay of an SDPA site checks an evenly spaced sample.
REPLAY_ROWS = 256


def sample_rows(nq: int) -> Optional[torch.Tensor]:
    """Evenly spaced query rows to replay (None: all of them)."""
    if nq <= REPLAY_ROWS:
        return None
    return torch.linspace(0, nq - 1, REPLAY_ROWS).round().long().unique()


def replay_sdpa(c: Candidate, values: dict, qf, kf, vf, scale: float, rows: Optional[torch.Tensor] = None):
    """SDPA's result (on `rows` of the queries only, when given) from q, k, v [B, H, N, D] or [B*H, N, D]."""
    nq, nk = qf.shape[-2], kf.shape[-2]
    q_rows = qf if rows is None else qf.index_select(-2, rows)
    s = (q_rows @ kf.transpose(-2, -1)) * scale
    if c.sdpa_mask is not None:
        m = values[c.sdpa_mask.name]
        if rows is not None and m.dim() >= 2 and m.shape[-2] == nq:
            m = m.index_select(-2, rows)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    if c.is_causal:  # SDPA's is_causal is top-left aligned
        i = torch.arange(nq) if rows is None else rows
        keep = torch.arange(nk)[None, :] <= i[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ vf

