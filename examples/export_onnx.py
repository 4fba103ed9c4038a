"""Export a rewritten decoder to ONNX and run the file in ONNX Runtime at another length.

    python examples/export_onnx.py                            # linear, 256-token export, run at 777
    python examples/export_onnx.py --policy ssm --target onnx-std --export-len 64 --run-len 100

A Llama-style decoder from a config (random weights) is compiled, exported with
`attnopt.export_onnx` (which checks the file against torch in ONNX Runtime before keeping it), and
the file is then run here at a length it was not exported at, against the compiled torch model.
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import transformers

import attnopt


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="linear")
    p.add_argument("--target", default="ort", choices=["ort", "onnx-std", "custom"])
    p.add_argument("--export-len", type=int, default=256)
    p.add_argument("--run-len", type=int, default=777)
    p.add_argument("--out", default=None, help="the .onnx path (default: a temporary directory)")
    a = p.parse_args(argv)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    example = {"input_ids": torch.randint(1, 1000, (1, a.export_len), generator=gen), "use_cache": False}
    opt = attnopt.compile(model, a.policy, example_inputs=example, e2e_tolerance=None)  # random weights
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp()) / "model.onnx"
    record = attnopt.export_onnx(opt, out, example, target=a.target)
    ids = torch.randint(1, 1000, (2, a.run_len), generator=gen)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: ids.numpy()})[:1]
    with torch.no_grad():
        ref = opt(input_ids=ids, use_cache=False).logits.numpy()
    rel = float(np.sqrt(((logits - ref) ** 2).mean() / (ref ** 2).mean()))
    lowered = sorted({s["lowering"] for s in record.sites})
    print(f"{a.policy} → {out} ({a.target}; {', '.join(lowered)}); ONNX Runtime at {a.run_len} tokens, batch 2: "
          f"relative RMS {rel:.2e} against torch")
    return record, rel


if __name__ == "__main__":
    main()
