"""linear+window: softmax inside a window, β-weighted linear attention outside it, one normaliser."""
