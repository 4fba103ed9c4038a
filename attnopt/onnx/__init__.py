"""Generate from a decode folder written by `attnopt.export_onnx(..., decode=True)`, outside PyTorch.

    from attnopt.onnx import Generator
    tokens = Generator("out_dir").generate(input_ids, attention_mask, max_new_tokens=32)

Needs numpy and onnxruntime only (no torch): the folder's model.onnx carries its I/O contract in
metadata_props["attnopt.decode"] (contract.py), and the runner (generator.py) knows nothing else.
`attnopt generate DIR --prompt ...` (cli.py) runs it on folders that hold a tokenizer.
"""

from attnopt.onnx.contract import CONTRACT_KEY, Contract, hf_positions
from attnopt.onnx.generator import Generator, Session

__all__ = ["Generator", "Session", "Contract", "CONTRACT_KEY", "hf_positions"]
