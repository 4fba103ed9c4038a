"""gla+window: softmax in a sliding window (plus sinks), gated linear attention beyond it, one normaliser."""
