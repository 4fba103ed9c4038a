"""The checks every export passes before it is returned: onnx.checker, ONNX Runtime parity with
torch at two lengths (and two batch sizes), ReferenceEvaluator parity on a short input.

Parity is the relative RMS of each output, sqrt(mean((onnx − torch)²) / mean(torch²)), against
the compiled torch model on the same inputs. Inputs at another length are the example inputs
tiled along the sequence dim (real tokens, not noise: attention patterns stay like the example's).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from attnopt.ir.errors import ParityError

# ReferenceEvaluator is plain numpy: a short input keeps it to seconds.
REFERENCE_LENGTH = 16




def check_model(proto) -> None:
    import onnx

    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ParityError(f"onnx.checker rejects the exported model: {first}") from None


def default_lengths(flat: tuple, model) -> list:
    """The export length and one other, 1.5× + 1 (within the model's position limit); for a model whose
    inputs have no sequence dim (images), the export's own size twice (the second at another batch)."""
    N = sequence_length(flat)
    if N is None:
        return [None, None]  # the second at another batch
    other = N + N // 2 + 1
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and other > limit:
        other = max(2, N - N // 3) if N - N // 3 != N else N + 1
    return [N, other]


def _has_sequence_dim(t: torch.Tensor) -> bool:
    """Token ids and masks [B, N], embeddings [B, N, C]; an image [B, C, H, W] has no sequence dim."""
    return t.dim() in (2, 3)


def sequence_length(flat: tuple) -> Optional[int]:
    """Dim 1 of the first input that has a sequence dim; None when none has (an image model)."""
    return next((int(t.shape[1]) for t in flat if _has_sequence_dim(t)), None)


def at_length(flat: tuple, length: Optional[int], batch: int) -> tuple:
    """The inputs with dim 1 tiled/cut to `length` (None: as they are) and dim 0 tiled/cut to `batch`."""
    N = sequence_length(flat)
    out = []
    for t in flat:
        if length is not None and _has_sequence_dim(t) and t.shape[1] == N:
            reps = -(-length // N)
            t = t.repeat(1, reps, *([1] * (t.dim() - 2)))[:, :length]
        if t.dim() >= 1:
            reps = -(-batch // t.shape[0])
            t = t.repeat(reps, *([1] * (t.dim() - 1)))[:batch]
        out.append(t.contiguous())
    return tuple(out)


def _outputs(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _outputs(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _outputs(item)]
    return []


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    want = want.astype(np.float64)
    denom = float(np.mean(want * want))
    err = float(np.mean((got.astype(np.float64) - want) ** 2))
    return float(np.sqrt(err / denom)) if denom > 0 else float(np.sqrt(err))


def _feeds(names: list, inputs: tuple, flat_names: Optional[list] = None) -> dict:
    """The file's inputs by name: each flat input's name in `flat_names`, or (a file the exporter named
    <arg>_<i>) by position; the exporter drops inputs the graph never reads."""
    if flat_names and all(n in flat_names for n in names):
        return {n: inputs[flat_names.index(n)].detach().cpu().numpy() for n in names}
    indices = [n.rsplit("_", 1)[-1] for n in names]
    if len(names) < len(inputs) and all(i.isdigit() and int(i) < len(inputs) for i in indices):
        inputs = tuple(inputs[int(i)] for i in indices)
    if len(names) != len(inputs):
        raise ParityError(f"the exported model takes {len(names)} inputs ({', '.join(names)}) but the example has "
                          f"{len(inputs)}; an input the model ignores was dropped by the exporter")
    return {n: t.detach().cpu().numpy() for n, t in zip(names, inputs)}


def _worst(got: list, want: list) -> float:
    if len(got) != len(want):
        raise ParityError(f"the exported model returns {len(got)} outputs, torch {len(want)}")
    return max(rel_rms(np.asarray(g), w.detach().float().cpu().numpy()) for g, w in zip(got, want))


def session(proto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ort_rel_rms(proto, module, inputs: tuple) -> float:
    """Worst relative RMS of ORT CPU against `module` on `inputs`."""
    sess = session(proto)
    with torch.no_grad():
        want = _outputs(module(*inputs))
    got = sess.run(None, _feeds([i.name for i in sess.get_inputs()], inputs))
    return _worst(got, want)


def ort_parity(proto, module, flat: tuple, lengths: Sequence[int], tolerance: float,
               on_failure: Callable[[str], str], other_batch: Optional[int] = None,
               flat_names: Optional[list] = None) -> list:
    """ORT CPU against torch at each length (the first at the example batch, the others at
    `other_batch`: by default batch 2 when the example had 1, so a dynamic batch is exercised too);
    raise ParityError naming the site."""
    sess = session(proto)
    names = [i.name for i in sess.get_inputs()]
    batch0 = int(flat[0].shape[0]) if flat and flat[0].dim() else 1
    if other_batch is None:
        other_batch = 2 if batch0 == 1 else batch0
    figures = []
    for i, length in enumerate(lengths):
        batch = batch0 if i == 0 else other_batch
        inputs = at_length(flat, length, batch)
        with torch.no_grad():
            want = _outputs(module(*inputs))
        try:
            got = sess.run(None, _feeds(names, inputs, flat_names))
        except ParityError:
            raise
        except Exception as exc:
            raise ParityError(f"ONNX Runtime cannot run the export at batch {batch}, length {length}: "
                              f"{str(exc).strip().splitlines()[0]}") from None
        err = _worst(got, want)
        figures.append({"runtime": "onnxruntime-cpu", "batch": batch, "length": length, "rel_rms": err})
        if not err <= tolerance:
            where = on_failure(f"relative RMS {err:.2e} > {tolerance:g} at batch {batch}, length {length}")
            raise ParityError(f"ONNX export does not match torch at batch {batch}, length {length}: {where}")
    return figures


def reference_parity(proto, module, flat: tuple, tolerance: float, flat_names: Optional[list] = None) -> dict:
    """onnx.reference.ReferenceEvaluator (numpy, the ONNX spec's semantics) on a short input."""
    from onnx.reference import ReferenceEvaluator

    N = sequence_length(flat)
    length = None if N is None else min(REFERENCE_LENGTH, N)
    inputs = at_length(flat, length, 1)
    ref = ReferenceEvaluator(proto)
    with torch.no_grad():
        want = _outputs(module(*inputs))
    got = ref.run(None, _feeds(list(ref.input_names), inputs, flat_names))
    err = _worst(got, want)
    if not err <= tolerance:
        raise ParityError(f"ONNX reference evaluator does not match torch at length {length}: relative RMS "
                          f"{err:.2e} > {tolerance:g}")
    return {"runtime": "onnx.reference", "batch": 1, "length": length, "rel_rms": err}
