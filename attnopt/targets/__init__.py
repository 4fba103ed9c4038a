"""The two rewrite mechanisms behind one protocol (graph: torch.export; hf: transformers)."""
