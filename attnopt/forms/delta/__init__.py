"""delta: the gated delta rule S_t = exp(g_t)(I − β_t k_t k_tᵀ)S_{t−1} + β_t k_t v_tᵀ on L2-normalised q and k."""
