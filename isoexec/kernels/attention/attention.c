/* Causal GQA attention on CPU (region attn.core): forward with fixed bits, and its gradient.
 *
 * Forward, per query row (one query of one sequence, one query head), with the row's absolute
 * position p and its sequence's keys 0..p (online softmax: Milakov & Gimelshein 2018; Dao et al.,
 * FlashAttention 2022), keys visited in blocks of BK absolute positions from block 0 upwards:
 *     s_j   = sum_d q_d k_jd                 one fmaf chain, d ascending (q pre-scaled by D^-0.5)
 *     m'    = max(m, max_j s_j)              over the block's keys j <= p
 *     p_j   = expf(s_j - m')
 *     l     = l * expf(m - m') + sum_j p_j   j ascending
 *     acc_d = acc_d * expf(m - m') + b_d,    b_d = sum_j p_j v_jd, one fmaf chain, j ascending
 *     o_d   = acc_d / l
 * A row's operations depend only on its query, its position and its sequence's keys 0..p: never on
 * the other rows, on how many queries of the sequence are in the call (prefill, chunked prefill,
 * decode), or on the other sequences. Vector lanes run over independent keys j (s) or features d
 * (b): the SIMD width changes no result. Compile with -ffp-contract=off and without -ffast-math.
 *
 * Backward (not bitwise; the gradient of the same function, FlashAttention's recomputation): per row,
 * P_j = expf(s_j - m) / l from the forward's m and l, dP_j = dO . v_j, dS_j = P_j (dP_j - dO . o),
 * dq = sum_j dS_j k_j, dk_j += dS_j q, dv_j += P_j dO, in fp32.
 *
 * Layout: q, o, dq, dout [N, HQ, D] fp32; sequence b owns rows row0[b] .. row0[b]+len[b]-1, at
 * positions start[b] + t; its keys and values (start[b] + len[b] rows) are at kp[b] / vp[b], row r of
 * kv head h at element r * ks[b] + h * D / r * vs[b] + h * D, fp32 or bf16 (kv_bf16); m, l [N, HQ] fp32; the
 * gradients dk, dv of sequence b go to dkp[b] / dvp[b], fp32 [start[b] + len[b], HKV, D] contiguous.
 * Returns 0, or -1 when a buffer cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float load(const void *base, int bf16, int64_t i) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* keys or values 0..n-1 of kv head h: row-major [n][D] into rm and/or transposed [D][ld] into tr */
static void gather(const void *base, int bf16, int64_t stride, int64_t h, int64_t D, int64_t n, float *rm,
                   float *tr, int64_t ld) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t d = 0; d < D; d++) {
            float x = load(base, bf16, r * stride + h * D + d);
            if (rm) rm[r * D + d] = x;
            if (tr) tr[d * ld + r] = x;
        }
}

/* s[j] = q . k_{j0+j} for j < n: one fmaf chain per key over d ascending, lanes over keys */
static void scores(const float *q, const float *kt, int64_t ld, int64_t D, int64_t j0, int64_t n, float *s) {
    for (int64_t j = 0; j < n; j++) s[j] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        const float qd = q[d], *kr = kt + d * ld + j0;
        for (int64_t j = 0; j < n; j++) s[j] = fmaf(qd, kr[j], s[j]);
    }
}

static int64_t max_keys(const int64_t *start, const int64_t *len, int64_t B) {
    int64_t mk = 1;
    for (int64_t b = 0; b < B; b++)
        if (start[b] + len[b] > mk) mk = start[b] + len[b];
    return (mk + 15) / 16 * 16;
}

int isoexec_attention_fwd(const float *q, const int64_t *kp, const int64_t *vp, const int64_t *ks, const int64_t *vs, int kv_bf16,
                          const int64_t *row0, const int64_t *start, const int64_t *len, int64_t B, int64_t HQ,
                          int64_t HKV, int64_t D, int64_t BK, float *o, float *mo, float *lo) {
    const int64_t group = HQ / HKV, ld = max_keys(start, len, B);
    float *kt = malloc(sizeof(float) * D * ld), *vf = malloc(sizeof(float) * ld * D);
    float *s = malloc(sizeof(float) * BK), *acc = malloc(sizeof(float) * D), *blk = malloc(sizeof(float) * D);
    int rc = (kt && vf && s && acc && blk) ? 0 : -1;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        const int64_t nk = start[b] + len[b];
        for (int64_t h = 0; h < HKV; h++) {
            gather((const void *)kp[b], kv_bf16, ks[b], h, D, nk, NULL, kt, ld);
            gather((const void *)vp[b], kv_bf16, vs[b], h, D, nk, vf, NULL, 0);
            for (int64_t t = 0; t < len[b]; t++) {
                const int64_t pos = start[b] + t;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t row = (row0[b] + t) * HQ + h * group + g;
                    const float *qr = q + row * D;
                    float m = -INFINITY, l = 0.0f;
                    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
                    for (int64_t j0 = 0; j0 <= pos; j0 += BK) {
                        const int64_t n = (j0 + BK <= pos + 1) ? BK : pos + 1 - j0;
                        scores(qr, kt, ld, D, j0, n, s);
                        float mn = m;
                        for (int64_t j = 0; j < n; j++) mn = s[j] > mn ? s[j] : mn;
                        const float alpha = expf(m - mn);
                        float ps = 0.0f;
                        for (int64_t j = 0; j < n; j++) {
                            s[j] = expf(s[j] - mn);
                            ps += s[j];
                        }
                        l = l * alpha + ps;
                        for (int64_t d = 0; d < D; d++) blk[d] = 0.0f;
                        for (int64_t j = 0; j < n; j++) {
                            const float pj = s[j], *vr = vf + (j0 + j) * D;
                            for (int64_t d = 0; d < D; d++) blk[d] = fmaf(pj, vr[d], blk[d]);
                        }
                        for (int64_t d = 0; d < D; d++) acc[d] = acc[d] * alpha + blk[d];
                        m = mn;
                    }
                    float *orow = o + row * D;
                    for (int64_t d = 0; d < D; d++) orow[d] = acc[d] / l;
                    mo[row] = m;
                    lo[row] = l;
                }
            }
        }
    }
    free(kt), free(vf), free(s), free(acc), free(blk);
    return rc;
}

int isoexec_attention_bwd(const float *q, const int64_t *kp, const int64_t *vp, const int64_t *ks, const int64_t *vs, int kv_bf16,
                          const int64_t *row0, const int64_t *start, const int64_t *len, int64_t B, int64_t HQ,
                          int64_t HKV, int64_t D, const float *o, const float *dout, const float *mo,
                          const float *lo, float *dq, const int64_t *dkp, const int64_t *dvp) {
    const int64_t group = HQ / HKV, ld = max_keys(start, len, B);
    float *kt = malloc(sizeof(float) * D * ld), *kf = malloc(sizeof(float) * ld * D);
    float *vt = malloc(sizeof(float) * D * ld), *dk = malloc(sizeof(float) * ld * D);
    float *dv = malloc(sizeof(float) * ld * D), *p = malloc(sizeof(float) * ld), *ds = malloc(sizeof(float) * ld);
    int rc = (kt && kf && vt && dk && dv && p && ds) ? 0 : -1;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        const int64_t nk = start[b] + len[b];
        for (int64_t h = 0; h < HKV; h++) {
            gather((const void *)kp[b], kv_bf16, ks[b], h, D, nk, kf, kt, ld);
            gather((const void *)vp[b], kv_bf16, vs[b], h, D, nk, NULL, vt, ld);
            memset(dk, 0, sizeof(float) * nk * D);
            memset(dv, 0, sizeof(float) * nk * D);
            for (int64_t t = 0; t < len[b]; t++) {
                const int64_t n = start[b] + t + 1;
                for (int64_t g = 0; g < group; g++) {
                    const int64_t row = (row0[b] + t) * HQ + h * group + g;
                    const float *qr = q + row * D, *gr = dout + row * D, *orow = o + row * D;
                    float di = 0.0f;
                    for (int64_t d = 0; d < D; d++) di += gr[d] * orow[d];
                    scores(qr, kt, ld, D, 0, n, p);
                    const float m = mo[row], inv = 1.0f / lo[row];
                    for (int64_t j = 0; j < n; j++) p[j] = expf(p[j] - m) * inv;
                    scores(gr, vt, ld, D, 0, n, ds); /* dP_j = dO . v_j */
                    for (int64_t j = 0; j < n; j++) ds[j] = p[j] * (ds[j] - di);
                    float *dqr = dq + row * D;
                    for (int64_t d = 0; d < D; d++) dqr[d] = 0.0f;
                    for (int64_t j = 0; j < n; j++) {
                        const float sj = ds[j], pj = p[j], *kr = kf + j * D;
                        float *dkr = dk + j * D, *dvr = dv + j * D;
                        for (int64_t d = 0; d < D; d++) {
                            dqr[d] = fmaf(sj, kr[d], dqr[d]);
                            dkr[d] = fmaf(sj, qr[d], dkr[d]);
                            dvr[d] = fmaf(pj, gr[d], dvr[d]);
                        }
                    }
                }
            }
            float *dko = (float *)dkp[b], *dvo = (float *)dvp[b];
            for (int64_t r = 0; r < nk; r++) {
                memcpy(dko + (r * HKV + h) * D, dk + r * D, sizeof(float) * D);
                memcpy(dvo + (r * HKV + h) * D, dv + r * D, sizeof(float) * D);
            }
        }
    }
    free(kt), free(kf), free(vt), free(dk), free(dv), free(p), free(ds);
    return rc;
}
