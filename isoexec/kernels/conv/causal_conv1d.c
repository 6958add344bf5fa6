/* Depthwise causal conv1d taps on CPU (region gdn.conv1d): the fp32 tap sum of every requested output
 * row, the SiLU after it stays in torch (isoexec/kernels/conv/cpu.py; libm's expf does not give the bits
 * of ATen's exp, which defines the region).
 *
 * out[r][c] = ((x[f+0][c] w[0][c] + x[f+1][c] w[1][c]) + x[f+2][c] w[2][c]) + ...   f = first[r]
 * Bits: per element one fp32 product per tap and one add per tap after the first, taps ascending
 * (compile with -ffp-contract=off, no -ffast-math): the operations of the torch expression
 * ``x[f:]*w[0] + x[f+1:]*w[1] + ...``, so an element's bits depend only on its own taps, never on its
 * row, channel or the other rows. The loop over channels vectorises without changing any element.
 *
 * Layout: x [R, CH] fp32 (the pieces with their prefixes, concatenated), w [KC, CH] fp32 (tap j's
 * weights contiguous), first [N] int64 (the row of x holding output r's first tap), out [N, CH] fp32.
 *
 * Backward (isoexec_causal_conv1d_bwd; the gradient need not be bitwise): given dout [N, CH],
 * dx[first[r] + j] += dout[r] w[j] and dw[j] += dout[r] x[first[r] + j], fp32, rows ascending; dx and dw
 * are zeroed here.
 */
#include <stdint.h>
#include <string.h>

void isoexec_causal_conv1d(const float *restrict x, const float *restrict w, const int64_t *restrict first,
                           float *restrict out, int64_t N, int64_t CH, int64_t KC) {
    for (int64_t r = 0; r < N; ++r) {
        const float *restrict xr = x + first[r] * CH;
        float *restrict o = out + r * CH;
        for (int64_t c = 0; c < CH; ++c) o[c] = xr[c] * w[c];
        for (int64_t j = 1; j < KC; ++j) {
            const float *restrict xj = xr + j * CH, *restrict wj = w + j * CH;
            for (int64_t c = 0; c < CH; ++c) o[c] = o[c] + xj[c] * wj[c];
        }
    }
}

void isoexec_causal_conv1d_bwd(const float *restrict x, const float *restrict w, const int64_t *restrict first,
                               const float *restrict dout, float *restrict dx, float *restrict dw, int64_t R,
                               int64_t N, int64_t CH, int64_t KC) {
    memset(dx, 0, sizeof(float) * R * CH);
    memset(dw, 0, sizeof(float) * KC * CH);
    for (int64_t r = 0; r < N; ++r) {
        const float *restrict g = dout + r * CH;
        for (int64_t j = 0; j < KC; ++j) {
            const float *restrict xj = x + (first[r] + j) * CH, *restrict wj = w + j * CH;
            float *restrict dxj = dx + (first[r] + j) * CH, *restrict dwj = dw + j * CH;
            for (int64_t c = 0; c < CH; ++c) {
                dxj[c] += g[c] * wj[c];
                dwj[c] += g[c] * xj[c];
            }
        }
    }
}
