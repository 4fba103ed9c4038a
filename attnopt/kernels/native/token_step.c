/* attnopt's one-token decoding steps in C, for float32 CPU tensors (loaded with ctypes by
 * attnopt/kernels/native/__init__.py). Each is the eager step of attnopt/kernels/token_step.py or of
 * the window's RingStep in one call: on a CPU a step of eight small torch ops pays eight dispatches
 * (about 5 µs each on a slow core), while its arithmetic is a few thousand flops.
 *
 * Layouts, all dense (row-major): B batch, H query heads, Hkv kv heads (H = G·Hkv), M features
 * (= the head dim: φ is ELU + 1), Dv value dim, W = Dv + 1 when a ones column carries z, else Dv.
 */
#include <math.h>
#include <stddef.h>

#define ATTNOPT_MAX_DIM 1024

/* A step's fixed arguments, set once per state (attnopt/kernels/native/__init__.py mirrors them):
 * each call then passes only the new token's tensors. */
typedef struct {
    float *T;            /* [B, H, M, W] */
    const float *gamma;  /* [H], or NULL: no decay */
    int B, H, Hkv, M, Dv, normalize, guard_zero;
    float eps, out_scale;
} PackedStep;

typedef struct {
    float *K, *V;        /* [B, Hkv, S, D], [B, Hkv, S, Dv] */
    int B, H, Hkv, S, D, Dv;
    float scale;
} RingStep;

/* ELU(x) + 1: x + 1 above 0, exp(x) at or below (torch's expm1(x) + 1, up to its last bit). */
static float elu_plus_one(float x) { return x > 0.0f ? x + 1.0f : expf(x); }

/* T [B, H, M, W] ← γ_h·T + φ(k) ⊗ [v ‖ 1]; out [B, H, Dv] = φ(q)ᵀT[:, :Dv] / (φ(q)ᵀz + eps) when
 * normalize (a zero denominator counts as 1 when guard_zero), else out_scale · φ(q)ᵀT.
 * q [B, H, M], k [B, Hkv, M], v [B, Hkv, Dv]. Returns 0, or -1 when a dimension exceeds
 * ATTNOPT_MAX_DIM (nothing written). */
int attnopt_packed_step(const PackedStep *a, const float *q, const float *k, const float *v, float *out) {
    float *T = a->T;
    const float *gamma = a->gamma;
    const int B = a->B, H = a->H, Hkv = a->Hkv, M = a->M, Dv = a->Dv, normalize = a->normalize;
    const int guard_zero = a->guard_zero;
    const float eps = a->eps, out_scale = a->out_scale;
    if (M > ATTNOPT_MAX_DIM || Dv > ATTNOPT_MAX_DIM || Hkv <= 0 || H % Hkv != 0) return -1;
    const int W = normalize ? Dv + 1 : Dv, G = H / Hkv;
    float phi_q[ATTNOPT_MAX_DIM], phi_k[ATTNOPT_MAX_DIM], num[ATTNOPT_MAX_DIM];
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const float *q_M = q + ((size_t)b * H + h) * M;
            const float *v_D = v + ((size_t)b * Hkv + h / G) * Dv;
            float *T_MW = T + ((size_t)b * H + h) * (size_t)M * W;
            if (h % G == 0) {  /* φ(k) once per kv head, for its G query heads */
                const float *k_M = k + ((size_t)b * Hkv + h / G) * M;
                for (int i = 0; i < M; i++) phi_k[i] = elu_plus_one(k_M[i]);
            }
            for (int i = 0; i < M; i++) phi_q[i] = elu_plus_one(q_M[i]);
            for (int j = 0; j < Dv; j++) num[j] = 0.0f;
            float den = 0.0f;
            const float g = gamma ? gamma[h] : 1.0f;
            for (int i = 0; i < M; i++) {
                float *row = T_MW + (size_t)i * W;
                const float a_i = phi_k[i], c_i = phi_q[i];
                if (gamma) {
                    for (int j = 0; j < Dv; j++) { row[j] = g * row[j] + a_i * v_D[j]; num[j] += c_i * row[j]; }
                    if (normalize) { row[Dv] = g * row[Dv] + a_i; den += c_i * row[Dv]; }
                } else {
                    for (int j = 0; j < Dv; j++) { row[j] += a_i * v_D[j]; num[j] += c_i * row[j]; }
                    if (normalize) { row[Dv] += a_i; den += c_i * row[Dv]; }
                }
            }
            float *o = out + ((size_t)b * H + h) * Dv;
            if (normalize) {
                den += eps;
                if (guard_zero && den == 0.0f) den = 1.0f;
                for (int j = 0; j < Dv; j++) o[j] = num[j] / den;
            } else {
                for (int j = 0; j < Dv; j++) o[j] = num[j] * out_scale;
            }
        }
    }
    return 0;
}

/* The ring's step: writes k, v into slot `slot` of K and V, then
 * out [B, H, Dv] = softmax(scale · q Kᵀ) V over all S slots (q [B, H, D], k [B, Hkv, D],
 * v [B, Hkv, Dv]). Returns 0, or -1 when S exceeds ATTNOPT_MAX_DIM (nothing written). */
int attnopt_ring_step(const RingStep *a, const float *q, const float *k, const float *v, float *out, int slot) {
    float *K = a->K, *V = a->V;
    const int B = a->B, H = a->H, Hkv = a->Hkv, S = a->S, D = a->D, Dv = a->Dv;
    const float scale = a->scale;
    if (S > ATTNOPT_MAX_DIM || slot < 0 || slot >= S || Hkv <= 0 || H % Hkv != 0) return -1;
    const int G = H / Hkv;
    float p[ATTNOPT_MAX_DIM];
    for (int b = 0; b < B; b++) {
        for (int hk = 0; hk < Hkv; hk++) {
            float *K_D = K + (((size_t)b * Hkv + hk) * S + slot) * D;
            float *V_D = V + (((size_t)b * Hkv + hk) * S + slot) * Dv;
            const float *k_D = k + ((size_t)b * Hkv + hk) * D, *v_D = v + ((size_t)b * Hkv + hk) * Dv;
            for (int i = 0; i < D; i++) K_D[i] = k_D[i];
            for (int j = 0; j < Dv; j++) V_D[j] = v_D[j];
        }
        for (int h = 0; h < H; h++) {
            const float *q_D = q + ((size_t)b * H + h) * D;
            const float *K_SD = K + ((size_t)b * Hkv + h / G) * (size_t)S * D;
            const float *V_SD = V + ((size_t)b * Hkv + h / G) * (size_t)S * Dv;
            float top = -INFINITY;
            for (int s = 0; s < S; s++) {
                float dot = 0.0f;
                for (int i = 0; i < D; i++) dot += q_D[i] * K_SD[(size_t)s * D + i];
                p[s] = dot * scale;
                if (p[s] > top) top = p[s];
            }
            float total = 0.0f;
            for (int s = 0; s < S; s++) { p[s] = expf(p[s] - top); total += p[s]; }
            float *o = out + ((size_t)b * H + h) * Dv;
            for (int j = 0; j < Dv; j++) o[j] = 0.0f;
            for (int s = 0; s < S; s++) {
                const float w = p[s] / total;
                for (int j = 0; j < Dv; j++) o[j] += w * V_SD[(size_t)s * Dv + j];
            }
        }
    }
    return 0;
}
