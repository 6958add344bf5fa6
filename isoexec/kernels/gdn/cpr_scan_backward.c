/* Gradient of the gated delta rule (region gdn.core, trainer_fwd) on CPU: reverse-time recurrence
 * with per-chunk recomputation of the states, for many (sequence, head) pairs. Not bitwise (the
 * backward need not be); fp32 with a fixed order.
 *
 * Forward per head (the recurrence of cpr_scan.c; q pre-scaled, d_t = exp(g_t)):
 *     S~ = d_t S_{t-1};  kv = S~^T k_t;  u = beta_t (v_t - kv);  S_t = S~ + k_t u^T;  o_t = S_t^T q_t
 * Backward, t = T..1, with dS the gradient flowing into S_t (0 after the last token):
 *     dS += q_t do_t^T;            dq_t = S_t do_t
 *     du  = dS^T k_t;              dk_t = dS u
 *     dbeta_t = du . (v_t - kv);   dv_t = beta_t du;   dkv = -beta_t du
 *     dS~ = dS + k_t dkv^T;        dk_t += S~ dkv
 *     dd_t = <dS~, S_{t-1}>;       dS = d_t dS~            (the caller turns dd_t into dg_t = dd_t d_t)
 * States: the caller gives S at every chunk start (C tokens): the forward's state pass (cpu.py's
 * cpr_gdn), whose chunk entries are the states its in-chunk scan started from, so the gradient is that
 * of the outputs the forward returned. Each chunk is recomputed from its start, keeping its C+1 states,
 * and walked backwards.
 *
 * Sums over the DV columns run in LANES partial sums (then added in lane order), so that they
 * vectorise without -ffast-math; DV must be a multiple of LANES.
 * Layout: tokens [N, H, D] fp32; sequence s covers rows row0[s] .. row0[s]+len[s]-1 from its state
 * entry[e0]; entry[e] is an [H, DK, DV] fp32 state, sequence-major and chunk-ascending: sequence s's
 * chunk c at e = e0 = (number of chunks of sequences 0..s-1) + c, with ceil(len/C) chunks per sequence.
 * A sequence piece under context parallelism (the next rank continues from the state entering chunk
 * J = floor(len/C), the piece's last chunk boundary): ds_tail[s], when not NULL, is the [H, DK, DV]
 * gradient that the later ranks send back for that state; it is added to dS when the walk reaches it.
 * ds_head[s], when not NULL, receives the gradient of the piece's start state entry[e0] (what this
 * rank sends back to the previous one). Both NULL: the plain backward of a sequence from a zero state.
 * Returns 0, -1 when memory could not be allocated, -2 when DV is not a multiple of LANES.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static float lane_sum(const float *lane) {
    float t = 0.0f;
    for (int l = 0; l < LANES; ++l) t += lane[l];
    return t;
}

static void add_state(float *dS, const float *g, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dS[i] += g[i];
}

static void step_forward(float *dst, const float *src, const float *k, const float *v, float d, float b,
                         float *kv, float *u, int64_t DK, int64_t DV) {
    for (int64_t j = 0; j < DV; ++j) kv[j] = 0.0f;
    for (int64_t i = 0; i < DK; ++i) {
        const float *Si = src + i * DV;
        float *Di = dst + i * DV;
        const float ki = k[i];
        for (int64_t j = 0; j < DV; ++j) {
            const float s = Si[j] * d;
            Di[j] = s;
            kv[j] = kv[j] + ki * s;
        }
    }
    for (int64_t j = 0; j < DV; ++j) u[j] = (v[j] - kv[j]) * b;
    for (int64_t i = 0; i < DK; ++i) {
        float *Di = dst + i * DV;
        const float ki = k[i];
        for (int64_t j = 0; j < DV; ++j) Di[j] = Di[j] + ki * u[j];
    }
}

int isoexec_gdn_backward(const float *q, const float *k, const float *v, const float *decay, const float *beta,
                         const float *dout, float *dq, float *dk, float *dv, float *ddecay, float *dbeta,
                         const float *const *entry, const float *const *ds_tail, float *const *ds_head,
                         const int64_t *row0, const int64_t *len, int64_t nseg, int64_t H, int64_t DK, int64_t DV,
                         int64_t C) {
    const int64_t SS = DK * DV;
    if (DV % LANES) return -2;
    float *st = malloc(sizeof(float) * (C + 1) * SS);      /* the states of one chunk */
    float *kvs = malloc(sizeof(float) * C * DV), *us = malloc(sizeof(float) * C * DV);
    float *dS = malloc(sizeof(float) * SS), *du = malloc(sizeof(float) * DV), *dkv = malloc(sizeof(float) * DV);
    if (!st || !kvs || !us || !dS || !du || !dkv) {
        free(st); free(kvs); free(us); free(dS); free(du); free(dkv);
        return -1;
    }
    int64_t e0 = 0;  /* this sequence's first chunk in entry */
    for (int64_t s = 0; s < nseg; ++s) {
        const int64_t L = len[s], nc = (L + C - 1) / C, J = L / C;
        const float *tail = ds_tail ? ds_tail[s] : NULL;
        for (int64_t h = 0; h < H; ++h) {
            /* backward, chunk by chunk from the last */
            memset(dS, 0, sizeof(float) * SS);
            if (tail && J == nc) add_state(dS, tail + h * SS, SS);  /* the piece ends on a chunk boundary */
            for (int64_t c = nc - 1; c >= 0; --c) {
                const int64_t t0 = c * C, t1 = t0 + C < L ? t0 + C : L, n = t1 - t0;
                memcpy(st, entry[e0 + c] + h * SS, sizeof(float) * SS);
                for (int64_t a = 0; a < n; ++a) {
                    const int64_t r = (row0[s] + t0 + a) * H + h;
                    step_forward(st + (a + 1) * SS, st + a * SS, k + r * DK, v + r * DV, decay[r], beta[r],
                                 kvs + a * DV, us + a * DV, DK, DV);
                }
                for (int64_t a = n - 1; a >= 0; --a) {
                    const int64_t r = (row0[s] + t0 + a) * H + h;
                    const float *qt = q + r * DK, *kt = k + r * DK, *vt = v + r * DV, *dot = dout + r * DV;
                    const float *St = st + (a + 1) * SS, *Sp = st + a * SS, *kva = kvs + a * DV, *ua = us + a * DV;
                    const float d = decay[r], b = beta[r];
                    float *dqt = dq + r * DK, *dkt = dk + r * DK, *dvt = dv + r * DV;
                    for (int64_t j = 0; j < DV; ++j) du[j] = 0.0f;
                    for (int64_t i = 0; i < DK; ++i) {
                        const float *Si = St + i * DV;
                        float *dSi = dS + i * DV;
                        const float qi = qt[i], ki = kt[i];
                        float aq[LANES] = {0}, ak[LANES] = {0};
                        for (int64_t j0 = 0; j0 < DV; j0 += LANES) {
                            for (int l = 0; l < LANES; ++l) {
                                const int64_t j = j0 + l;
                                aq[l] += Si[j] * dot[j];
                                const float g = dSi[j] + qi * dot[j];
                                dSi[j] = g;
                                du[j] += g * ki;
                                ak[l] += g * ua[j];
                            }
                        }
                        dqt[i] = lane_sum(aq);
                        dkt[i] = lane_sum(ak);
                    }
                    float dbl[LANES] = {0};
                    for (int64_t j0 = 0; j0 < DV; j0 += LANES) {
                        for (int l = 0; l < LANES; ++l) {
                            const int64_t j = j0 + l;
                            dbl[l] += du[j] * (vt[j] - kva[j]);
                            dvt[j] = b * du[j];
                            dkv[j] = -b * du[j];
                        }
                    }
                    dbeta[r] = lane_sum(dbl);
                    float ddl[LANES] = {0};
                    for (int64_t i = 0; i < DK; ++i) {
                        const float *Pi = Sp + i * DV;
                        float *dSi = dS + i * DV;
                        const float ki = kt[i];
                        float ak[LANES] = {0};
                        for (int64_t j0 = 0; j0 < DV; j0 += LANES) {
                            for (int l = 0; l < LANES; ++l) {
                                const int64_t j = j0 + l;
                                const float p = Pi[j];
                                ak[l] += p * d * dkv[j];
                                const float g = dSi[j] + ki * dkv[j];
                                ddl[l] += g * p;
                                dSi[j] = d * g;
                            }
                        }
                        dkt[i] += lane_sum(ak);
                    }
                    const float dd = lane_sum(ddl);
                    ddecay[r] = dd;
                }
                if (tail && c == J) add_state(dS, tail + h * SS, SS);  /* dS is now at the entry of chunk J */
            }
            if (ds_head && ds_head[s]) memcpy(ds_head[s] + h * SS, dS, sizeof(float) * SS);
        }
        e0 += nc;
    }
    free(st); free(kvs); free(us); free(dS); free(du); free(dkv);
    return 0;
}
