/* The state pass's chunk matrix T = (I + A)^-1 on CPU (region gdn.core), for many chunks at once.
 *
 * A is strictly lower triangular ([C, C] per chunk, A[i][m] = beta_i (k_i . k_m) exp(G_i - G_m) for
 * m < i; Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length",
 * NeurIPS 2024, the UT transform), so T is unit lower triangular and forward substitution gives row i
 * from the rows above it:
 *     T[i][j] = -sum_{m=j}^{i-1} A[i][m] T[m][j]      (j < i; T[i][i] = 1, T[i][j] = 0 for j > i)
 * Bits: each sum runs m ascending in fp32, one product and one add per term (compile with
 * -ffp-contract=off, no -ffast-math); the loop runs over j for a fixed m (vectorisable), which keeps
 * every element's order. A chunk's T depends only on its own A.
 *
 * Layout: A and T [M, C, C] fp32 row-major; T is fully written (zeros above the diagonal).
 */
#include <stdint.h>
#include <string.h>

void isoexec_ut_inverse(const float *restrict A, float *restrict T, int64_t M, int64_t C) {
    for (int64_t c = 0; c < M; ++c) {
        const float *restrict Ac = A + c * C * C;
        float *restrict Tc = T + c * C * C;
        memset(Tc, 0, sizeof(float) * (size_t)(C * C));
        for (int64_t i = 0; i < C; ++i) {
            float *restrict Ti = Tc + i * C;
            for (int64_t m = 0; m < i; ++m) {
                const float a = Ac[i * C + m];
                const float *restrict Tm = Tc + m * C;
                for (int64_t j = 0; j <= m; ++j) Ti[j] = Ti[j] + a * Tm[j];
            }
            for (int64_t j = 0; j < i; ++j) Ti[j] = -Ti[j];
            Ti[i] = 1.0f;
        }
    }
}
