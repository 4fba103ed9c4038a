"""Export a rewritten decoder for decoding and generate with ONNX Runtime: the tokens equal torch's.

    python examples/export_onnx.py                             # linear, 24 new tokens after a 32-token prompt
    python examples/export_onnx.py --policy window:16+sinks:2 --target onnx-std --new 40

A Llama-style decoder from a config (random weights) is compiled and exported with
`attnopt.export_onnx(opt, folder, decode=True)`: one model.onnx for the prompt and every new token,
with the states it carries between calls (checked against torch's generate() before it is kept),
plus genai_config.json for onnxruntime-genai. `attnopt.onnx.Generator` (numpy and onnxruntime only)
then generates from the folder, greedy, and so does the compiled torch model.
"""

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
import transformers

import attnopt
from attnopt.onnx import Generator


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="linear")
    p.add_argument("--target", default="ort", choices=["ort", "onnx-std"])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=24, help="tokens to generate")
    p.add_argument("--out", default=None, help="the folder to write (default: a temporary one)")
    a = p.parse_args(argv)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt = torch.randint(1, 1000, (1, a.prompt_len), generator=torch.Generator().manual_seed(0))
    opt = attnopt.compile(model, a.policy, example_inputs={"input_ids": prompt}, e2e_tolerance=None)  # random weights
    folder = Path(a.out) if a.out else Path(tempfile.mkdtemp()) / "decoder"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the crossover's timing notes)
        record = attnopt.export_onnx(opt, folder, {"input_ids": prompt}, target=a.target, decode=True)
    # Random weights: their "end-of-sequence" token is just another token, so neither side stops at it
    # (eos_token_id=None; by default both stop a row at the model's eos, as a trained model wants).
    ort_tokens = Generator(folder).generate(prompt.numpy(), max_new_tokens=a.new, eos_token_id=None)
    opt.generation_config.eos_token_id = None
    with torch.no_grad():
        torch_tokens = opt.generate(input_ids=prompt, max_new_tokens=a.new, do_sample=False, pad_token_id=0).numpy()
    ort_new, torch_new = ort_tokens[0, a.prompt_len:].tolist(), torch_tokens[0, a.prompt_len:].tolist()
    lowered = sorted({s["lowering"] for s in record.sites})
    print(f"{a.policy} → {folder} ({a.target}; {', '.join(lowered)}; files: {', '.join(record.files)})")
    print(f"ONNX Runtime: {ort_new}")
    print(f"torch:        {torch_new}")
    print(f"same tokens: {ort_new == torch_new}")
    return record, ort_new, torch_new


if __name__ == "__main__":
    main()
