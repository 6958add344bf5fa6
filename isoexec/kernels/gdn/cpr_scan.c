/* CPR in-chunk scan on CPU (region gdn.core): the plain gated delta rule, token by token, for many
 * (segment, head) states at once, one pass over each state per token.
 *
 * Per head with state S [DK, DV] (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025):
 *     S   = S * d_t                      d_t = exp(g_t), computed by the caller
 *     kv  = sum_i k_i S_i                i ascending, fp32
 *     u   = (v_t - kv) * beta_t
 *     S   = S + k u^T
 *     o_t = sum_i q_i S_i                q pre-scaled by DK^-0.5; i ascending, fp32
 *
 * Bits: every product and sum is one IEEE fp32 operation in a fixed order (compile with
 * -ffp-contract=off and without -ffast-math: no FMA contraction, no reassociation). Vector lanes run
 * over the DV columns, which are independent, so the SIMD width does not change a result, and a
 * state's result depends only on its own inputs (never on the number of states or its index).
 *
 * Layout: tokens [N, H, D] (row-major, fp32); segment s covers token rows row0[s] .. row0[s]+len[s]-1,
 * starts from the H states at src[s] ([H, DK, DV] contiguous, only read) and leaves its final states
 * in S[s*H + h]; o [N, H, DV] receives the outputs of those rows.
 */
#include <stdint.h>
#include <string.h>

void isoexec_cpr_scan(float *S, const float *const *src, const float *q, const float *k, const float *v,
                      const float *decay, const float *beta, float *o, const int64_t *row0, const int64_t *len,
                      int64_t nseg, int64_t H, int64_t DK, int64_t DV, float *work) {
    float *kv = work, *u = work + DV, *acc = work + 2 * DV;
    for (int64_t s = 0; s < nseg; ++s) {
        for (int64_t h = 0; h < H; ++h) {
            float *St = S + (s * H + h) * DK * DV;
            memcpy(St, src[s] + h * DK * DV, (size_t)(DK * DV) * sizeof(float));
            for (int64_t t = row0[s]; t < row0[s] + len[s]; ++t) {
                const int64_t r = t * H + h;
                const float *kt = k + r * DK, *qt = q + r * DK, *vt = v + r * DV;
                const float d = decay[r], b = beta[r];
                for (int64_t j = 0; j < DV; ++j) kv[j] = 0.0f;
                for (int64_t i = 0; i < DK; ++i) {
                    float *Si = St + i * DV;
                    const float ki = kt[i];
                    for (int64_t j = 0; j < DV; ++j) {
                        const float sij = Si[j] * d;
                        Si[j] = sij;
                        kv[j] = kv[j] + ki * sij;
                    }
                }
                for (int64_t j = 0; j < DV; ++j) {
                    u[j] = (vt[j] - kv[j]) * b;
                    acc[j] = 0.0f;
                }
                for (int64_t i = 0; i < DK; ++i) {
                    float *Si = St + i * DV;
                    const float ki = kt[i], qi = qt[i];
                    for (int64_t j = 0; j < DV; ++j) {
                        const float sij = Si[j] + ki * u[j];
                        Si[j] = sij;
                        acc[j] = acc[j] + qi * sij;
                    }
                }
                float *ot = o + r * DV;
                for (int64_t j = 0; j < DV; ++j) ot[j] = acc[j];
            }
        }
    }
}
