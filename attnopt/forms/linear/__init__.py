"""linear: kernelised attention φ(q)ᵀS / (φ(q)ᵀz + ε) with a feature map φ (elu, relu, favor, hedgehog, taylor)."""
