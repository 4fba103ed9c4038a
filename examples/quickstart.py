"""Quickstart: find a trained decoder's attention, rewrite it, see what moved, generate, save and load.

    python examples/quickstart.py        # from the repository root, about 20 s on 2 CPU cores

The model is the small byte-level Llama shipped in benchmarks/data/tiny_lm (4 layers, trained on
the Python reference manual's help text, context 256): its token ids are the UTF-8 bytes of the text.
"""

import tempfile
from pathlib import Path

import torch
import transformers

import attnopt

TINY_LM = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "tiny_lm"

model = transformers.AutoModelForCausalLM.from_pretrained(TINY_LM)
text = (TINY_LM / "heldout.txt").read_text(encoding="utf-8")[:256]
input_ids = torch.tensor([list(text.encode("utf-8"))[:256]])  # one row of byte ids

# What attention is there (and what looked like attention but was not taken, with the reason)?
print(attnopt.inspect(model, input_ids=input_ids))

# --8<-- [start:compile]
# Rewrite a copy: softmax over the last 64 keys plus 4 sink tokens, each site verified against the
# original on the example; a site that drifts too far stays exact. The original model is untouched.
# dispatch="off": the form at every length. By default each site runs exact attention below the
# length from which its form measured faster on this machine (1024 tokens or more for a window on
# CPU), which this 256-token model never reaches.
opt = attnopt.compile(model, "window:64+sinks:4", example_inputs={"input_ids": input_ids}, dispatch="off")
report = opt.attnopt_report
print(report)
for site in report.sites:  # per site: the form kept, its drift where it acts, and from which length it acts
    outcome, threshold = site.outcome, site.threshold
    drift = "—" if outcome.drift is None else f"{outcome.drift.rel_rms:.3f}"
    acts_from = "—" if threshold is None else f"{threshold.min_seq_len} tokens ({threshold.source})"
    print(f"{outcome.site_id}: {outcome.final_form} ({outcome.status}), drift {drift}, acts from {acts_from}")

with torch.no_grad():
    drift = (opt(input_ids).logits - model(input_ids).logits).norm() / model(input_ids).logits.norm()
print(f"logits relative RMS drift: {drift:.4f}")
# --8<-- [end:compile]

# Generate: each rewritten site decodes from a fixed-size state (here 4 + 63 keys per layer).
prompt = input_ids[:, :64]
new = opt.generate(prompt, max_new_tokens=32, do_sample=False)
print(repr(bytes(new[0, 64:].tolist()).decode("utf-8", errors="replace")))

# Save and load: a fresh process gets the same rewritten model back.
# --8<-- [start:saveload]
with tempfile.TemporaryDirectory() as folder:
    attnopt.save(opt, folder)
    loaded = attnopt.load(folder)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, opt(input_ids).logits)
# --8<-- [end:saveload]
print("saved and loaded: same logits")
