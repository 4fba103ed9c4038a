"""The form kit: what every form folder reuses instead of writing again.

kernels.registration (a prefill op from its forward: schema, fake, recompute autograd; a step op and
its fake), kernels.normaliser (z carried as a ones column and split off again), forms.common.families
and Form.decode_state_bytes (what a family of forms declares once). Oracles here are written out by
hand: none calls the helper under test."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import Tensor

from attnopt.forms.common.base import Param, with_defaults
from attnopt.forms.common.families import causal_self_attention_reason
from attnopt.kernels.normaliser import (
    check_state,
    join_state,
    normalised_out,
    packed_state,
    split_state,
    start_state,
    with_ones,
)
from attnopt.kernels.registration import prefill_op, step_op

F64 = torch.float64


# ---------------------------------------------------------------- a prefill op from its forward


def _toy_forward(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], scale: float,
                 S0: Optional[Tensor] = None, passes: int = 1):
    """out = scale · (q kᵀ ⊙ keep) v, plus q S0 when a state comes in; returns (out, state)."""
    scores = scale * q @ k.transpose(-1, -2)
    if key_mask is not None:
        scores = scores * key_mask[:, None, None, :]
    out = scores @ v
    state = k.transpose(-1, -2) @ v
    if S0 is not None:
        out, state = out + q @ S0, state + S0
    return out * passes, state


CHECKED = []


def _check_scale(scale: float, **_) -> None:
    CHECKED.append(scale)
    if not scale > 0:
        raise ValueError(f"toy: scale must be > 0, got {scale}")


TOY = prefill_op("attnopt_kit_test::toy", _toy_forward, differentiable=(0, 1, 2), check=_check_scale)


def test_prefill_op_schema_is_the_forwards_parameters_without_a_default():
    schema = str(torch.ops.attnopt_kit_test.toy.default._schema)
    assert schema == "attnopt_kit_test::toy(Tensor q, Tensor k, Tensor v, Tensor? key_mask, float scale) -> Tensor"


def test_prefill_op_runs_the_forward_and_its_backward_is_the_forwards_gradient():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=F64, generator=g, requires_grad=True) for _ in range(3))
    keep = torch.rand(2, 5, generator=g) > 0.3
    out = torch.ops.attnopt_kit_test.toy(q, k, v, keep, 0.5)
    want = 0.5 * ((q @ k.transpose(-1, -2)) * keep[:, None, None, :]) @ v  # by hand, not via the forward
    assert torch.allclose(out, want, atol=1e-12) and out.is_contiguous() and out.storage_offset() == 0
    w = torch.randn(out.shape, dtype=F64, generator=g)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    expect = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, expect):
        assert torch.allclose(a, b, atol=1e-12)


def test_prefill_op_checks_in_the_op_and_in_its_fake():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="toy: scale must be > 0, got -1.0"):
        torch.ops.attnopt_kit_test.toy(q, q, q, None, -1.0)
    CHECKED.clear()

    class Mod(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.attnopt_kit_test.toy(q, k, v, None, 0.25)

    v = torch.randn(1, 2, 3, 6)
    ep = torch.export.export(Mod(), (q, q, v))
    assert CHECKED and CHECKED[0] == 0.25  # the fake ran the check while tracing
    node = next(n for n in ep.graph.nodes if n.target == torch.ops.attnopt_kit_test.toy.default)
    assert tuple(node.meta["val"].shape) == (1, 2, 3, 6)  # [B, H, Nq] of q, Dv of v


def _strided_forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return (q + k) @ v.transpose(-1, -2) @ v  # [B, H, N, Dv], plain contiguous


HEADS_INNER = prefill_op("attnopt_kit_test::heads_inner", _strided_forward, differentiable=(0, 1, 2), heads_inner=True)


def test_prefill_op_heads_inner_lays_out_its_output_as_attention_functions_return_it():
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    out = torch.ops.attnopt_kit_test.heads_inner(q, k, v)
    assert torch.allclose(out, (q + k) @ v.transpose(-1, -2) @ v, atol=1e-5)
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous()


# ---------------------------------------------------------------- a step op and its fake


@step_op("attnopt_kit_test::step", out=("phi_q", "v"), presents=("state", "count"))
def _toy_step(phi_q: Tensor, v: Tensor, mask: Tensor, state: Tensor, count: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    state = state + phi_q.transpose(-1, -2) @ phi_q
    return (phi_q @ state)[..., :1] * v + v.mean(), state, count + 1


def test_step_op_fake_takes_out_and_present_shapes_from_the_named_inputs():
    class Mod(torch.nn.Module):
        def forward(self, phi_q, v, mask, state, count):
            return torch.ops.attnopt_kit_test.step(phi_q, v, mask, state, count)

    args = (torch.randn(2, 4, 3, 5), torch.randn(2, 4, 3, 7), torch.ones(2, 3, dtype=torch.bool),
            torch.zeros(2, 4, 5, 5), torch.zeros(2, 1, 1, dtype=torch.int64))
    ep = torch.export.export(Mod(), args)
    node = next(n for n in ep.graph.nodes if n.target == torch.ops.attnopt_kit_test.step.default)
    shapes = [tuple(t.shape) for t in node.meta["val"]]
    assert shapes == [(2, 4, 3, 7), (2, 4, 5, 5), (2, 1, 1)]
    assert [t.dtype for t in node.meta["val"]] == [torch.float32, torch.float32, torch.int64]
    eager = torch.ops.attnopt_kit_test.step(*args)
    assert [tuple(t.shape) for t in eager] == shapes and int(eager[2][0, 0, 0]) == 1


# ---------------------------------------------------------------- the normaliser as a ones column


def test_ones_column_carries_the_denominator_and_the_split_divides_it_back():
    g = torch.Generator().manual_seed(1)
    phi_q, phi_k = torch.rand(1, 2, 6, 3, dtype=F64, generator=g), torch.rand(1, 2, 6, 3, dtype=F64, generator=g)
    v = torch.randn(1, 2, 6, 4, dtype=F64, generator=g)
    v1 = with_ones(v, True)
    assert v1.shape[-1] == 5 and bool((v1[..., 4] == 1).all()) and with_ones(v, False) is v
    T = phi_k.transpose(-1, -2) @ v1  # [S ‖ z]
    out, S, z = normalised_out(phi_q @ T, T, 4, True, 1e-3)
    num = phi_q @ (phi_k.transpose(-1, -2) @ v)
    den = (phi_q * phi_k.sum(2, keepdim=True)).sum(-1, keepdim=True)
    assert torch.allclose(out, num / (den + 1e-3), atol=1e-12)
    assert torch.allclose(S, phi_k.transpose(-1, -2) @ v) and torch.allclose(z, phi_k.sum(2))
    raw, S_raw, z_raw = normalised_out(phi_q @ T, T, 4, False, 1e-3)
    assert raw is not None and S_raw is T and z_raw is None


def test_a_row_with_zero_denominator_is_zero_not_nan():
    out, _, _ = normalised_out(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3), 2, True, 0.0)
    assert bool((out == 0).all())


def test_start_state_is_zeros_or_the_carried_pair_packed():
    like = torch.zeros(1, dtype=F64)
    T0 = start_state(None, None, (2, 3, 4, 5), like, True)
    assert T0.shape == (2, 3, 4, 6) and T0.dtype == F64 and not bool(T0.any())
    S0, z0 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4)
    T = start_state(S0, z0, (2, 3, 4, 5), like, True)
    assert torch.equal(T[..., :5], S0.double()) and torch.equal(T[..., 5], z0.double())
    assert start_state(S0, None, (2, 3, 4, 5), like, False).shape == (2, 3, 4, 5)


def test_packed_state_reuses_the_buffer_its_views_came_from():
    T = torch.randn(2, 3, 4, 6)
    S, z = split_state(T, 5, True)
    assert packed_state(S, z, torch.float32) is T  # views of one buffer: no copy
    S2, z2 = S.clone(), z.clone()
    packed = packed_state(S2, z2, torch.float32)
    assert packed is not T and torch.equal(packed, T) and torch.equal(join_state(S2, z2), T)
    assert packed_state(S2, None, torch.float64).dtype == F64 and join_state(S2, None) is S2


def test_check_state_names_the_shape_and_the_fix():
    sizes = {"B": 1, "Hkv": 2, "M": 3, "Dv": 4}
    S, z = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    assert check_state("op", (S, z), sizes, True, "init_x") == (S, z)
    with pytest.raises(TypeError, match=r"op: state must be a pair \(S \[B, Hkv, M, Dv\], z \[B, Hkv, M\] or None\)"):
        check_state("op", S, sizes, True, "init_x")
    with pytest.raises(ValueError, match=r"state S must have shape \[B, Hkv, M, Dv\] = \[1, 2, 3, 4\], got \[1, 2, 3, 5\]"):
        check_state("op", (torch.zeros(1, 2, 3, 5), z), sizes, True, "init_x")
    with pytest.raises(ValueError, match=r"needs state z of shape \[B, Hkv, M\] = \[1, 2, 3\]; use init_x"):
        check_state("op", (S, None), sizes, True, "init_x")
    with pytest.raises(ValueError, match="state carries z but normalize=False"):
        check_state("op", (S, z), sizes, False, "init_x")


# ---------------------------------------------------------------- families and the shared form pieces


def test_with_defaults_changes_only_the_named_defaults():
    params = {"window": Param(int, 256, minimum=1, doc="w"), "sinks": Param(int, 0, minimum=0, doc="s")}
    got = with_defaults(params, window=64)
    assert got["window"].default == 64 and got["window"].minimum == 1 and got["window"].doc == "w"
    assert got["sinks"] is params["sinks"] and params["window"].default == 256


def test_every_recurrent_form_refuses_a_bidirectional_or_cross_attention_site():
    from attnopt import forms
    from attnopt.forms.common.families import RecurrentForm

    recurrent = [f for f in forms.registry().values() if isinstance(f, RecurrentForm)]
    assert sorted(f.name for f in recurrent) == ["delta", "gla", "gla+window", "ssm"]

    class Site:
        causal, q_len, kv_len = False, 8, 8

    for form in recurrent:
        assert causal_self_attention_reason(form.name, Site()).startswith(f"{form.name} is causal by construction")
        assert form.check_site(Site(), {}, ()) == causal_self_attention_reason(form.name, Site())
        assert form.cost_rank == 1


def test_decode_state_bytes_is_the_own_state_plus_the_exact_prefix_until_min_seq_len():
    from types import SimpleNamespace

    from attnopt import forms

    site = SimpleNamespace(causal=True, heads=8, kv_heads=2, head_dim=16, v_head_dim=16, window=None)
    ssm = forms.get("ssm")
    params = ssm.validate({"min_seq_len": 100})
    own = 8 * 16 * (16 + 1) * 4  # heads · D · (Dv + z) accumulators in fp32
    kv = lambda n: 2 * n * (16 + 16) * 2  # noqa: E731  (one row's K and V in fp16 at n tokens)
    assert ssm.decode_state_bytes(site, params, 50, 2) == own + kv(50)
    assert ssm.decode_state_bytes(site, params, 100, 2) == own
    bidirectional = SimpleNamespace(**{**vars(site), "causal": False})
    assert forms.get("window").decode_state_bytes(bidirectional, forms.get("window").validate({}), 64, 2) == kv(64)


# ---------------------------------------------------------------- the "adding a form" page names real pieces


def test_the_adding_a_form_page_names_pieces_that_exist_and_families_as_registered():
    import importlib
    import re
    from pathlib import Path

    from attnopt import forms

    page = (Path(__file__).resolve().parents[2] / "docs" / "developer" / "adding-a-form.md").read_text()
    dotted = set(re.findall(r"`(attnopt(?:\.\w+)+)`", page))
    assert len(dotted) >= 12
    for name in dotted:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"the page names {name}, but {'.'.join(parts[:cut])} has no {attr}"
                obj = getattr(obj, attr)
            break
    rows = re.findall(r"^\| `attnopt\.[\w.]+\.(\w+)` \|.*\| ([\w+, ]+) \|$", page, flags=re.M)
    assert [family for family, _ in rows] == ["RecurrentForm", "FittedForm", "WindowedForm"]
    for family, members in rows:
        module = "attnopt.forms.window.form" if family == "WindowedForm" else "attnopt.forms.common.families"
        cls = getattr(importlib.import_module(module), family)
        registered = sorted(f.name for f in forms.registry().values() if isinstance(f, cls))
        assert registered == sorted(m.strip() for m in members.split(",")), family
