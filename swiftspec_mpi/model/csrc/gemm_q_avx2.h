/* Decode GEMM on packed 4-bit / 8-bit weights for the CPU path: y[M, N] = x[M, K] @ W + b with
 * W = q * scale (+ offset) per group of G inputs; x, y, b float32.
 *
 *   W blob   uint8 [P = ceil(N / 16), K / G, S]  one record per (panel of 16 outputs, group):
 *            codes   G * 8 bytes (4-bit) or G * 16 bytes (8-bit), 32 bytes = 16 int16 lanes
 *                    per step; lane L (c = L / 2 output of the panel's first half, t = L % 2):
 *                      4-bit, step of 4 k:  q[c][k+t] | q[8+c][k+t] << 4 | q[c][k+2+t] << 8
 *                                           | q[8+c][k+2+t] << 12            (codes 0..15)
 *                      8-bit, step of 2 k:  int8 q[c][k+t] low byte, q[8+c][k+t] high byte
 *            scale   float32 [16]
 *            offset  float32 [16]   (only when has_offset)
 *            S = codes + 64 (1 + has_offset); outputs past N are zero records
 *   x [M, K] row stride ldx; y [M, N] row stride ldy (columns < N written); b [N] or NULL
 *
 * Activations: each row's group of G inputs is split into two int16 parts, x ~ xs1 xq1 + xs2 xq2
 * (xq1 = round(x / xs1), xs1 = max|x| / 32767; xq2 the same of the remainder), so one
 * _mm256_madd_epi16 multiplies 16 codes by a pair of inputs exactly in int32 (a group's sum
 * stays below 2^31: G <= 128 4-bit or G <= 32 8-bit codes). The split leaves at most
 * max|x| / 2^31 per input (float32 rounding level; one int16 part alone left max|x| / 65534,
 * which outlier channels of real models turned into 1e-3 logit errors). Per record and row:
 *     acc[j] += float(sum_k xq1 q) * (xs1 scale[j]) + float(sum_k xq2 q) * (xs2 scale[j])
 *               + xsum * offset[j]
 * with xsum the group's float32 sum of x (the offset term). Codes are split out of their lanes
 * with shifts and masks only (no shuffles). Every record is read once per 16 rows of x and
 * reused from L1 for rows in pairs. The order of every sum is fixed: a result does not depend
 * on the thread count, on M, or on the other rows.
 *
 * Threads: panels split into contiguous ranges, one per OpenMP thread, as in gemm_avx2.h.
 */
#ifndef SWIFTSPEC_GEMM_Q_AVX2_H
#define SWIFTSPEC_GEMM_Q_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SSQ_NB 16      /* outputs per panel */
#define SSQ_MB 16      /* rows of x per pass over a panel */
#define SSQ_TARGET __attribute__((target("avx2,fma")))
#define SSQ_INLINE static inline __attribute__((always_inline)) SSQ_TARGET
/* xq holds row m's part 1 at m * 2K and its part 2 at m * 2K + K: row stride ldq = 2K */
#define SSQ_PART(ldq) ((ldq) >> 1)

SSQ_INLINE __m256i ssq_pair(const int16_t *xq) {        /* broadcast (xq[0], xq[1]) */
    int32_t v;
    memcpy(&v, xq, 4);
    return _mm256_set1_epi32(v);
}

/* Integer sums over one record's codes for R (1..2) rows and both int16 parts (xq: part 1 at
 * xq, part 2 at xq + ldq / 2 ... see ssq_gemm): lo[2r + e] = outputs 0..7 of part e, hi = 8..15. */
SSQ_INLINE void ssq_dot4(const uint8_t *c, int G, const int16_t *xq, long ldq, int R,
                         __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi16(0x0F);
    for (int r = 0; r < 2 * R; r++) { lo[r] = _mm256_setzero_si256(); hi[r] = lo[r]; }
    for (int k = 0; k < G; k += 4, c += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)c);
        __m256i a = _mm256_and_si256(v, m4);
        __m256i bb = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        __m256i cc = _mm256_and_si256(_mm256_srli_epi16(v, 8), m4);
        __m256i d = _mm256_srli_epi16(v, 12);
        for (int r = 0; r < 2 * R; r++) {    /* r = 2 row + part; parts interleaved by row */
            const int16_t *xr = xq + (r >> 1) * ldq + (r & 1) * SSQ_PART(ldq);
            __m256i x01 = ssq_pair(xr + k), x23 = ssq_pair(xr + k + 2);
            lo[r] = _mm256_add_epi32(lo[r], _mm256_add_epi32(_mm256_madd_epi16(a, x01),
                                                             _mm256_madd_epi16(cc, x23)));
            hi[r] = _mm256_add_epi32(hi[r], _mm256_add_epi32(_mm256_madd_epi16(bb, x01),
                                                             _mm256_madd_epi16(d, x23)));
        }
    }
}

SSQ_INLINE void ssq_dot8(const uint8_t *c, int G, const int16_t *xq, long ldq, int R,
                         __m256i *lo, __m256i *hi) {
    for (int r = 0; r < 2 * R; r++) { lo[r] = _mm256_setzero_si256(); hi[r] = lo[r]; }
    for (int k = 0; k < G; k += 2, c += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)c);
        __m256i a = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
        __m256i bb = _mm256_srai_epi16(v, 8);
        for (int r = 0; r < 2 * R; r++) {
            __m256i x01 = ssq_pair(xq + (r >> 1) * ldq + (r & 1) * SSQ_PART(ldq) + k);
            lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(a, x01));
            hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(bb, x01));
        }
    }
}

/* Panels [p0, p1) for rows [0, M) (passes of SSQ_MB rows). xq int16 [M, 2, K] (the two parts);
 * xs float [M, K/G, 2] (their scales); xsum [M, K/G]. */
#define SSQ_DEFINE_PANELS(NAME, DOT, CB)                                                       \
static SSQ_TARGET void NAME(const uint8_t *W, int has_off, int G, int K, int N, int p0,       \
                            int p1, const int16_t *xq, const float *xs, const float *xsum,     \
                            int M, float *y, long ldy, const float *b) {                       \
    int KG = K / G;                                                                            \
    long S = (long)G * CB + 64 * (1 + has_off);                                                \
    __m256 acc0[SSQ_MB], acc1[SSQ_MB];                                                         \
    __m256i lo[4], hi[4];      /* [2 row + part] */                                                                      \
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
                for (int m = 0; m < mb; m += 2) {                                              \
                    int R = mb - m < 2 ? mb - m : 2;                                           \
                    const int16_t *xg = xq + (long)(m0 + m) * 2 * K + (long)g * G;             \
                    if (R == 2) DOT(rec, G, xg, 2L * K, 2, lo, hi);                            \
                    else DOT(rec, G, xg, 2L * K, 1, lo, hi);                                   \
                    for (int r = 0; r < R; r++) {                                              \
                        int i = m + r;                                                         \
                        long gi = (long)(m0 + i) * KG + g;                                     \
                        __m256 s1 = _mm256_broadcast_ss(xs + 2 * gi);                          \
                        __m256 s2 = _mm256_broadcast_ss(xs + 2 * gi + 1);                      \
                        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[2 * r]),               \
                                                  _mm256_mul_ps(s1, sc0), acc0[i]);            \
                        acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[2 * r]),               \
                                                  _mm256_mul_ps(s1, sc1), acc1[i]);            \
                        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[2 * r + 1]),           \
                                                  _mm256_mul_ps(s2, sc0), acc0[i]);            \
                        acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[2 * r + 1]),           \
                                                  _mm256_mul_ps(s2, sc1), acc1[i]);            \
                        if (has_off) {                                                         \
                            __m256 xt = _mm256_broadcast_ss(xsum + gi);                        \
                            acc0[i] = _mm256_fmadd_ps(xt, _mm256_loadu_ps(sc + 16), acc0[i]);  \
                            acc1[i] = _mm256_fmadd_ps(xt, _mm256_loadu_ps(sc + 24), acc1[i]);  \
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

/* v[0..G) -> int16 codes q = round(v / d), d = max|v| / 32767 (0 for an all-zero v); -> d */
static float ssq_int16(const float *v, int G, int16_t *q) {
    float amax = 0.0f;
    for (int k = 0; k < G; k++) {
        float a = fabsf(v[k]);
        amax = a > amax ? a : amax;
    }
    float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int k = 0; k < G; k++) {
        long c = lrintf(v[k] * inv);
        q[k] = (int16_t)(c > 32767 ? 32767 : c < -32767 ? -32767 : c);
    }
    return amax / 32767.0f;
}

/* Row m's group g of x -> two int16 parts and their scales, and the float32 sum (k order). */
static void ssq_quantize_x(const float *x, long ldx, int M, int K, int G, int16_t *xq,
                           float *xs, float *xsum) {
    int KG = K / G;
    float rest[128];
    for (int m = 0; m < M; m++)
        for (int g = 0; g < KG; g++) {
            const float *xg = x + (long)m * ldx + (long)g * G;
            int16_t *q1 = xq + (long)m * 2 * K + (long)g * G, *q2 = q1 + K;
            float s = 0.0f;
            for (int k = 0; k < G; k++) s += xg[k];
            float d1 = ssq_int16(xg, G, q1);
            for (int k = 0; k < G; k++) rest[k] = xg[k] - d1 * (float)q1[k];
            float d2 = ssq_int16(rest, G, q2);
            xs[2 * ((long)m * KG + g)] = d1;
            xs[2 * ((long)m * KG + g) + 1] = d2;
            xsum[(long)m * KG + g] = s;
        }
}

static void ssq_run(const uint8_t *W, int bits, int has_off, int G, int K, int N, int p0, int p1,
                    const int16_t *xq, const float *xs, const float *xsum, int M, float *y,
                    long ldy, const float *b) {
    if (bits == 4) ssq_panels4(W, has_off, G, K, N, p0, p1, xq, xs, xsum, M, y, ldy, b);
    else ssq_panels8(W, has_off, G, K, N, p0, p1, xq, xs, xsum, M, y, ldy, b);
}

/* y[M, N] = x[M, K] @ W (+ b); W a blob as above (bits 4: G % 4 == 0, G <= 128; bits 8:
 * G % 2 == 0, G <= 32). Returns 0, or -1 when the int16 activations cannot be allocated. */
static int ssq_gemm(const uint8_t *W, int bits, int has_off, int G, int K, int N, const float *x,
                    long ldx, int M, float *y, long ldy, const float *b, int n_threads) {
    int P = (N + SSQ_NB - 1) / SSQ_NB, KG = K / G;
    if (G > 128) return -1;
    int16_t *xq = (int16_t *)malloc(sizeof(int16_t) * 2 * (size_t)M * (size_t)K + 64);
    float *xs = (float *)malloc(sizeof(float) * 3 * (size_t)M * (size_t)KG + 64);
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    float *xsum = xs + 2 * (size_t)M * KG;
    ssq_quantize_x(x, ldx, M, K, G, xq, xs, xsum);
    if (n_threads <= 1 || P < 2 * n_threads) {
        ssq_run(W, bits, has_off, G, K, N, 0, P, xq, xs, xsum, M, y, ldy, b);
    } else {
#ifdef _OPENMP
        #pragma omp parallel num_threads(n_threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int q0 = (int)((long)P * t / nt), q1 = (int)((long)P * (t + 1) / nt);
            ssq_run(W, bits, has_off, G, K, N, q0, q1, xq, xs, xsum, M, y, ldy, b);
        }
#else
        ssq_run(W, bits, has_off, G, K, N, 0, P, xq, xs, xsum, M, y, ldy, b);
#endif
    }
    free(xq);
    free(xs);
    return 0;
}

#endif
