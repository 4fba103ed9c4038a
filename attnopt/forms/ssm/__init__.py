"""ssm: decayed linear attention S_t = γ S_{t−1} + φ(k_t) v_tᵀ (RetNet retention), causal sites only."""
