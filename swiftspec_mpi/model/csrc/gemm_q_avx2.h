/* Decode GEMM on packed 4-bit / 8-bit weights for the CPU path: y[M, N] = x[M, K] @ W + b with
 * W = q * scale (+ offset) per group of G inputs, x and y float32, all arithmetic float32
 * (codes widen exactly; no activation quantization, so results track a float64 product of the
 * dequantized weights to float32 rounding).
 *
 *   W blob     uint8 [P = ceil(N / 16), K / G, S]   one record per (panel of 16 outputs, group):
 *              codes  G x CB bytes, k-major:  bits 4: CB = 8,  byte j = q[16p + j] | q[16p + 8 + j] << 4
 *                                                         (codes 0..15)
 *                                             bits 8: CB = 16, int8 q[16p + j]
 *              scale  float32 [16]
 *              offset float32 [16]            (only when has_offset)
 *              S = G CB + 64 (1 + has_offset); outputs past N are zero records
 *   x [M, K] row stride ldx; y [M, N] row stride ldy (only columns < N written); b [N] or NULL
 *
 * Per record: s[r, j] = sum_k x[r, k] q[k, j] (two 8-wide accumulators per row), then
 * acc[r, j] += s[r, j] * scale[j] + xsum[r, group] * offset[j], where xsum is the group's sum of
 * x, computed once per call. Every record is read once per 16 rows of x and reused from L1 for
 * rows in groups of 4; M = 1 runs two chains over even / odd k. The order of every sum is
 * fixed, so a result does not depend on the thread count or on M.
 *
 * Threads: panels split into contiguous ranges, one per OpenMP thread, as in gemm_avx2.h.
 */
#ifndef SWIFTSPEC_GEMM_Q_AVX2_H
#define SWIFTSPEC_GEMM_Q_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SSQ_NB 16      /* outputs per panel */
#define SSQ_MB 16      /* rows of x per pass over a panel */
#define SSQ_TARGET __attribute__((target("avx2,fma")))
#define SSQ_INLINE static inline __attribute__((always_inline)) SSQ_TARGET

/* 16 codes of one k -> two float vectors (columns 0..7, 8..15) */
SSQ_INLINE void ssq_dec4(const uint8_t *c, __m256 *w0, __m256 *w1) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    *w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
    *w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}

SSQ_INLINE void ssq_dec8(const uint8_t *c, __m256 *w0, __m256 *w1) {
    __m128i v = _mm_loadu_si128((const __m128i *)c);
    *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* s[r] (2 vectors per row) = sum over the G codes of one record, for R rows of x at xr. */
#define SSQ_DEFINE_DOT(NAME, DEC, CB)                                                          \
SSQ_INLINE void NAME(const uint8_t *c, int G, const float *x, long ldx, int R,               \
                     __m256 *s0, __m256 *s1) {                                                 \
    __m256 w0, w1, xb;                                                                         \
    if (R == 1) {                                                                              \
        __m256 p0 = _mm256_setzero_ps(), q0 = _mm256_setzero_ps();                            \
        __m256 p1 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();                            \
        for (int k = 0; k < G; k += 2) {                                                       \
            DEC(c + k * CB, &w0, &w1);                                                         \
            xb = _mm256_broadcast_ss(x + k);                                                   \
            p0 = _mm256_fmadd_ps(xb, w0, p0); q0 = _mm256_fmadd_ps(xb, w1, q0);                \
            DEC(c + (k + 1) * CB, &w0, &w1);                                                   \
            xb = _mm256_broadcast_ss(x + k + 1);                                               \
            p1 = _mm256_fmadd_ps(xb, w0, p1); q1 = _mm256_fmadd_ps(xb, w1, q1);                \
        }                                                                                      \
        s0[0] = _mm256_add_ps(p0, p1); s1[0] = _mm256_add_ps(q0, q1);                          \
        return;                                                                                \
    }                                                                                          \
    __m256 p0 = _mm256_setzero_ps(), q0 = _mm256_setzero_ps();                                \
    __m256 p1 = _mm256_setzero_ps(), q1 = _mm256_setzero_ps();                                \
    __m256 p2 = _mm256_setzero_ps(), q2 = _mm256_setzero_ps();                                \
    __m256 p3 = _mm256_setzero_ps(), q3 = _mm256_setzero_ps();                                \
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;                \
    for (int k = 0; k < G; k++) {                                                              \
        DEC(c + k * CB, &w0, &w1);                                                             \
        xb = _mm256_broadcast_ss(x0 + k);                                                      \
        p0 = _mm256_fmadd_ps(xb, w0, p0); q0 = _mm256_fmadd_ps(xb, w1, q0);                    \
        xb = _mm256_broadcast_ss(x1 + k);                                                      \
        p1 = _mm256_fmadd_ps(xb, w0, p1); q1 = _mm256_fmadd_ps(xb, w1, q1);                    \
        if (R > 2) { xb = _mm256_broadcast_ss(x2 + k);                                         \
            p2 = _mm256_fmadd_ps(xb, w0, p2); q2 = _mm256_fmadd_ps(xb, w1, q2); }              \
        if (R > 3) { xb = _mm256_broadcast_ss(x3 + k);                                         \
            p3 = _mm256_fmadd_ps(xb, w0, p3); q3 = _mm256_fmadd_ps(xb, w1, q3); }              \
    }                                                                                          \
    s0[0] = p0; s1[0] = q0; s0[1] = p1; s1[1] = q1;                                            \
    s0[2] = p2; s1[2] = q2; s0[3] = p3; s1[3] = q3;                                            \
}

SSQ_DEFINE_DOT(ssq_dot4, ssq_dec4, 8)
SSQ_DEFINE_DOT(ssq_dot8, ssq_dec8, 16)

/* Panels [p0, p1) for rows [0, M), M any (passes of SSQ_MB rows). */
#define SSQ_DEFINE_PANELS(NAME, DOT, CB)                                                       \
static SSQ_TARGET void NAME(const uint8_t *W, int has_off, int G, int K, int N, int p0,       \
                            int p1, const float *x, long ldx, int M, float *y, long ldy,       \
                            const float *b, const float *xsum) {                               \
    int KG = K / G;                                                                            \
    long S = (long)G * CB + 64 * (1 + has_off);                                                \
    __m256 acc0[SSQ_MB], acc1[SSQ_MB], s0[4], s1[4];                                           \
    for (int p = p0; p < p1; p++) {                                                            \
        int n0 = p * SSQ_NB;                                                                   \
        int ncols = N - n0 < SSQ_NB ? N - n0 : SSQ_NB;                                         \
        for (int m0 = 0; m0 < M; m0 += SSQ_MB) {                                               \
            int mb = M - m0 < SSQ_MB ? M - m0 : SSQ_MB;                                        \
            for (int r = 0; r < mb; r++) { acc0[r] = _mm256_setzero_ps(); acc1[r] = acc0[r]; } \
            const uint8_t *rec = W + (long)p * KG * S;                                         \
            for (int g = 0; g < KG; g++, rec += S) {                                           \
                const float *sc = (const float *)(rec + (long)G * CB);                         \
                __m256 sc0 = _mm256_loadu_ps(sc), sc1 = _mm256_loadu_ps(sc + 8);               \
                __m256 of0 = _mm256_setzero_ps(), of1 = _mm256_setzero_ps();                   \
                if (has_off) { of0 = _mm256_loadu_ps(sc + 16); of1 = _mm256_loadu_ps(sc + 24); } \
                const float *xg = x + (long)m0 * ldx + (long)g * G;                            \
                for (int m = 0; m < mb; m += 4) {                                              \
                    int R = mb - m < 4 ? mb - m : 4;                                           \
                    switch (R) {                                                               \
                    case 4: DOT(rec, G, xg + m * ldx, ldx, 4, s0, s1); break;                  \
                    case 3: DOT(rec, G, xg + m * ldx, ldx, 3, s0, s1); break;                  \
                    case 2: DOT(rec, G, xg + m * ldx, ldx, 2, s0, s1); break;                  \
                    default: DOT(rec, G, xg + m * ldx, ldx, 1, s0, s1); break;                 \
                    }                                                                          \
                    for (int r = 0; r < R; r++) {                                              \
                        int i = m + r;                                                         \
                        acc0[i] = _mm256_fmadd_ps(s0[r], sc0, acc0[i]);                        \
                        acc1[i] = _mm256_fmadd_ps(s1[r], sc1, acc1[i]);                        \
                        if (has_off) {                                                         \
                            __m256 xs = _mm256_broadcast_ss(xsum + (long)(m0 + i) * KG + g);   \
                            acc0[i] = _mm256_fmadd_ps(xs, of0, acc0[i]);                       \
                            acc1[i] = _mm256_fmadd_ps(xs, of1, acc1[i]);                       \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            for (int r = 0; r < mb; r++) {                                                     \
                float *yr = y + (long)(m0 + r) * ldy + n0;                                     \
                float t[SSQ_NB];                                                               \
                _mm256_storeu_ps(t, acc0[r]);                                                  \
                _mm256_storeu_ps(t + 8, acc1[r]);                                              \
                for (int j = 0; j < ncols; j++) yr[j] = (b ? b[n0 + j] : 0.0f) + t[j];         \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}

SSQ_DEFINE_PANELS(ssq_panels4, ssq_dot4, 8)
SSQ_DEFINE_PANELS(ssq_panels8, ssq_dot8, 16)

static void ssq_run(const uint8_t *W, int bits, int has_off, int G, int K, int N, int p0, int p1,
                    const float *x, long ldx, int M, float *y, long ldy, const float *b,
                    const float *xsum) {
    if (bits == 4) ssq_panels4(W, has_off, G, K, N, p0, p1, x, ldx, M, y, ldy, b, xsum);
    else ssq_panels8(W, has_off, G, K, N, p0, p1, x, ldx, M, y, ldy, b, xsum);
}

/* y[M, N] = x[M, K] @ W (+ b); W a blob as above (bits 4 or 8, G | K, G even).
 * Returns 0, or -1 when the group sums cannot be allocated. */
static int ssq_gemm(const uint8_t *W, int bits, int has_off, int G, int K, int N, const float *x,
                    long ldx, int M, float *y, long ldy, const float *b, int n_threads) {
    int P = (N + SSQ_NB - 1) / SSQ_NB, KG = K / G;
    float *xsum = NULL;
    if (has_off) {           /* per row, per group: sum of x in k order */
        xsum = (float *)malloc(sizeof(float) * (size_t)M * (size_t)KG + 1);
        if (!xsum) return -1;
        for (int m = 0; m < M; m++)
            for (int g = 0; g < KG; g++) {
                const float *xg = x + (long)m * ldx + (long)g * G;
                float s = 0.0f;
                for (int k = 0; k < G; k++) s += xg[k];
                xsum[(long)m * KG + g] = s;
            }
    }
    if (n_threads <= 1 || P < 2 * n_threads) {
        ssq_run(W, bits, has_off, G, K, N, 0, P, x, ldx, M, y, ldy, b, xsum);
    } else {
#ifdef _OPENMP
        #pragma omp parallel num_threads(n_threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int q0 = (int)((long)P * t / nt), q1 = (int)((long)P * (t + 1) / nt);
            ssq_run(W, bits, has_off, G, K, N, q0, q1, x, ldx, M, y, ldy, b, xsum);
        }
#else
        ssq_run(W, bits, has_off, G, K, N, 0, P, x, ldx, M, y, ldy, b, xsum);
#endif
    }
    free(xsum);
    return 0;
}

#endif
