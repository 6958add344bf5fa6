/* Batch-, column- and TP-invariant GEMM of bf16 operands on CPU with fp32 accumulation: y = x @ w.
 *
 * Bits: every output element is one chain over the pairs of k in ascending pair order; pair p holds
 * k = 2p and 2p+1 and takes two fused multiply-adds, the odd element first,
 *     acc = ftz(fmaf(daz(x[i, 2p+1]), daz(w[2p+1, j]), daz(acc)))
 *     acc = ftz(fmaf(daz(x[i, 2p]),   daz(w[2p, j]),   acc))
 * (daz: a subnormal input read as zero of its sign; ftz: a result that is tiny after rounding, i.e. whose
 * rounding to 24 bits with an unbounded exponent is below FLT_MIN in magnitude, flushed to zero of its
 * sign; round to nearest even). That is the definition of the AVX512-BF16 instruction VDPBF16PS (Intel
 * SDM, "FP32 FMA with DAZ in, FTZ out and RNE rounding", element 2i+1 before 2i), which runs it for 16
 * columns at once where the CPU has AVX512_BF16; elsewhere the same chain runs as scalar code below
 * (step()). A NaN output is stored as the canonical quiet NaN 0x7fc00000 on both paths (the instruction
 * and fmaf pick different operands' payloads). Checked equal on an AMD Zen 4 (tests/test_kernels_primitives.py
 * compares the two paths on random, subnormal-heavy, just-below-FLT_MIN and NaN operands). As in fma_gemm.c nothing else enters an element: not the number of
 * rows, the element's position, its neighbours, the blocking or the SIMD path. A bf16 product is
 * exact in fp32, so each step is one rounding of (exact product + accumulator).
 *
 * K odd: the caller pads x and w with one zero feature (a pair whose even element is 0 * 0).
 * Leaves (the pik leaf GEMM): with L > 1, K splits into L contiguous leaves of K/L features (K/L even,
 * checked by the caller), each leaf's chain starts from 0, and the L partials are added by the
 * adjacent-pairs tree ((p0 + p1) + (p2 + p3)) + ..., one IEEE fp32 addition per node.
 *
 * Speed: as fma_gemm.c (row blocks outermost, register micro-tiles of MR rows x NR columns, w packed in
 * column panels); a k pair of NR columns is one 64-byte load per 16 columns, so a micro-tile does 32
 * multiply-adds per vector instruction where fma_gemm.c does 16. Edge tiles run the full micro-tile
 * on zero-padded copies, so every element goes through the same instruction sequence.
 *
 * Layout: x [N, K] bf16 (raw uint16) with row stride ldx, K even; w as P = ceil(M / NR) panels
 * [P][K/2][NR][2] (panel p: columns p*NR .. p*NR+NR-1, zero past M; element [k/2][c][k%2]);
 * y [N, M] fp32 with row stride ldy.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define MR 4
#define NR 64

int64_t isoexec_bf16_panel_width(void) { return NR; }

int isoexec_bf16_has_simd(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

static float bf(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float daz(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f; }

/* One multiply-add of VDPBF16PS: daz(acc) + daz(a) daz(b), rounded once, flushed when tiny after rounding.
   fmaf rounds on the subnormal grid, which differs from the unbounded-exponent rounding only when fmaf
   returns +-FLT_MIN: then the same step scaled by 2^24 (the smaller factor and acc; exact, and far from
   overflow, since a result near FLT_MIN needs |acc| and |a b| far below 1) gives that rounding, scaled. */
static float step(float a, float b, float acc) {
    a = daz(a);
    b = daz(b);
    acc = daz(acc);
    const float r = fmaf(a, b, acc);
    if (fabsf(r) == FLT_MIN) {
        const int a_small = fabsf(a) <= fabsf(b);
        const float r24 = fmaf((a_small ? a : b) * 0x1p24f, a_small ? b : a, acc * 0x1p24f);
        if (fabsf(r24) < FLT_MIN * 0x1p24f) return copysignf(0.0f, r24);
    }
    return daz(r);
}

static float canonical(float f) { return isnan(f) ? NAN : f; }

/* One micro-tile: MR rows x NR columns over pairs [0, npairs) of x (row stride ldx, pair-aligned) and
   one panel (pair rows of NR x 2), written to t (row stride ldt). simd selects the path (same bits). */
static void micro(const uint16_t *restrict x, int64_t ldx, const uint16_t *restrict w, float *restrict t, int64_t ldt,
                  int64_t npairs, int simd) {
#ifdef __AVX512BF16__
    if (simd) {
        __m512 acc[MR][NR / 16];
        for (int r = 0; r < MR; ++r)
            for (int c = 0; c < NR / 16; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int64_t p = 0; p < npairs; ++p) {
            const uint16_t *wp = w + p * NR * 2;
            __m512bh wv[NR / 16];
            for (int c = 0; c < NR / 16; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wp + c * 32);
            for (int r = 0; r < MR; ++r) {
                uint32_t pair;
                memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int c = 0; c < NR / 16; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, wv[c]);
            }
        }
        const __m512 qnan = _mm512_set1_ps(NAN);
        for (int r = 0; r < MR; ++r)
            for (int c = 0; c < NR / 16; ++c) {
                const __mmask16 nan = _mm512_cmp_ps_mask(acc[r][c], acc[r][c], _CMP_UNORD_Q);
                _mm512_storeu_ps(t + r * ldt + c * 16, _mm512_mask_mov_ps(acc[r][c], nan, qnan));
            }
        return;
    }
#endif
    (void)simd;
    for (int r = 0; r < MR; ++r) {
        float acc[NR];
        for (int c = 0; c < NR; ++c) acc[c] = 0.0f;
        for (int64_t p = 0; p < npairs; ++p) {
            const float x1 = bf(x[r * ldx + 2 * p + 1]), x0 = bf(x[r * ldx + 2 * p]);
            const uint16_t *wp = w + p * NR * 2;
            for (int c = 0; c < NR; ++c) acc[c] = step(x0, bf(wp[2 * c]), step(x1, bf(wp[2 * c + 1]), acc[c]));
        }
        for (int c = 0; c < NR; ++c) t[r * ldt + c] = canonical(acc[c]);
    }
}

static void tree_sum(float *restrict t, int64_t L) {
    for (int64_t s = 1; s < L; s *= 2)
        for (int64_t i = 0; i + s < L; i += 2 * s) {
            float *restrict a = t + i * MR * NR;
            const float *restrict b = t + (i + s) * MR * NR;
            for (int64_t e = 0; e < MR * NR; ++e) a[e] = a[e] + b[e];
        }
}

/* Returns 0, or 1 when the scratch (L + 1 tiles, MR padded rows of x) cannot be allocated. simd: use
   VDPBF16PS where compiled in (0 forces the scalar chain; the tests compare both). */
int isoexec_bf16_gemm(const uint16_t *restrict x, const uint16_t *restrict wp, float *restrict y, int64_t N,
                      int64_t K, int64_t M, int64_t ldx, int64_t ldy, int64_t row_tile, int64_t col_tile, int64_t L,
                      int simd) {
    const int64_t half = K / 2, leaf_pairs = half / L;
    const int64_t ct = (col_tile + NR - 1) / NR * NR, rt = (row_tile + MR - 1) / MR * MR;
    float *tiles = malloc((size_t)((L + 1) * MR * NR) * sizeof(float));
    uint16_t *xpad = calloc((size_t)(MR * K), sizeof(uint16_t));
    if (!tiles || !xpad) {
        free(tiles);
        free(xpad);
        return 1;
    }
    for (int64_t i0 = 0; i0 < N; i0 += rt) {
        const int64_t i1 = i0 + rt < N ? i0 + rt : N;
        for (int64_t j0 = 0; j0 < M; j0 += ct) {
            const int64_t j1 = j0 + ct < M ? j0 + ct : M;
            for (int64_t j = j0; j < j1; j += NR) {
                const int64_t cols = j1 - j < NR ? j1 - j : NR;
                const uint16_t *w = wp + (j / NR) * half * NR * 2;
                for (int64_t i = i0; i < i1; i += MR) {
                    const int64_t rows = i1 - i < MR ? i1 - i : MR;
                    const uint16_t *xs = x + i * ldx;
                    int64_t lds = ldx;
                    if (rows < MR) { /* the edge rows on a zero-padded copy: the same instructions */
                        memset(xpad, 0, (size_t)(MR * K) * sizeof(uint16_t));
                        for (int64_t r = 0; r < rows; ++r) memcpy(xpad + r * K, xs + r * ldx, (size_t)K * sizeof(uint16_t));
                        xs = xpad;
                        lds = K;
                    }
                    float *out = tiles + L * MR * NR; /* the finished tile */
                    if (L == 1) {
                        micro(xs, lds, w, out, NR, half, simd);
                    } else {
                        for (int64_t l = 0; l < L; ++l)
                            micro(xs + 2 * l * leaf_pairs, lds, w + l * leaf_pairs * NR * 2, tiles + l * MR * NR, NR,
                                  leaf_pairs, simd);
                        tree_sum(tiles, L);
                        out = tiles;
                    }
                    for (int64_t r = 0; r < rows; ++r)
                        memcpy(y + (i + r) * ldy + j, out + r * NR, (size_t)cols * sizeof(float));
                }
            }
        }
    }
    free(tiles);
    free(xpad);
    return 0;
}
