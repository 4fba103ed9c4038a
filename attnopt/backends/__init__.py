"""Lowerings of the rewritten graph: inductor, onnx/ort, tensorrt."""
