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
 * that only reads the start state for the first token's kv; the first update pass recomputes the
 * decayed start state (the same product) as it reads it, so the decayed state is never stored on its
 * own (a decode step reads the state twice and writes it once). Every element sees the same
 * operations in the same order as in two passes per token; only the memory traffic changes.
 *
 * Registers: the columns are processed in blocks of JB (64) columns, each block's kv, u and o
 * accumulators held in vector registers over the DK rows (GCC vector extensions; the compiler lowers
 * them to the widest vectors the CPU has, or to scalar code); a tail of fewer columns runs the same
 * loop one column at a time. Blocking moves no bit: every element of a block sees exactly the
 * operations, in the same order, that the column-at-a-time loop gives it.
 *
 * Layout: tokens [N, H, D] (row-major, fp32); segment s covers token rows row0[s] .. row0[s]+len[s]-1,
 * starts from the H states at src[s] ([H, DK, DV] contiguous) and leaves its final states at dst[s]
 * (the same layout); dst[s] == src[s] updates the states in place (a decode step advancing a sequence's
 * running state: no copy), with the same operations on every element. Several
 * segments may share one dst whose states nobody reads (segments are processed in order).
 * o [N, H, DV] receives the outputs of those rows.
 */
#include <stdint.h>
#include <string.h>

#define VW 16               /* floats per vector */
#define NV 4                /* vectors per column block */
#define JB (VW * NV)        /* columns per block */
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef float vfu __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));
static inline vf ld(const float *p) { return *(const vfu *)p; }
static inline void st(float *p, vf x) { *(vfu *)p = x; }

/* kv = k^T (A d) of the first token, from its start state A, columns j0..j0+JB; A is only read (the
 * update pass recomputes A d, the same product, so the decayed state is never stored on its own). */
static inline void kv_block(const float *restrict A, const float *restrict kt, float d, float *restrict kv,
                            int64_t DK, int64_t DV, int64_t j0) {
    vf a[NV] = {0};
    for (int64_t i = 0; i < DK; ++i) {
        const float ki = kt[i];
        for (int v = 0; v < NV; ++v) a[v] = a[v] + ki * (ld(A + i * DV + j0 + v * VW) * d);
    }
    for (int v = 0; v < NV; ++v) st(kv + j0 + v * VW, a[v]);
}

/* The same for one column j (the tail). */
static inline void kv_col(const float *restrict A, const float *restrict kt, float d, float *restrict kv,
                          int64_t DK, int64_t DV, int64_t j) {
    float a = 0.0f;
    for (int64_t i = 0; i < DK; ++i) a = a + kt[i] * (A[i * DV + j] * d);
    kv[j] = a;
}

/* Update of token t (S + k u^T, o_t = q^T S) and, when has_next, decay of token t+1 (S * dn, kv = kn^T S),
 * in one pass over columns j0..j0+JB, reading the state from In and writing it to Out (the same buffer
 * or not). first: In is the segment's start state and token t's decay d0 is applied as it is read
 * (In * d0, the product kv_block used). kv holds token t's kv on entry and token t+1's on return.
 * Always inlined with constant first / has_next, so each combination compiles to its own loop. */
static inline __attribute__((always_inline)) void update_block(
        float *Out, const float *In, int first, float d0, const float *restrict kt, const float *restrict qt,
        const float *restrict vt, float b, int has_next, const float *restrict kn, float dn, float *restrict kv,
        float *restrict ot, int64_t DK, int64_t DV, int64_t j0) {
    vf u[NV], acc[NV] = {0}, a[NV] = {0};
    for (int v = 0; v < NV; ++v) u[v] = (ld(vt + j0 + v * VW) - ld(kv + j0 + v * VW)) * b;
    for (int64_t i = 0; i < DK; ++i) {
        const float ki = kt[i], qi = qt[i], kni = has_next ? kn[i] : 0.0f;
        const float *Ii = In + i * DV + j0;
        float *Oi = Out + i * DV + j0;
        for (int v = 0; v < NV; ++v) {
            const vf x = first ? ld(Ii + v * VW) * d0 : ld(Ii + v * VW);
            const vf s = x + ki * u[v];
            acc[v] = acc[v] + qi * s;
            if (has_next) {
                const vf sn = s * dn;
                st(Oi + v * VW, sn);
                a[v] = a[v] + kni * sn;
            } else {
                st(Oi + v * VW, s);
            }
        }
    }
    if (has_next)
        for (int v = 0; v < NV; ++v) st(kv + j0 + v * VW, a[v]);
    for (int v = 0; v < NV; ++v) st(ot + j0 + v * VW, acc[v]);
}

/* The same for one column j (the tail). */
static inline void update_col(float *Out, const float *In, int first, float d0, const float *restrict kt,
                              const float *restrict qt, const float *restrict vt, float b, int has_next,
                              const float *restrict kn, float dn, float *restrict kv, float *restrict ot,
                              int64_t DK, int64_t DV, int64_t j) {
    const float u = (vt[j] - kv[j]) * b;
    float acc = 0.0f, a = 0.0f;
    for (int64_t i = 0; i < DK; ++i) {
        const float x = first ? In[i * DV + j] * d0 : In[i * DV + j];
        const float s = x + kt[i] * u;
        acc = acc + qt[i] * s;
        if (has_next) {
            const float sn = s * dn;
            Out[i * DV + j] = sn;
            a = a + kn[i] * sn;
        } else {
            Out[i * DV + j] = s;
        }
    }
    if (has_next) kv[j] = a;
    ot[j] = acc;
}

/* One token's update over all columns (the blocks, then the tail). */
static inline __attribute__((always_inline)) void update_all(
        float *Out, const float *In, int first, float d0, const float *kt, const float *qt, const float *vt, float b,
        int has_next, const float *kn, float dn, float *kv, float *ot, int64_t DK, int64_t DV, int64_t jb_end) {
    for (int64_t j = 0; j < jb_end; j += JB)
        update_block(Out, In, first, d0, kt, qt, vt, b, has_next, kn, dn, kv, ot, DK, DV, j);
    for (int64_t j = jb_end; j < DV; ++j) update_col(Out, In, first, d0, kt, qt, vt, b, has_next, kn, dn, kv, ot, DK, DV, j);
}

void isoexec_cpr_scan(float *const *dst, const float *const *src, const float *restrict q, const float *restrict k,
                      const float *restrict v, const float *restrict decay, const float *restrict beta,
                      float *restrict o, const int64_t *row0, const int64_t *len, int64_t nseg, int64_t H,
                      int64_t DK, int64_t DV, float *restrict work) {
    float *restrict kv = work;
    const int64_t jb_end = DV - DV % JB;
    for (int64_t s = 0; s < nseg; ++s) {
        for (int64_t h = 0; h < H; ++h) {
            float *St = dst[s] + h * DK * DV;
            const float *S0 = src[s] + h * DK * DV;  /* may be St itself (in place) */
            const int64_t t0 = row0[s], t1 = row0[s] + len[s];
            if (t1 <= t0) {
                if (St != S0) memcpy(St, S0, (size_t)(DK * DV) * sizeof(float));
                continue;
            }
            {   /* kv of the first token, from the start state (read only) */
                const int64_t r = t0 * H + h;
                for (int64_t j = 0; j < jb_end; j += JB) kv_block(S0, k + r * DK, decay[r], kv, DK, DV, j);
                for (int64_t j = jb_end; j < DV; ++j) kv_col(S0, k + r * DK, decay[r], kv, DK, DV, j);
            }
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t r = t * H + h;
                const float *kt = k + r * DK, *qt = q + r * DK, *vt = v + r * DV;
                float *ot = o + r * DV;
                const int first = t == t0, has_next = t + 1 < t1;
                const float *kn = has_next ? k + (r + H) * DK : NULL;
                const float dn = has_next ? decay[r + H] : 0.0f;
                const float *In = first ? S0 : St;
                /* the four (first, has_next) combinations, each with its own compiled loop */
                if (first && has_next) update_all(St, In, 1, decay[r], kt, qt, vt, beta[r], 1, kn, dn, kv, ot, DK, DV, jb_end);
                else if (first) update_all(St, In, 1, decay[r], kt, qt, vt, beta[r], 0, kn, dn, kv, ot, DK, DV, jb_end);
                else if (has_next) update_all(St, In, 0, 0.0f, kt, qt, vt, beta[r], 1, kn, dn, kv, ot, DK, DV, jb_end);
                else update_all(St, In, 0, 0.0f, kt, qt, vt, beta[r], 0, kn, dn, kv, ot, DK, DV, jb_end);
            }
        }
    }
}
