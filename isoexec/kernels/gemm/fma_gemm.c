/* Batch-, column- and TP-invariant fp32 GEMM on CPU: y = x @ w (every isoexec CPU GEMM region).
 *
 * Bits: every output element is one chain of fused multiply-adds over k in ascending order,
 *     acc = 0;  for k = 0 .. K-1:  acc = fmaf(x[i, k], w[k, j], acc);  y[i, j] = acc
 * (fmaf is one correctly rounded IEEE operation, so the chain has one result on every machine,
 * whether the compiler maps it to a vector FMA of any width or to scalar code; it is explicit, so
 * -ffp-contract=off does not touch it). Nothing else enters an element: the number of rows, the
 * element's position, the other columns computed with it, the blocking below and the SIMD width
 * cannot change it. A row's bits therefore do not depend on its batch, and a TP rank's slice of
 * output columns has the bits of the same columns of the whole product.
 *
 * Leaves (the pik leaf GEMM, isoexec.kernels.collectives.pik): with L > 1 leaves, K splits into L
 * contiguous leaves of K/L features; each leaf's partial is the chain above over its own k range
 * (starting from 0), and the L partials are added by the fixed tree of adjacent pairs,
 * ((p0 + p1) + (p2 + p3)) + ..., one IEEE fp32 addition per node (exactly pik_tree_combine).
 *
 * Speed: a cache block of row_tile rows x col_tile columns (runtime launch constants, the contract's
 * row_tile and col_tile, rounded up to whole micro-tiles; they move no bit) is computed by register
 * micro-tiles of MR rows x NR columns (MR * NR fp32 accumulators live across the k loop, NR
 * consecutive columns of w loaded once per k and shared by MR rows); edge tiles run the same chain
 * one row at a time. w comes packed in column panels of NR (fma.py: _panels), so that a
 * micro-tile reads its K x NR weights as one contiguous stream: read in place from a [K, M] matrix
 * whose row stride is a multiple of 4 KB (M = 1024, the embedded model's gdn.in_proj), the k rows of
 * a panel fall into a few L1 sets and evict each other. Row blocks are the outer loop, so that a block
 * of x stays in cache while every column panel passes it. Measured on Zen 4 at 2816 x 128 rows, one
 * thread: 47 GFLOP/s at M = 1024 vs 69 at M = 1088 before; 61 and 71 packed with rows outermost.
 * Neither packing nor the block order moves a bit.
 *
 * Layout (K divisible by L, checked by the caller): x [N, K] with row stride ldx; w as P = ceil(M / NR)
 * panels [P][K][NR] (panel p holds columns p*NR .. p*NR+NR-1, zero past M); y [N, M] with row stride
 * ldy; all fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MR 4
#define NR 64

/* the adjacent-pairs tree over L partial tiles (rows x cols of each, row stride NR, tiles MR * NR
   apart); the sum lands in tile 0 */
static void tree_sum(float *restrict t, int64_t L, int64_t rows, int64_t cols) {
    for (int64_t s = 1; s < L; s *= 2)
        for (int64_t i = 0; i + s < L; i += 2 * s) {
            float *restrict a = t + i * MR * NR;
            const float *restrict b = t + (i + s) * MR * NR;
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t c = 0; c < cols; ++c) a[r * NR + c] = a[r * NR + c] + b[r * NR + c];
        }
}

static void micro_full(const float *restrict x, int64_t ldx, const float *restrict w,
                       float *restrict y, int64_t ldy, int64_t K) {
    float acc[MR][NR];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) acc[r][c] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
        const float *restrict wk = w + k * NR; /* a panel row */
        for (int r = 0; r < MR; ++r) {
            const float a = x[r * ldx + k];
            for (int c = 0; c < NR; ++c) acc[r][c] = fmaf(a, wk[c], acc[r][c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) y[r * ldy + c] = acc[r][c];
}

static void micro_edge(const float *restrict x, int64_t ldx, const float *restrict w,
                       float *restrict y, int64_t ldy, int64_t K, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
        float acc[NR];
        for (int64_t c = 0; c < cols; ++c) acc[c] = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
            const float a = x[r * ldx + k];
            const float *restrict wk = w + k * NR; /* a panel row */
            for (int64_t c = 0; c < cols; ++c) acc[c] = fmaf(a, wk[c], acc[c]);
        }
        for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = acc[c];
    }
}

/* NR, the panel width of the packed w (fma.py packs the panels). */
int64_t isoexec_fma_panel_width(void) { return NR; }

/* Returns 0, or 1 when the leaves' scratch (L * MR * NR floats) cannot be allocated. */
int isoexec_fma_gemm(const float *restrict x, const float *restrict wp, float *restrict y, int64_t N, int64_t K,
                     int64_t M, int64_t ldx, int64_t ldy, int64_t row_tile, int64_t col_tile, int64_t L) {
    /* L == 1: chains straight into y. L > 1: leaf l's micro-tile goes to scratch tile l (MR x NR
       floats), then the tree over the L scratch tiles writes y. Cache tiles are rounded up to whole
       micro-tiles, so that a small row_tile / col_tile never forces the one-row edge path. */
    const int64_t W = K / L;
    const int64_t ct = (col_tile + NR - 1) / NR * NR, rt = (row_tile + MR - 1) / MR * MR;
    float *scratch = NULL;
    if (L > 1 && !(scratch = malloc((size_t)(L * MR * NR) * sizeof(float)))) return 1;
    for (int64_t i0 = 0; i0 < N; i0 += rt) {
        const int64_t i1 = i0 + rt < N ? i0 + rt : N;
        for (int64_t j0 = 0; j0 < M; j0 += ct) {
            const int64_t j1 = j0 + ct < M ? j0 + ct : M;
            for (int64_t j = j0; j < j1; j += NR) {
                const int64_t cols = j1 - j < NR ? j1 - j : NR;
                const float *w = wp + (j / NR) * K * NR; /* j is a multiple of NR: its panel */
                for (int64_t i = i0; i < i1; i += MR) {
                    const int64_t rows = i1 - i < MR ? i1 - i : MR;
                    if (L == 1) {
                        if (rows == MR && cols == NR) micro_full(x + i * ldx, ldx, w, y + i * ldy + j, ldy, K);
                        else micro_edge(x + i * ldx, ldx, w, y + i * ldy + j, ldy, K, rows, cols);
                        continue;
                    }
                    for (int64_t l = 0; l < L; ++l) {
                        const float *xl = x + i * ldx + l * W, *wl = w + l * W * NR;
                        float *tl = scratch + l * MR * NR;
                        if (rows == MR && cols == NR) micro_full(xl, ldx, wl, tl, NR, W);
                        else micro_edge(xl, ldx, wl, tl, NR, W, rows, cols);
                    }
                    tree_sum(scratch, L, rows, cols);
                    for (int64_t r = 0; r < rows; ++r)
                        for (int64_t c = 0; c < cols; ++c) y[(i + r) * ldy + j + c] = scratch[r * NR + c];
                }
            }
        }
    }
    free(scratch);
    return 0;
}
