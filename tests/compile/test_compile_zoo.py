"""attnopt.compile over the detection zoo: every architecture compiles, runs, and explains itself.

A failed rewrite must never escape as an exception or leave a site half-replaced: each site ends
rewritten (drift measured) or exact with a reason.
"""

import os
import sys

import pytest
import torch

import attnopt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "detect"))
zoo_hf = pytest.importorskip("zoo_hf")
zoo_unseen = pytest.importorskip("zoo_unseen")

# name -> (factory, rewritten, unsupported) under "window:4+sinks:1"
CASES = {
    "llama": (zoo_hf.FACTORIES["llama"], 2, 0),
    "gpt2-eager": (zoo_hf.FACTORIES["gpt2-eager"], 2, 0),
    "bert-padded": (zoo_hf.FACTORIES["bert-padded"], 2, 0),
    "bart": (zoo_hf.FACTORIES["bart"], 4, 2),  # cross-attention has no aligned band
    "t5": (zoo_hf.FACTORIES["t5"], 0, 6),  # relative position bias: only exact honours it
    "bloom": (zoo_unseen.FACTORIES["bloom"], 0, 2),  # ALiBi bias
    "mixtral": (zoo_unseen.FACTORIES["mixtral"], 2, 0),  # router softmax is not a site
    "whisper": (zoo_unseen.FACTORIES["whisper"], 4, 2),
    "swin": (zoo_unseen.FACTORIES["swin"], 0, 2),  # relative position bias
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_compiles_and_every_site_is_accounted_for(name):
    factory, rewritten, unsupported = CASES[name]
    z = factory()
    args, kwargs = z.args, getattr(z, "kwargs", {})
    opt = attnopt.compile(z.model, "window:4+sinks:1", example_inputs=(args, kwargs), tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    statuses = [r.outcome.status for r in rep.sites]
    assert statuses.count("rewritten") == rewritten, [(r.site.id, r.outcome.reason) for r in rep.sites]
    assert statuses.count("unsupported") == unsupported
    for r in rep.sites:
        assert r.outcome.reason
        assert "failed" not in r.outcome.reason
        if r.outcome.status == "rewritten":
            assert r.outcome.drift is not None and r.outcome.drift.finite
    assert rep.end_to_end.worst is None or rep.end_to_end.worst.finite
    with torch.no_grad():
        out = opt(*args, **kwargs)
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    assert leaves and all(torch.isfinite(x).all() for x in leaves)
