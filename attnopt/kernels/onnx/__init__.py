"""onnxscript building blocks every form's ONNX lowering shares (functions) and the `OpLowering` a
form hands the exporter (lowering). Nothing is imported here: onnx and onnxscript are optional."""
