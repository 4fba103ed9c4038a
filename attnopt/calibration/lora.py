"""LoLCATs' second stage: LoRA on the attention projections (q, k, v, o), trained so the rewritten
model reproduces the original model's outputs (relative MSE of the logits or hidden states).

The adapters come from peft (`inject_adapter_in_model`, which keeps the model's class, so
`generate()` and `attnopt.save` still work) and are merged into the projections afterwards: the
result is the same model with changed q/k/v/o weights and no peft layer left in it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from attnopt.calibration.distributed import (
    World,
    average_gradients_,
    broadcast_,
    mean_over_ranks,
)
from attnopt.calibration.train import CURVE_POINTS, progress_bar
from attnopt.forms.common.fitting import relative_mse
from attnopt.ir.errors import CalibrationError
from attnopt.targets import target_of

RANK = 8
ALPHA = 16
LR_SCALE = 0.01  # LoRA at a hundredth of the forms' learning rate: a step moves every token's projections
def model_output(out: Any) -> torch.Tensor:
    """The tensor the LoRA loss compares: logits, else last_hidden_state, else the first tensor."""
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if t is None and isinstance(out, dict):
            t = out.get(name)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, torch.Tensor):
        return out
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise CalibrationError("calibrate(params='forms+lora'): the model's output has no floating tensor to match")
    return leaves[0]


def train_lora(model: nn.Module, report, batches: list, outputs: list, *, steps: int, lr: float, seed: int,
               world: World, progress: bool = True) -> dict:
    """Inject, train and merge LoRA adapters; the record for the report."""
    try:
        targets = target_of(model).lora_targets(report)
    except ValueError as exc:
        raise CalibrationError(f"calibrate(params='forms+lora'): {exc}; use params='forms' for this model") from None
    try:
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
    except ImportError as exc:
        raise CalibrationError("calibrate(params='forms+lora') needs the 'peft' package: pip install peft") from exc
    if not targets:
        raise CalibrationError("calibrate(params='forms+lora'): no rewritten site has q/k/v/o nn.Linear projections "
                               "to adapt; use params='forms'")
    start = time.perf_counter()
    torch.manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets), model)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    broadcast_(params, world)
    for p in params:
        p.requires_grad_(True)
    refs = [model_output(o).detach() for o in outputs]

    def loss_on(i):
        args, kwargs = batches[i]
        return relative_mse(model_output(model(*args, **kwargs)), refs[i])

    with torch.no_grad():
        before = math.sqrt(mean_over_ranks(sum(float(loss_on(i)) for i in range(len(batches))) / len(batches), world))
    opt = torch.optim.Adam(params, lr=lr * LR_SCALE)
    gen = torch.Generator().manual_seed(seed + 7)
    order: list = []
    curve, status, reason = [], "trained", ""
    every = max(1, steps // CURVE_POINTS)
    bar = progress_bar(steps, "LoRA q/k/v/o", progress and world.leader)
    for step in range(steps):
        if not order:
            order = torch.randperm(len(batches), generator=gen).tolist()
        opt.zero_grad(set_to_none=True)
        loss = loss_on(order.pop())
        value = mean_over_ranks(float(loss.detach()), world)
        if not math.isfinite(value):
            status, reason = "non_finite", f"the LoRA loss was not finite at step {step}; adapters discarded"
            break
        loss.backward()
        average_gradients_(params, world)
        opt.step()
        if step % every == 0 or step == steps - 1:
            curve.append((step, math.sqrt(max(value, 0.0))))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(rel_rms=f"{math.sqrt(max(value, 0.0)):.4f}")
    if bar is not None:
        bar.close()
    after = float("nan")
    if status == "trained":
        with torch.no_grad():
            after = math.sqrt(mean_over_ranks(sum(float(loss_on(i)) for i in range(len(batches))) / len(batches), world))
        if not after < before:
            status, reason = "unchanged", f"LoRA did not lower the output loss ({before:.4g} -> {after:.4g}); discarded"
    keep = status == "trained"
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            if keep:
                module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(False)
    return {"targets": targets, "rank": RANK, "alpha": ALPHA, "lr": lr * LR_SCALE, "steps": steps, "status": status,
            "reason": reason or f"output relative RMS on its training batches {before:.4g} -> {after:.4g}",
            "rms_before": before, "rms_after": after if keep else before, "curve": curve,
            "seconds": time.perf_counter() - start}
