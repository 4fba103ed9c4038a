"""window: softmax over a band of W keys plus S sink tokens (StreamingLLM)."""
