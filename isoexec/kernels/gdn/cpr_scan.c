/* CPR in-chunk scan on CPU (region gdn.core): the plain gated delta rule, token by token, for many
 * (segment, head) states at once.
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
 * Passes: the update of token t (S + k u^T, o_t) and the decay of token t+1 (S * d, kv) touch each
 * row of S in the same order, so they run in one pass over the state: one pass per token, plus one
 * for the first token's decay (which reads the start state, so the copy costs no pass of its own).
 * Every element sees the same operations in the same order as in two passes per token; only the
 * memory traffic changes.
 *
 * Layout: tokens [N, H, D] (row-major, fp32); segment s covers token rows row0[s] .. row0[s]+len[s]-1,
 * starts from the H states at src[s] ([H, DK, DV] contiguous) and leaves its final states at dst[s]
 * (the same layout); dst[s] == src[s] updates the states in place (a decode step advancing a sequence's
 * running state: no copy, half the memory traffic), with the same operations on every element. Several
 * segments may share one dst whose states nobody reads (segments are processed in order).
 * o [N, H, DV] receives the outputs of those rows.
 */
#include <stdint.h>
#include <string.h>

void isoexec_cpr_scan(float *const *dst, const float *const *src, const float *restrict q, const float *restrict k,
                      const float *restrict v, const float *restrict decay, const float *restrict beta,
                      float *restrict o, const int64_t *row0, const int64_t *len, int64_t nseg, int64_t H,
                      int64_t DK, int64_t DV, float *restrict work) {
    float *restrict kv = work, *restrict u = work + DV, *restrict acc = work + 2 * DV;
    for (int64_t s = 0; s < nseg; ++s) {
        for (int64_t h = 0; h < H; ++h) {
            float *restrict St = dst[s] + h * DK * DV;
            const float *S0 = src[s] + h * DK * DV;  /* may be St itself (in place) */
            const int64_t t0 = row0[s], t1 = row0[s] + len[s];
            if (t1 <= t0) {
                if (St != S0) memcpy(St, S0, (size_t)(DK * DV) * sizeof(float));
                continue;
            }
            {   /* decay of the first token, from the start state (the same operations in place or not) */
                const int64_t r = t0 * H + h;
                const float *restrict kt = k + r * DK;
                const float d = decay[r];
                for (int64_t j = 0; j < DV; ++j) kv[j] = 0.0f;
                if (St == S0) {
                    for (int64_t i = 0; i < DK; ++i) {
                        float *restrict Si = St + i * DV;
                        const float ki = kt[i];
                        for (int64_t j = 0; j < DV; ++j) {
                            const float sij = Si[j] * d;
                            Si[j] = sij;
                            kv[j] = kv[j] + ki * sij;
                        }
                    }
                } else {
                    for (int64_t i = 0; i < DK; ++i) {
                        const float *restrict Ai = S0 + i * DV;
                        float *restrict Si = St + i * DV;
                        const float ki = kt[i];
                        for (int64_t j = 0; j < DV; ++j) {
                            const float sij = Ai[j] * d;
                            Si[j] = sij;
                            kv[j] = kv[j] + ki * sij;
                        }
                    }
                }
            }
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t r = t * H + h;
                const float *restrict kt = k + r * DK, *restrict qt = q + r * DK, *restrict vt = v + r * DV;
                const float b = beta[r];
                for (int64_t j = 0; j < DV; ++j) {
                    u[j] = (vt[j] - kv[j]) * b;
                    acc[j] = 0.0f;
                }
                if (t + 1 < t1) {  /* update of token t, then decay of token t+1, in one pass */
                    const int64_t rn = r + H;
                    const float *restrict kn = k + rn * DK;
                    const float dn = decay[rn];
                    for (int64_t j = 0; j < DV; ++j) kv[j] = 0.0f;
                    for (int64_t i = 0; i < DK; ++i) {
                        float *restrict Si = St + i * DV;
                        const float ki = kt[i], qi = qt[i], kni = kn[i];
                        for (int64_t j = 0; j < DV; ++j) {
                            const float sij = Si[j] + ki * u[j];
                            acc[j] = acc[j] + qi * sij;
                            const float snj = sij * dn;
                            Si[j] = snj;
                            kv[j] = kv[j] + kni * snj;
                        }
                    }
                } else {
                    for (int64_t i = 0; i < DK; ++i) {
                        float *restrict Si = St + i * DV;
                        const float ki = kt[i], qi = qt[i];
                        for (int64_t j = 0; j < DV; ++j) {
                            const float sij = Si[j] + ki * u[j];
                            Si[j] = sij;
                            acc[j] = acc[j] + qi * sij;
                        }
                    }
                }
                float *restrict ot = o + r * DV;
                for (int64_t j = 0; j < DV; ++j) ot[j] = acc[j];
            }
        }
    }
}
