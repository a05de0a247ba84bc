/* Batch-1..16 GEMM for the CPU decode path: y[M, N] = x[M, K] @ W + b, x and y float32,
 * W packed in panels of 16 output columns, stored float32 or bfloat16 (upper 16 bits of a
 * float32; widened exactly to float32 in registers, so all arithmetic is float32).
 *
 *   W packed   [P = ceil(N / 16), K, 16]   element (p, k, j) = W[k, 16 p + j] (zero past N)
 *   x          [M, K] row stride ldx
 *   y          [M, N] row stride ldy        (only columns < N are written)
 *   b          [N] or NULL
 *
 * Why a kernel of our own: at decode the weights are streamed once per step and every weight
 * feeds M <= 16 FMAs. MKL's sgemm on AVX2 parts (no AVX-512, no bf16 instructions) spends
 * 3-5x the M = 1 time at M = 8 (measured on the 2-core AMD EPYC dev box: Qwen2.5-1.5B
 * gate|up 1536 x 17920, M = 1: 5.0 ms, M = 8: 27 ms), and bf16 F.linear is slower still,
 * which made every speculative tree cost several single-token steps. Here each 16-column
 * panel is read once per k-block of KB rows and reused from L1/L2 for every group of 4 rows
 * of x: at M <= 4 the loop is bound by memory bandwidth, above that by the FMA ports
 * (8 FMAs per 16 weights per 4 rows: peak 2 FMA/cycle).
 *
 * Floors (one core, this box): bytes = K N sizeof(W); FLOPs = 2 M K N at 16 FP32 FMA
 * lanes x 2 ports x 2.45 GHz = 78 GFLOP/s.
 *
 * Threads: the P panels are split into contiguous ranges, one per OpenMP thread
 * (n_threads = 1 runs inline, no OpenMP region).
 *
 * Every function is compiled for AVX2 + FMA with a target attribute; call
 * `ssm_cpu_has_avx2()` first and use another path when it returns 0.
 */
#ifndef SWIFTSPEC_GEMM_AVX2_H
#define SWIFTSPEC_GEMM_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SSM_NB 16      /* output columns per panel (two 8-float vectors) */
#define SSM_KB 512     /* k rows per block: a block of one panel is <= 32 KiB (float32) */
#define SSM_TARGET __attribute__((target("avx2,fma")))
#define SSM_INLINE static inline __attribute__((always_inline)) SSM_TARGET

static int ssm_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

SSM_INLINE __m256 ssm_load_f32(const float *p) { return _mm256_loadu_ps(p); }

SSM_INLINE __m256 ssm_load_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One k-block [k0, k1) of one panel for R (1..4) rows; acc == 0 -> y = (bias or 0) + x W,
 * acc == 1 -> y += x W. `full`: all 16 columns are real (else only `ncols` are written). */
#define SSM_DEFINE_BLOCK(NAME, WT, LOADW)                                                      \
SSM_INLINE void NAME(const WT *w, int k0, int k1, const float *x, long ldx, float *y, long ldy, \
                     const float *b, int R, int acc, int ncols) {                              \
    __m256 a0[4], a1[4];                                                                       \
    for (int r = 0; r < 4; r++) { a0[r] = _mm256_setzero_ps(); a1[r] = _mm256_setzero_ps(); } \
    if (R == 1) { /* latency-bound chain: four independent accumulator pairs over k */        \
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();                            \
        __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();                            \
        __m256 e0 = _mm256_setzero_ps(), e1 = _mm256_setzero_ps();                            \
        int k = k0;                                                                            \
        for (; k + 4 <= k1; k += 4) {                                                          \
            const WT *wk = w + (long)k * SSM_NB;                                               \
            a0[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), LOADW(wk), a0[0]);             \
            a1[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), LOADW(wk + 8), a1[0]);         \
            c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 1), LOADW(wk + 16), c0);          \
            c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 1), LOADW(wk + 24), c1);          \
            d0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 2), LOADW(wk + 32), d0);          \
            d1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 2), LOADW(wk + 40), d1);          \
            e0 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 3), LOADW(wk + 48), e0);          \
            e1 = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k + 3), LOADW(wk + 56), e1);          \
        }                                                                                      \
        for (; k < k1; k++) {                                                                  \
            const WT *wk = w + (long)k * SSM_NB;                                               \
            a0[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), LOADW(wk), a0[0]);             \
            a1[0] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + k), LOADW(wk + 8), a1[0]);         \
        }                                                                                      \
        a0[0] = _mm256_add_ps(_mm256_add_ps(a0[0], c0), _mm256_add_ps(d0, e0));                \
        a1[0] = _mm256_add_ps(_mm256_add_ps(a1[0], c1), _mm256_add_ps(d1, e1));                \
    } else { /* named accumulators (an array would be spilled to the stack every k) */     \
        __m256 p0 = _mm256_setzero_ps(), q0 = _mm256_setzero_ps();                            \
        __m256 p1 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();                            \
        __m256 p2 = _mm256_setzero_ps(), q2 = _mm256_setzero_ps();                            \
        __m256 p3 = _mm256_setzero_ps(), q3 = _mm256_setzero_ps();                            \
        const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;            \
        for (int k = k0; k < k1; k++) {                                                        \
            const WT *wk = w + (long)k * SSM_NB;                                               \
            __m256 w0 = LOADW(wk), w1 = LOADW(wk + 8), xb;                                     \
            xb = _mm256_broadcast_ss(x0 + k);                                                  \
            p0 = _mm256_fmadd_ps(xb, w0, p0); q0 = _mm256_fmadd_ps(xb, w1, q0);                \
            xb = _mm256_broadcast_ss(x1 + k);                                                  \
            p1 = _mm256_fmadd_ps(xb, w0, p1); q1 = _mm256_fmadd_ps(xb, w1, q1);                \
            if (R > 2) { xb = _mm256_broadcast_ss(x2 + k);                                     \
                p2 = _mm256_fmadd_ps(xb, w0, p2); q2 = _mm256_fmadd_ps(xb, w1, q2); }          \
            if (R > 3) { xb = _mm256_broadcast_ss(x3 + k);                                     \
                p3 = _mm256_fmadd_ps(xb, w0, p3); q3 = _mm256_fmadd_ps(xb, w1, q3); }          \
        }                                                                                      \
        a0[0] = p0; a1[0] = q0; a0[1] = p1; a1[1] = q1;                                        \
        a0[2] = p2; a1[2] = q2; a0[3] = p3; a1[3] = q3;                                        \
    }                                                                                          \
    for (int r = 0; r < R; r++) {                                                              \
        float *yr = y + r * ldy;                                                               \
        if (ncols == SSM_NB) {                                                                 \
            __m256 base0, base1;                                                               \
            if (acc) { base0 = _mm256_loadu_ps(yr); base1 = _mm256_loadu_ps(yr + 8); }        \
            else if (b) { base0 = _mm256_loadu_ps(b); base1 = _mm256_loadu_ps(b + 8); }        \
            else { base0 = _mm256_setzero_ps(); base1 = _mm256_setzero_ps(); }                 \
            _mm256_storeu_ps(yr, _mm256_add_ps(base0, a0[r]));                                 \
            _mm256_storeu_ps(yr + 8, _mm256_add_ps(base1, a1[r]));                             \
        } else {                                                                               \
            float t[SSM_NB];                                                                   \
            _mm256_storeu_ps(t, a0[r]);                                                        \
            _mm256_storeu_ps(t + 8, a1[r]);                                                    \
            for (int j = 0; j < ncols; j++)                                                    \
                yr[j] = (acc ? yr[j] : (b ? b[j] : 0.0f)) + t[j];                              \
        }                                                                                      \
    }                                                                                          \
}

SSM_DEFINE_BLOCK(ssm_block_f32, float, ssm_load_f32)
SSM_DEFINE_BLOCK(ssm_block_bf16, uint16_t, ssm_load_bf16)

/* M = 1, four panels at once: four concurrent memory streams keep more cache-line fills in
 * flight than one (one stream reached ~70 % of MKL's GEMV bandwidth on float32 weights). */
#define SSM_DEFINE_M1X4(NAME, WT, LOADW)                                                       \
SSM_INLINE void NAME(const WT *w, long pstride, int K, const float *x, float *y,              \
                     const float *b) {                                                         \
    const WT *w0 = w, *w1 = w + pstride, *w2 = w + 2 * pstride, *w3 = w + 3 * pstride;       \
    __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();                                \
    __m256 a1 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();                                \
    __m256 a2 = _mm256_setzero_ps(), b2 = _mm256_setzero_ps();                                \
    __m256 a3 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();                                \
    for (int k = 0; k < K; k++) {                                                              \
        __m256 xb = _mm256_broadcast_ss(x + k);                                                \
        long o = (long)k * SSM_NB;                                                             \
        a0 = _mm256_fmadd_ps(xb, LOADW(w0 + o), a0); b0 = _mm256_fmadd_ps(xb, LOADW(w0 + o + 8), b0); \
        a1 = _mm256_fmadd_ps(xb, LOADW(w1 + o), a1); b1 = _mm256_fmadd_ps(xb, LOADW(w1 + o + 8), b1); \
        a2 = _mm256_fmadd_ps(xb, LOADW(w2 + o), a2); b2 = _mm256_fmadd_ps(xb, LOADW(w2 + o + 8), b2); \
        a3 = _mm256_fmadd_ps(xb, LOADW(w3 + o), a3); b3 = _mm256_fmadd_ps(xb, LOADW(w3 + o + 8), b3); \
    }                                                                                          \
    __m256 acc[8] = {a0, b0, a1, b1, a2, b2, a3, b3};                                          \
    for (int i = 0; i < 8; i++) {                                                              \
        __m256 base = b ? _mm256_loadu_ps(b + 8 * i) : _mm256_setzero_ps();                    \
        _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(base, acc[i]));                              \
    }                                                                                          \
}

SSM_DEFINE_M1X4(ssm_m1x4_f32, float, ssm_load_f32)
SSM_DEFINE_M1X4(ssm_m1x4_bf16, uint16_t, ssm_load_bf16)

/* Rows in groups of 4 (the last group 1..3), each group a constant R after inlining. */
#define SSM_DEFINE_PANELS(NAME, BLOCK, M1X4, WT)                                               \
static SSM_TARGET void NAME(const WT *W, int K, int N, int p0, int p1, const float *x,        \
                            long ldx, int M, float *y, long ldy, const float *b) {             \
    if (M == 1) { /* whole panels four at a time (full 16 columns each), then the rest */     \
        long ps = (long)K * SSM_NB;                                                            \
        int pfull = N / SSM_NB < p1 ? N / SSM_NB : p1;                                         \
        for (; p0 + 4 <= pfull; p0 += 4)                                                       \
            M1X4(W + p0 * ps, ps, K, x, y + p0 * SSM_NB, b ? b + p0 * SSM_NB : 0);             \
    }                                                                                          \
    for (int p = p0; p < p1; p++) {                                                            \
        const WT *wp = W + (long)p * K * SSM_NB;                                               \
        int n0 = p * SSM_NB;                                                                   \
        int ncols = N - n0 < SSM_NB ? N - n0 : SSM_NB;                                         \
        const float *bp = b ? b + n0 : 0;                                                      \
        for (int k0 = 0; k0 < K; k0 += SSM_KB) {                                               \
            int k1 = k0 + SSM_KB < K ? k0 + SSM_KB : K;                                        \
            int acc = k0 > 0;                                                                  \
            int m = 0;                                                                         \
            for (; m + 4 <= M; m += 4)                                                         \
                BLOCK(wp, k0, k1, x + m * ldx, ldx, y + m * ldy + n0, ldy, bp, 4, acc, ncols); \
            switch (M - m) {                                                                   \
            case 3: BLOCK(wp, k0, k1, x + m * ldx, ldx, y + m * ldy + n0, ldy, bp, 3, acc, ncols); break; \
            case 2: BLOCK(wp, k0, k1, x + m * ldx, ldx, y + m * ldy + n0, ldy, bp, 2, acc, ncols); break; \
            case 1: BLOCK(wp, k0, k1, x + m * ldx, ldx, y + m * ldy + n0, ldy, bp, 1, acc, ncols); break; \
            default: break;                                                                    \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}

SSM_DEFINE_PANELS(ssm_panels_f32, ssm_block_f32, ssm_m1x4_f32, float)
SSM_DEFINE_PANELS(ssm_panels_bf16, ssm_block_bf16, ssm_m1x4_bf16, uint16_t)

/* y[M, N] = x[M, K] @ W (+ b); W packed (see top), is_bf16 selects the stored type. */
static void ssm_gemm_packed(const void *W, int is_bf16, int K, int N, const float *x, long ldx,
                            int M, float *y, long ldy, const float *b, int n_threads) {
    int P = (N + SSM_NB - 1) / SSM_NB;
    if (n_threads <= 1 || P < 2 * n_threads) {
        if (is_bf16) ssm_panels_bf16((const uint16_t *)W, K, N, 0, P, x, ldx, M, y, ldy, b);
        else ssm_panels_f32((const float *)W, K, N, 0, P, x, ldx, M, y, ldy, b);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel num_threads(n_threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int p0 = (int)((long)P * t / nt), p1 = (int)((long)P * (t + 1) / nt);
        if (is_bf16) ssm_panels_bf16((const uint16_t *)W, K, N, p0, p1, x, ldx, M, y, ldy, b);
        else ssm_panels_f32((const float *)W, K, N, p0, p1, x, ldx, M, y, ldy, b);
    }
#else
    if (is_bf16) ssm_panels_bf16((const uint16_t *)W, K, N, 0, P, x, ldx, M, y, ldy, b);
    else ssm_panels_f32((const float *)W, K, N, 0, P, x, ldx, M, y, ldy, b);
#endif
}

#endif
