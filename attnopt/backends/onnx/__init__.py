"""ONNX export of compiled models: one lowering per form and target, checked before it is returned.

`attnopt.export_onnx` (export.py) drives `torch.onnx.export(dynamo=True)` with a translation table
built from each form's `onnx_lowering()`; the lowerings themselves (onnxscript, trace mode) live in
one module per form here, the checks (onnx.checker, ONNX Runtime parity, ReferenceEvaluator) in
checks.py. Nothing is imported here: onnx, onnxscript and onnxruntime are optional dependencies.
"""
