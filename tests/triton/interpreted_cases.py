"""Runs the Triton kernels under TRITON_INTERPRET=1 on CPU tensors and prints one JSON object.

Usage: TRITON_INTERPRET=1 python tests/triton/interpreted_cases.py [case ...]   (no names: all)
The tests run it through `children.py` (`run_cases`, `supported_reasons`).

Each case compares a kernel (forward, and backward where the kernel has one) with a dense fp64
formula from `dense_oracles.py` and reports {"err": ..., "tol": ..., "scale": ...} per checked tensor, err
being max |kernel − oracle| / max |oracle|. The interpreter must be switched on before triton is
imported, which is why the pytest side runs this file in its own process.
Shapes are small with pairwise-distinct dims (B, H, Hkv, Nq, Nk, D, Dv) and lengths that are not
multiples of the interpreter's 16-wide blocks. The interpreter's cost grows with the number of
programs and blocks, so each case takes the fewest blocks its kernel's paths need:
* SHAPE, three blocks: a chunk scan's carried state is first updated by one chunk and applied to
  the next, so a state that is overwritten instead of accumulated, or not decayed between chunks,
  shows only from the third chunk on (both bugs planted: two chunks missed them). Also the window
  sink pass split over two programs, and keys right of a bidirectional linear+window band.
* BAND, two blocks, the last partial, Nk − Nq = 6 (query and key blocks do not line up): the band
  kernels' online softmax over key blocks, a band that skips a block, sinks before the band.
"""

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import torch  # noqa: E402

import dense_oracles as oracles  # noqa: E402  (not "oracles": tests/kernels/oracles.py has that name)

torch.set_num_threads(1)

TOL = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (3e-2, 6e-2), torch.float16: (4e-3, 8e-3)}  # (fwd, bwd)
SHAPE = dict(B=2, H=4, Hkv=2, Nq=37, Nk=45, D=12, Dv=10)
BAND = dict(Nq=21, Nk=27)
DECODE_STEPS = 13  # > window + sinks (5 + 3): the ring wraps


def inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, dtype=torch.float64, generator=g) + shift
    k = torch.randn(B, Hkv, Nk, D, dtype=torch.float64, generator=g) + shift
    v = torch.randn(B, Hkv, Nk, Dv, dtype=torch.float64, generator=g)
    return q, k, v


def padding_mask(B, Nk, seed=1):
    """Row 0 random drops, row 1 left padding (7 keys) plus drops: sinks must skip the padding."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, Nk, generator=g) > 0.25
    keep[1 % B, :7] = False
    return keep


def rel(a, b):
    return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def compare(kernel, oracle, q, k, v, dtype, backward=True):
    """Forward (and backward through a fixed random cotangent) of kernel(dtype) vs oracle(fp64)."""
    tf, tb = TOL[dtype]
    xs = [t.to(dtype).requires_grad_(backward) for t in (q, k, v)]
    out = kernel(*xs)
    ref_in = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    ref = oracle(*ref_in)
    res = {"out": {"err": rel(out, ref), "tol": tf, "scale": ref.abs().max().item()}}
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    if backward:
        g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        out.backward(g.to(dtype))
        ref.backward(g)
        for name, a, b in zip(("dq", "dk", "dv"), xs, ref_in):
            res[name] = {"err": rel(a.grad, b.grad), "tol": tb, "scale": b.grad.abs().max().item()}
    return res


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ---- linear ----

def _linear(fmap, causal, dtype, mask=False, backward=True, shape=None, **kw):
    from attnopt.forms.linear.triton import linear_attention

    s = dict(SHAPE, **(shape or {}))
    q, k, v = inputs(**s)
    keep = padding_mask(s["B"], s["Nk"]) if mask else None
    return compare(
        lambda q, k, v: linear_attention(q, k, v, feature_map=fmap, causal=causal, key_mask=keep, **kw),
        lambda q, k, v: oracles.linear(q, k, v, fmap=fmap, causal=causal, key_mask=keep),
        q, k, v, dtype, backward,
    )


@case
def linear_causal_elu_fp32_gqa_mask():
    return _linear("elu", True, torch.float32, mask=True)


@case
def linear_causal_relu_fp32_more_queries_than_keys():
    # Nq > Nk: the first Nq − Nk queries sit before key 0 and must return 0
    return _linear("relu", True, torch.float32, shape=dict(Nq=29, Nk=21), backward=True)


@case
def linear_causal_elu_bf16():
    return _linear("elu", True, torch.bfloat16, mask=True)


@case
def linear_causal_elu_fp16_mqa():
    return _linear("elu", True, torch.float16, shape=dict(B=3, Hkv=1), backward=False)


@case
def linear_noncausal_elu_fp32_mask():
    return _linear("elu", False, torch.float32, mask=True)


@case
def linear_noncausal_relu_bf16():
    return _linear("relu", False, torch.bfloat16, backward=False)


@case
def linear_causal_favor_fp32():
    from attnopt.kernels.feature_maps import make_feature_map
    from attnopt.forms.linear.triton import linear_attention

    # the kernel's fp32 error with favor is ~100x the dense fp32 formula's and moves with the shape
    # (1.5e-5 here, 2.7e-5 at BAND's lengths), unlike the other maps': the tolerance is set for SHAPE
    q, k, v = inputs(**SHAPE)
    fm = make_feature_map("favor", SHAPE["D"], SHAPE["H"], seed=3)
    omega = fm.omega_DM.double()
    return compare(
        lambda q, k, v: linear_attention(q, k, v, feature_map=fm, causal=True),
        lambda q, k, v: oracles.linear(q, k, v, fmap="favor", causal=True, weight=omega),
        q * 0.5, k * 0.5, v, torch.float32,
    )


def _hedgehog():
    from attnopt.kernels.feature_maps import make_feature_map

    fm = make_feature_map("hedgehog", SHAPE["D"], SHAPE["H"], num_features=9, seed=2)
    with torch.no_grad():
        fm.weight_HDP.add_(0.3 * torch.randn(fm.weight_HDP.shape, generator=torch.Generator().manual_seed(5)))
    return fm, fm.weight_HDP.detach().double()


@case
def linear_causal_hedgehog_fp32_gqa():
    from attnopt.forms.linear.triton import linear_attention

    q, k, v = inputs(**SHAPE)
    fm, w = _hedgehog()
    return compare(
        lambda q, k, v: linear_attention(q, k, v, feature_map=fm, causal=True),
        lambda q, k, v: oracles.linear(q, k, v, fmap="hedgehog", causal=True, weight=w),
        q, k, v, torch.float32,
    )


@case
def linear_noncausal_hedgehog_fp32_mask():
    # per-head φ(k) (H heads) against shared v (Hkv heads): the GQA sum of dv in the backward
    from attnopt.forms.linear.triton import linear_attention

    q, k, v = inputs(**SHAPE)
    keep = padding_mask(SHAPE["B"], SHAPE["Nk"])
    fm, w = _hedgehog()
    return compare(
        lambda q, k, v: linear_attention(q, k, v, feature_map=fm, causal=False, key_mask=keep),
        lambda q, k, v: oracles.linear(q, k, v, fmap="hedgehog", causal=False, weight=w, key_mask=keep),
        q, k, v, torch.float32,
    )


# ---- decay ----

GAMMA = torch.tensor([0.9, 0.5, 0.99, 1.0], dtype=torch.float64)  # one per query head of SHAPE


def _decay(fmap, normalize, dtype, mask=True, backward=True, shift=0.0, shape=None):
    from attnopt.forms.ssm.triton import decay_attention

    s = dict(SHAPE, **(shape or {}))
    q, k, v = inputs(**s, shift=shift)
    keep = padding_mask(s["B"], s["Nk"]) if mask else None
    scale = 0.37
    return compare(
        lambda q, k, v: decay_attention(q, k, v, decay=GAMMA, feature_map=fmap, normalize=normalize, scale=scale, key_mask=keep),
        lambda q, k, v: oracles.decay(q, k, v, gamma=GAMMA, fmap=fmap, normalize=normalize, scale=scale, key_mask=keep),
        q, k, v, dtype, backward,
    )


@case
def decay_identity_fp32_gqa_mask():
    return _decay("identity", False, torch.float32)


@case
def decay_elu_normalized_fp32():
    return _decay("elu", True, torch.float32)


@case
def decay_identity_normalized_fp32_positive():
    # identity + normalize is only well conditioned when q·k stays positive
    return _decay("identity", True, torch.float32, mask=False, shift=1.5)


@case
def decay_relu_bf16():
    return _decay("relu", False, torch.bfloat16, mask=False)


@case
def decay_retnet_default_fp32_equal_lengths():
    from attnopt.forms.ssm.reference import retnet_decay
    from attnopt.forms.ssm.triton import decay_attention

    s = dict(SHAPE, Nq=40, Nk=40)
    q, k, v = inputs(**s)
    return compare(
        lambda q, k, v: decay_attention(q, k, v),
        lambda q, k, v: oracles.decay(q, k, v, gamma=retnet_decay(SHAPE["H"]), fmap="identity", normalize=False, scale=12 ** -0.5),
        q, k, v, torch.float32, False,
    )


# ---- window ----

def _window(W, causal, sinks, dtype, mask=False, backward=True, shape=None):
    from attnopt.forms.window.triton import window_attention

    s = dict(SHAPE, **(shape or {}))
    q, k, v = inputs(**s)
    keep = padding_mask(s["B"], s["Nk"]) if mask else None
    return compare(
        lambda q, k, v: window_attention(q, k, v, window=W, causal=causal, sinks=sinks, key_mask=keep),
        lambda q, k, v: oracles.window(q, k, v, window=W, causal=causal, sinks=sinks, key_mask=keep),
        q, k, v, dtype, backward,
    )


@case
def window_causal_sinks_mask_fp32():
    # SHAPE: the sink gradient of the far query blocks is split over two programs (atomic adds)
    return _window(5, True, 3, torch.float32, mask=True)


@case
def window_causal_fp32_wide():
    return _window(19, True, 0, torch.float32, shape=BAND)


@case
def window_bidirectional_sinks_fp32():
    return _window(4, False, 2, torch.float32)


@case
def window_bidirectional_mask_fp32():
    return _window(6, False, 0, torch.float32, mask=True, shape=BAND)


@case
def window_causal_sinks_bf16():
    return _window(7, True, 4, torch.bfloat16, shape=BAND)


@case
def window_causal_fp16_mqa():
    return _window(9, True, 1, torch.float16, shape=dict(BAND, B=3, Hkv=1), backward=False)


@case
def window_covers_everything_fp32():
    # W >= N is full attention (causal), the window clamp must not overflow
    return _window(10**9, True, 0, torch.float32, shape=dict(Nq=21, Nk=21))


@case
def window_blind_queries_return_zero():
    """Nq > Nk (queries before key 0) and a fully padded row: their outputs must be exactly 0."""
    from attnopt.forms.window.triton import window_attention

    q, k, v = inputs(**dict(SHAPE, Nq=30, Nk=20))
    keep = torch.ones(2, 20, dtype=torch.bool)
    keep[1] = False
    out = window_attention(q.float(), k.float(), v.float(), window=4, causal=True, sinks=2, key_mask=keep)
    ref = oracles.window(q, k, v, window=4, causal=True, sinks=2, key_mask=keep)
    return {
        "out": {"err": rel(out, ref), "tol": TOL[torch.float32][0], "scale": ref.abs().max().item()},
        "blind_rows_max": {"err": out[0, :, :10].abs().max().item() + out[1].abs().max().item(), "tol": 0.0, "scale": 1.0},
    }


# ---- linear + window ----

BETA = torch.tensor([0.5, 1.0, 0.0, 2.0, 0.25, 1.5], dtype=torch.float64)


def _hybrid(W, sinks, causal, fmap, dtype, mask=False, backward=False, shape=None):
    from attnopt.forms.linear_window.triton import linear_window_attention

    s = dict(SHAPE, **(shape or {}))
    q, k, v = inputs(**s)
    keep = padding_mask(s["B"], s["Nk"]) if mask else None
    beta = BETA[: s["H"]]
    return compare(
        lambda q, k, v: linear_window_attention(
            q, k, v, window=W, sinks=sinks, causal=causal, feature_map=fmap, linear_weight=beta.float(), key_mask=keep
        ),
        lambda q, k, v: oracles.linear_window(q, k, v, window=W, sinks=sinks, causal=causal, fmap=fmap, beta=beta, key_mask=keep),
        q, k, v, dtype, backward,
    )


# The causal cases take BAND: their prefix states P[c] are sums over chunks, which the bidirectional
# cases (SHAPE) read at the third boundary, P[nC] − P[end] for the keys right of the band.
@case
def hybrid_causal_elu_sinks_mask_fp32():
    return _hybrid(5, 2, True, "elu", torch.float32, mask=True, shape=BAND)


@case
def hybrid_causal_relu_fp32_queries_lt_keys():
    return _hybrid(8, 0, True, "relu", torch.float32, shape=BAND)


@case
def hybrid_bidirectional_elu_sinks_fp32():
    return _hybrid(4, 3, False, "elu", torch.float32)


@case
def hybrid_bidirectional_mask_bf16():
    return _hybrid(6, 0, False, "elu", torch.bfloat16, mask=True)


@case
def hybrid_causal_hedgehog_fp32():
    from attnopt.forms.linear_window.triton import linear_window_attention

    q, k, v = inputs(**dict(SHAPE, **BAND))
    fm, w = _hedgehog()
    beta = BETA[: SHAPE["H"]]
    return compare(
        lambda q, k, v: linear_window_attention(q, k, v, window=6, sinks=2, causal=True, feature_map=fm, linear_weight=beta.float()),
        lambda q, k, v: oracles.linear_window(q, k, v, window=6, sinks=2, causal=True, fmap="hedgehog", beta=beta, weight=w),
        q, k, v, torch.float32, False,
    )


@case
def hybrid_causal_fp16_mqa():
    return _hybrid(7, 1, True, "elu", torch.float16, shape=dict(BAND, B=3, Hkv=1))


# ---- decode steps: N one-token steps must equal the causal prefill formula ----

def _steps(step, q, k, v):
    outs, state = [], None
    for t in range(q.shape[2]):
        o, state = step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, t)
        outs.append(o)
    return torch.cat(outs, 2)


def _decode_check(step, oracle, dtype=torch.float32):
    q, k, v = inputs(**dict(SHAPE, Nq=DECODE_STEPS, Nk=DECODE_STEPS))
    out = _steps(step, q.to(dtype), k.to(dtype), v.to(dtype))
    ref = oracle(q, k, v)
    return {"out": {"err": rel(out, ref), "tol": TOL[dtype][0], "scale": ref.abs().max().item()}}


@case
def decode_linear_elu_steps_equal_prefill():
    from attnopt.forms.linear.triton import linear_decode_step

    return _decode_check(lambda q, k, v, st, t: linear_decode_step(q, k, v, st),
                         lambda q, k, v: oracles.linear(q, k, v, fmap="elu", causal=True))


@case
def decode_decay_normalized_steps_equal_prefill():
    from attnopt.forms.ssm.triton import decay_decode_step

    return _decode_check(
        lambda q, k, v, st, t: decay_decode_step(q, k, v, st, decay=GAMMA, feature_map="elu", normalize=True),
        lambda q, k, v: oracles.decay(q, k, v, gamma=GAMMA, fmap="elu", normalize=True, scale=None))


@case
def decode_decay_bf16_steps_equal_prefill():
    from attnopt.forms.ssm.triton import decay_decode_step

    return _decode_check(
        lambda q, k, v, st, t: decay_decode_step(q, k, v, st, decay=GAMMA, scale=0.3),
        lambda q, k, v: oracles.decay(q, k, v, gamma=GAMMA, fmap="identity", normalize=False, scale=0.3), torch.bfloat16)


@case
def decode_window_ring_steps_equal_prefill():
    from attnopt.forms.window.triton import init_window_cache, window_decode_step

    def step(q, k, v, cache, t):
        if cache is None:
            cache = init_window_cache(k.shape[0], k.shape[1], k.shape[3], v.shape[3], window=5, sinks=3, dtype=k.dtype)
        return window_decode_step(q, k, v, cache, t, window=5, sinks=3)

    return _decode_check(step, lambda q, k, v: oracles.window(q, k, v, window=5, causal=True, sinks=3))


# ---- registration ----

@case
def triton_op_eager_matches_raw_kernels():
    """The GPU path's triton_ops run eagerly on CPU tensors in the interpreter (not under export)."""
    from attnopt.kernels.triton.runtime import FMAP_CODES
    from attnopt.kernels.triton.band import sink_range

    q, k, v = (t.float() for t in inputs(**SHAPE))
    keep = padding_mask(2, SHAPE["Nk"])
    lin = torch.ops.attnopt_triton.linear_causal(q, k, v, keep, FMAP_CODES["elu"], 1e-6)[0]
    lin_ref = oracles.linear(q.double(), k.double(), v.double(), fmap="elu", causal=True, key_mask=keep)
    sr = sink_range(keep, 2, SHAPE["Nk"], 2, q.device)
    win = torch.ops.attnopt_triton.window(q, k, v, keep, sr, 5, True, 12 ** -0.5)[0]
    win_ref = oracles.window(q.double(), k.double(), v.double(), window=5, causal=True, sinks=2, key_mask=keep)
    return {
        "linear": {"err": rel(lin, lin_ref), "tol": 2e-5, "scale": 1.0},
        "window": {"err": rel(win, win_ref), "tol": 2e-5, "scale": 1.0},
    }


def supported_reasons() -> dict:
    """Not a numeric case: each form's `triton_supported` answer (None = the kernels take the call)."""
    from attnopt import forms

    def t(q, form, **kw):
        return forms.get(form).triton_supported(q, **kw)

    q = torch.randn(1, 2, 5, 8)
    big = torch.randn(1, 2, 5, 32)
    return {
        "window": t(q, form="window", window=4, causal=True, sinks=2),
        "linear_elu": t(q, form="linear", feature_map="elu", causal=True),
        "linear_state": t(q, form="linear", state=(q, q)),
        "taylor_d32": t(big, form="linear", feature_map="taylor"),
        "fp64": t(q.double(), form="window", window=4, causal=True),
        "decay_bad_map": t(q, form="ssm", feature_map="favor"),
        "hybrid_grad": t(q.clone().requires_grad_(), form="linear+window", window=4, causal=True),
        "unknown": t(q, form="exact"),
    }


def run_cases(names) -> dict:
    results = {}
    for name in names or list(CASES):
        t0 = time.time()
        try:
            results[name] = {"checks": CASES[name]()}
        except Exception as e:  # reported per case; the pytest side fails that case with this text
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = round(time.time() - t0, 2)
    return results


def main(names):
    print(json.dumps(run_cases(names)))


if __name__ == "__main__":
    main(sys.argv[1:])
