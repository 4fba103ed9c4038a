"""gla: gated linear attention, S_t = diag(exp g_t) S_{t−1} + φ(k_t) v_tᵀ, gates pooled from the site's keys (Liger)."""
