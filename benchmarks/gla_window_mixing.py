"""How gla+window mixes its two parts, decided by measurement: one normaliser against Liger's mix.

* one normaliser (the form as shipped, `attnopt/forms/gla_window/reference.py`): o = (Σ_W e^{s q·k} v +
  β_h Σ_L a v) / (Σ_W e^{s q·k} + β_h Σ_L a), the gated part over the keys that left the window;
* Liger (Lan et al. 2025, OpenSparseLLMs/Linearization `modeling_liger_gla.py`): o = (1 − λ_h)·window
  softmax + λ_h·GLA over every key, λ_h = σ(ℓ_h) learnable from Liger's fixed ½ (the GLA normalised
  here, as the form's gla part is; Liger's own is unnormalised and leans on LoRA to rescale it).

Both use the same φ (hedgehog per kv head), the same key-pooled gates, the same compile-time fit
and the same calibration (params="forms+lora"). The Liger variant is this script's own site
module method, patched in for the run; nothing of it ships. On the tiny LM (benchmarks/fidelity.py's
data: calibrated on its 40 training windows, perplexity on its 40 held-out windows):

    python benchmarks/gla_window_mixing.py        # -> benchmarks/results/gla_window_mixing/<machine>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def liger_attend(self, q, k, v, keep, mask, x):
    """(1 − λ) · window softmax + λ · normalised GLA, λ = σ(log_beta) per query head (½ at β = 1)."""
    import torch

    from attnopt.forms.gla.reference import gated_linear_attention
    from attnopt.forms.window.reference import window_attention

    o = self.options()
    phi_q, phi_k = self.gates.features(q, k, self.geometry.scale)
    win = window_attention(q, k, v, window=o["window"], causal=True, sinks=o["sinks"], scale=o["scale"], key_mask=keep)
    gla = gated_linear_attention(phi_q, phi_k, v, self.gates.log_gates(k), feature_map="identity", normalize=True,
                                 key_mask=keep)
    lam = torch.sigmoid(self.log_beta).to(q.dtype)[None, :, None, None]
    return (1 - lam) * win + lam * gla


def measure(variant: str, policy: str, steps: int, n_cal: int, n_held: int) -> dict:
    import torch

    import attnopt
    import attnopt.forms.gla_window.form as gla_window_form

    sys.path.insert(0, str(ROOT))
    import fidelity

    if variant == "liger":
        gla_window_form.GlaWindowSite.attend = liger_attend
    model, cal, guard, held_sets = fidelity.tiny_lm_data(n_cal, n_held)
    held = held_sets[fidelity.TOPICS]
    ref = fidelity.logits_of(model, held)
    torch.manual_seed(0)
    opt = attnopt.compile(model, policy, example_inputs=cal[0], tolerance=10.0, e2e_tolerance=None, dispatch="off")
    row = {"variant": variant, "policy": policy, "before": fidelity.decoder_scores(ref, fidelity.logits_of(opt, held), held)}
    t0 = time.perf_counter()
    attnopt.calibrate(opt, cal, held_out=guard, steps=steps, params="forms+lora", progress=False)
    row["calibration_seconds"] = round(time.perf_counter() - t0, 1)
    row["after"] = fidelity.decoder_scores(ref, fidelity.logits_of(opt, held), held)
    row["original"] = fidelity.decoder_scores(ref, ref, held)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=("one_normaliser", "liger"), default=None,
                    help="one variant in this process (the driver runs each in its own)")
    ap.add_argument("--policy", default="gla+window:64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--calibration-texts", type=int, default=40)
    ap.add_argument("--held-out-texts", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON path instead of results/gla_window_mixing/<machine>.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    variants = [args.variant] if args.variant else ["one_normaliser", "liger"]
    rows = []
    for variant in variants:  # the patch is process-wide: a fresh interpreter per variant
        if args.variant is None:
            import subprocess

            tmp = Path(tempfile.gettempdir()) / f"gla_window_mixing.{os.getpid()}.{variant}.json"
            subprocess.run([sys.executable, __file__, "--variant", variant, "--policy", args.policy, "--steps",
                            str(args.steps), "--threads", str(args.threads), "--calibration-texts",
                            str(args.calibration_texts), "--held-out-texts", str(args.held_out_texts), "--out", str(tmp)],
                           check=True)
            rows += json.loads(tmp.read_text())["rows"]
            tmp.unlink()
        else:
            rows.append(measure(variant, args.policy, args.steps, args.calibration_texts, args.held_out_texts))
    result = {"benchmark": "gla+window mixing, tiny LM held out", "steps": args.steps, "params": "forms+lora",
              "threads": args.threads, "calibration_texts": args.calibration_texts, "held_out_texts": args.held_out_texts,
              "held_out": "tiny_lm's held-out topics; calibrate's guard: a batch of training windows it does not train on",
              "load_average": list(os.getloadavg()), "rows": rows}
    if args.out is None and args.variant is None:
        sys.path.insert(0, str(ROOT))
        from resultfile import write_result

        out = write_result("gla_window_mixing", result)
    else:
        out = Path(args.out or Path(tempfile.gettempdir()) / "gla_window_mixing.json")
        out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
