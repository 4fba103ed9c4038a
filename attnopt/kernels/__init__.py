"""Rewrite forms as ops: PyTorch reference, torch.library registration (fake + autograd)."""
