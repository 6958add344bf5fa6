/* Fixed binary-tree sum of each row (isoexec.kernels.primitives.tree_sum without autograd).
 *
 * Per row of n fp32 values: zero-pad to p = the smallest power of two >= n, then while p > 1 add the
 * second half onto the first, element by element (x[i] = x[i] + x[i + p/2], i < p/2) and halve p. These
 * are exactly the elementwise adds of the torch expression (x.narrow(0, h) + x.narrow(h, h) repeated),
 * one IEEE fp32 add each (compile without -ffast-math), so a row's sum depends on nothing but the row.
 *
 * Layout: x [rows, n] fp32 row-major; out [rows]; work holds p floats.
 */
#include <stdint.h>
#include <string.h>

void isoexec_tree_sum(const float *restrict x, float *restrict out, int64_t rows, int64_t n, int64_t p,
                      float *restrict work) {
    for (int64_t r = 0; r < rows; ++r) {
        memcpy(work, x + r * n, sizeof(float) * (size_t)n);
        for (int64_t i = n; i < p; ++i) work[i] = 0.0f;
        for (int64_t h = p / 2; h >= 1; h /= 2)
            for (int64_t i = 0; i < h; ++i) work[i] = work[i] + work[i + h];
        out[r] = work[0];
    }
}
