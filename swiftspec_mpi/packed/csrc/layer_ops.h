/* The small operations of a decoder layer on the CPU, for decode-sized batches (M <= 64 rows),
 * float32 throughout: what runs between the GEMMs of csrc/gemm_avx2.h and csrc/gemm_q.h.
 *
 *   sso_add_rmsnorm  x[M, H] += a (optional); out[M, H] = x * rsqrt(mean(x^2) + eps) * w[H]
 *   sso_rope_kv      RoPE on the q and k heads of qkv[M, (nh + 2 nkv) hd] (in place) at the
 *                    rows' positions, then k and v into the KV cache slots [start, start + M)
 *   sso_attention    out[M, nh hd] = softmax(q k^T / sqrt(hd) over the visible slots) v, with a
 *                    mask [M, S] (1 = visible), grouped-query heads (nh / nkv queries a KV head)
 *   sso_silu_mul     out[M, I] = silu(gu[:, :I]) * gu[:, I:]
 *
 * Sizes: H a multiple of 8, hd a multiple of 16 up to 128 (cpu_ops.usable checks), any I.
 *
 * In torch each of these is several operators and about 5-20 µs of dispatch a call; a 1.5B
 * decode step ran ~20 of them a layer (9 ms a step on 2 cores, 15 % of the packed 4-bit step).
 *
 * Determinism: every row's result depends only on that row's inputs and, for attention, on the
 * sequence of its visible slots' K/V values, never on M, the other rows, the thread count or
 * where the visible slots lie: the same token sees the same numbers in a one-token step and in a
 * tree verify (so `async`/`sync` equal `ar` token for token). Attention gathers a row's visible
 * slots in slot order, computes their scores, then max, exp and sums in that order, in blocks of
 * 8 counted from the first visible slot; exp is one polynomial (sso_exp8) for every element.
 * Compiled for AVX2 + FMA by function attribute (callers check the CPU; the packed layout needs
 * it anyway).
 */
#ifndef SWIFTSPEC_LAYER_OPS_H
#define SWIFTSPEC_LAYER_OPS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SSO_AVX2 __attribute__((target("avx2,fma")))

/* exp(x) for 8 floats: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (two-part ln 2), e^r by
 * a degree-6 polynomial (relative error ~1e-7 on |r| <= ln 2 / 2); x < -87.3 (and -inf) gives
 * exactly 0, x > 88.3 saturates at exp(88.3). */
static inline __attribute__((always_inline)) SSO_AVX2 __m256 sso_exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

static inline __attribute__((always_inline)) SSO_AVX2 float sso_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_i a[i] b[i], n a multiple of 8, in a fixed order (4 chains of 8 lanes, then folded). */
static inline __attribute__((always_inline)) SSO_AVX2 float sso_dot(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return sso_hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* x[M, H] (row stride ldx) += a[M, H] (row stride lda; a may be NULL); out[M, H] (row stride
 * ldo) = x * rsqrt(mean(x^2) + eps) * w. H a multiple of 8. */
static SSO_AVX2 void sso_add_rmsnorm(float *x, long ldx, const float *a, long lda, const float *w,
                                     float eps, float *out, long ldo, int M, int H) {
    for (int m = 0; m < M; m++) {
        float *xr = x + m * ldx;
        if (a) {
            const float *ar = a + m * lda;
            for (int i = 0; i < H; i += 8)
                _mm256_storeu_ps(xr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(ar + i)));
        }
        const float r = 1.0f / sqrtf(sso_dot(xr, xr, H) / (float)H + eps);
        const __m256 rv = _mm256_set1_ps(r);
        float *o = out + m * ldo;
        for (int i = 0; i < H; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), rv),
                                                  _mm256_loadu_ps(w + i)));
    }
}

/* RoPE with the model's tables (P rows = positions, [P, hd]; sin signed so that
 * rot(v)[i] = v[i] cos[i] + v[(i + hd/2) % hd] sin[i]) on the nh q heads and nkv k heads of each
 * row of qkv [M, (nh + 2 nkv) hd] (row stride ldqkv), in place; then the row's k and v heads
 * into kc, vc [slots, nkv, hd] at slot start + m. hd a multiple of 16, <= 512. Returns -1 (and
 * changes nothing) when a position lies outside the tables, else 0. */
static SSO_AVX2 int sso_rope_kv(float *qkv, long ldqkv, const int64_t *pos, const float *cos_t,
                                const float *sin_t, long P, int M, int nh, int nkv, int hd,
                                float *kc, float *vc, long start) {
    const int half = hd / 2;
    float tmp[512];
    for (int m = 0; m < M; m++)
        if (pos[m] < 0 || pos[m] >= P) return -1;
    for (int m = 0; m < M; m++) {
        float *row = qkv + m * ldqkv;
        const float *c = cos_t + pos[m] * hd, *s = sin_t + pos[m] * hd;
        for (int h = 0; h < nh + nkv; h++) {
            float *v = row + (long)h * hd;
            memcpy(tmp, v, sizeof(float) * hd);
            for (int i = 0; i < hd; i += 8) {
                const int j = i < half ? i + half : i - half;
                _mm256_storeu_ps(v + i, _mm256_fmadd_ps(_mm256_loadu_ps(tmp + i), _mm256_loadu_ps(c + i),
                                                        _mm256_mul_ps(_mm256_loadu_ps(tmp + j),
                                                                      _mm256_loadu_ps(s + i))));
            }
        }
        const long kvn = (long)nkv * hd;
        memcpy(kc + (start + m) * kvn, row + (long)nh * hd, sizeof(float) * kvn);
        memcpy(vc + (start + m) * kvn, row + (long)(nh + nkv) * hd, sizeof(float) * kvn);
    }
    return 0;
}

/* One (row, head): o[hd] = softmax(scale q.k_j over the visible slots vis[0..nv)) . v_j.
 * sc: scratch of nv rounded up to 8 floats. */
static inline __attribute__((always_inline)) SSO_AVX2
void sso_attend_one(const float *q, const float *kc, const float *vc, long kvs, const int *vis,
                    int nv, int hd, float scale, float *sc, float *o) {
    const int nv8 = (nv + 7) & ~7;
    for (int j = 0; j < nv; j++) sc[j] = sso_dot(q, kc + vis[j] * kvs, hd) * scale;
    for (int j = nv; j < nv8; j++) sc[j] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < nv8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 mv = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nv8; j += 8) {
        const __m256 p = sso_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
        _mm256_storeu_ps(sc + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    const float inv = 1.0f / sso_hsum8(sum);
    __m256 acc[16];                               /* hd <= 128 */
    const int nb = hd / 8;
    for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
    for (int j = 0; j < nv; j++) {
        const __m256 p = _mm256_set1_ps(sc[j]);
        const float *v = vc + vis[j] * kvs;
        for (int b = 0; b < nb; b++) acc[b] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * b), acc[b]);
    }
    const __m256 iv = _mm256_set1_ps(inv);
    for (int b = 0; b < nb; b++) _mm256_storeu_ps(o + 8 * b, _mm256_mul_ps(acc[b], iv));
}

/* Attention of M query rows over S slots. q: rows of qkv (row stride ldq), head h at h hd;
 * kc, vc [S, nkv, hd]; mask uint8 [M, S] (row stride ldm; nonzero = visible); out [M, nh hd]
 * (row stride ldo). Query head h reads KV head h / (nh / nkv). hd a multiple of 8, <= 128.
 * Returns -1 when the scratch cannot be allocated, else 0. */
static SSO_AVX2 int sso_attention(const float *q, long ldq, int M, int nh, int nkv, int hd,
                                  const float *kc, const float *vc, int S, const uint8_t *mask,
                                  long ldm, float *out, long ldo, float scale, int n_threads) {
    int *vis = (int *)malloc(sizeof(int) * (size_t)M * (size_t)S + 64);
    int *nvis = (int *)malloc(sizeof(int) * (size_t)M + 64);
    if (!vis || !nvis) { free(vis); free(nvis); return -1; }
    for (int m = 0; m < M; m++) {
        int n = 0;
        const uint8_t *mr = mask + m * ldm;
        int *vr = vis + (long)m * S;
        for (int s = 0; s < S; s++)
            if (mr[s]) vr[n++] = s;
        nvis[m] = n;
    }
    const int g = nh / nkv, units = M * nh;
    const long kvs = (long)nkv * hd;
    int fail = 0;
    #pragma omp parallel num_threads(units < n_threads ? units : n_threads) reduction(|:fail)
    {
        float *sc = (float *)malloc(sizeof(float) * ((size_t)S + 8));
        if (!sc) fail = 1;
        else {
            #pragma omp for schedule(static)
            for (int u = 0; u < units; u++) {
                const int m = u / nh, h = u % nh, kvh = h / g;
                float *o = out + m * ldo + (long)h * hd;
                if (nvis[m] == 0) { memset(o, 0, sizeof(float) * hd); continue; }
                sso_attend_one(q + m * ldq + (long)h * hd, kc + (long)kvh * hd, vc + (long)kvh * hd,
                               kvs, vis + (long)m * S, nvis[m], hd, scale, sc, o);
            }
            free(sc);
        }
    }
    free(vis);
    free(nvis);
    return fail ? -1 : 0;
}

/* out[M, I] (row stride ldo) = silu(gu[:, :I]) * gu[:, I:] (gu row stride ldg), any I (a tail
 * of I % 8 goes through the same 8-wide arithmetic from a padded copy). silu(g) = g / (1 + exp(-g)). */
static inline __attribute__((always_inline)) SSO_AVX2 __m256 sso_silu_mul8(__m256 g, __m256 u) {
    const __m256 e = sso_exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

static SSO_AVX2 void sso_silu_mul(const float *gu, long ldg, int M, int I, float *out, long ldo) {
    const int I8 = I & ~7;
    for (int m = 0; m < M; m++) {
        const float *gr = gu + m * ldg, *ur = gr + I;
        float *o = out + m * ldo;
        for (int i = 0; i < I8; i += 8)
            _mm256_storeu_ps(o + i, sso_silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
        if (I8 < I) {
            float g8[8] = {0}, u8[8] = {0}, o8[8];
            memcpy(g8, gr + I8, sizeof(float) * (I - I8));
            memcpy(u8, ur + I8, sizeof(float) * (I - I8));
            _mm256_storeu_ps(o8, sso_silu_mul8(_mm256_loadu_ps(g8), _mm256_loadu_ps(u8)));
            memcpy(o + I8, o8, sizeof(float) * (I - I8));
        }
    }
}

#endif
