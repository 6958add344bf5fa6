/* RMSNorm, gated RMSNorm and l2norm rows on CPU (regions norm.rms, gdn.norm, gdn.l2norm): the forward of
 * every case, with or without autograd (isoexec/kernels/norm/cpu.py), in one call.
 *
 * Per row x of D fp32 values (the caller converts the boundary dtype to fp32, exactly):
 *     ss  = tree sum of x_i * x_i       zero-padded to p = 2^ceil(log2 D), halves added (reduce/tree_sum.c)
 *     rms_norm:   r = 1 / sqrt(ss / D + eps);  out_i = (x_i * r) * s_i,  s_i = 1 + w_i (zero-centred) or w_i
 *     gated:      r as above; y_i = R1(x_i * r); y_i = R2(w_i * y_i); out_i = y_i * s_i, s = silu(z) given
 *     l2norm:     r = 1 / sqrt(ss + eps);     out_i = x_i * r
 * where R1 rounds to bfloat16 (round to nearest even) when x is bf16 and R2 when w * y is (both bf16), else
 * they are the identity. Every step is one IEEE fp32 operation (compile with -ffp-contract=off, no
 * -ffast-math; sqrtf and the divisions are correctly rounded), so an element's bits depend only on its
 * row, in every case. (torch.sqrt on CPU is not correctly rounded, so these are not the torch
 * expression's bits; the gate's SiLU comes in from torch.)
 *
 * Layout: x, s, out [rows, D] fp32 row-major; w [D] fp32; work holds p floats.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static float tree_sum_sq(const float *restrict x, int64_t n, int64_t p, float *restrict work) {
    for (int64_t i = 0; i < n; ++i) work[i] = x[i] * x[i];
    for (int64_t i = n; i < p; ++i) work[i] = 0.0f;
    for (int64_t h = p / 2; h >= 1; h /= 2)
        for (int64_t i = 0; i < h; ++i) work[i] = work[i] + work[i + h];
    return work[0];
}

static float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f; /* NaN stays NaN */
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

void isoexec_rms_norm(const float *restrict x, const float *restrict w, float *restrict out, int64_t rows,
                      int64_t D, int64_t p, float eps, int zero_centered, float *restrict work) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        const float inv = 1.0f / sqrtf(tree_sum_sq(xr, D, p, work) / (float)D + eps);
        for (int64_t i = 0; i < D; ++i) o[i] = (xr[i] * inv) * (zero_centered ? 1.0f + w[i] : w[i]);
    }
}

void isoexec_gated_rms_norm(const float *restrict x, const float *restrict s, const float *restrict w,
                            float *restrict out, int64_t rows, int64_t D, int64_t p, float eps, int round_y,
                            int round_wy, float *restrict work) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * D, *sr = s + r * D;
        float *o = out + r * D;
        const float inv = 1.0f / sqrtf(tree_sum_sq(xr, D, p, work) / (float)D + eps);
        for (int64_t i = 0; i < D; ++i) {
            float y = xr[i] * inv;
            y = round_y ? round_bf16(y) : y;
            y = round_wy ? round_bf16(w[i] * y) : w[i] * y;
            o[i] = y * sr[i];
        }
    }
}

void isoexec_l2norm(const float *restrict x, float *restrict out, int64_t rows, int64_t D, int64_t p, float eps,
                    float *restrict work) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * D;
        float *o = out + r * D;
        const float inv = 1.0f / sqrtf(tree_sum_sq(xr, D, p, work) + eps);
        for (int64_t i = 0; i < D; ++i) o[i] = xr[i] * inv;
    }
}
