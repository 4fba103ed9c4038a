"""reuse: an earlier layer's q and k plus a low-rank residual (x A)(x B)ᵀ."""
