/* Decode GEMM on packed 4-/6-/8-bit weights for the CPU path: y[M, N] = x[M, K] @ W + b with
 * W = q * scale (+ offset) per group of G inputs; x, y, b float32. One set of record layouts, two
 * instruction sets: AVX-512 VNNI (vpdpwssd: 32 code x input products a µop, one register holds a
 * panel's 16 outputs) where the CPU has it, else AVX2 (vpmaddwd on each half of a record step
 * for 8-bit records; the byte path, vpmaddubsw with two int8 activation parts, for 4- and
 * 6-bit records: below, "AVX2 byte path").
 *
 * W blob: records of panels of 16 outputs, panel-major, then along K (outputs past N: zeros).
 * Codes come in steps of 64 bytes = 32 int16 lanes; lane L holds output o = L / 2, t = L % 2:
 *     4-bit, step of 8 k:  q[o][k+t] | q[o][k+2+t] << 4 | q[o][k+4+t] << 8 | q[o][k+6+t] << 12
 *     8-bit, step of 4 k:  int8 q[o][k+t] low byte, q[o][k+2+t] high byte
 *     6-bit, step of 8 k:  the 4-bit step of the low 4 bits (64 bytes), then 32 bytes, one a
 *                          lane: bits 2j, 2j+1 = bits 4, 5 of q[o][k+2j+t] (codes 0..63)
 * Record kinds (kind argument):
 *   SSQ_Q4 / SSQ_Q8   one record per (panel, group): codes G * 8 (4-bit) or G * 16 (8-bit)
 *                     bytes, scale float32 [16], offset float32 [16] (only when has_offset)
 *   SSQ_K4            GGUF Q4_K kept in its two levels, one record per (panel, 256 inputs):
 *                     the 256 / G groups' 4-bit codes, sub-scales int8 [256 / G][16], sub-offsets
 *                     int8 [256 / G][16], d float32 [16], dmin float32 [16]; a group's scale =
 *                     d sc, offset = -(dmin m): 4.75 bits a weight (G = 32) instead of 6
 *   SSQ_K6            GGUF Q6_K the same way: 6-bit codes (q + 32), sub-scales int8
 *                     [256 / G][16], d float32 [16]; scale = d sc, offset = -32 d sc:
 *                     6.625 bits a weight (G = 16) instead of 10 as 8-bit records
 * (every scale and offset is the float32 product the packed kinds hold, exact: so all kinds of
 * one weight give the same sums.)
 *   x [M, K] row stride ldx; y [M, N] row stride ldy (columns < N written); b [N] or NULL
 *
 * So nibble (or byte) j of every lane, masked out, pairs with one broadcast input pair
 * (x[k + 2j], x[k + 2j + 1]): four (two) multiply-adds a step, no shuffles.
 *
 * Activations: each row's group of G inputs is split into two int16 parts, x ~ xs1 xq1 + xs2 xq2
 * (xq1 = round(x / xs1), xs1 = max|x| / 32767; xq2 the same of the remainder), so the code x
 * input products of a group sum exactly in int32 (below 2^31: G <= 128 4-bit or G <= 32 8-bit
 * codes; G <= 32 6-bit). The split leaves at most max|x| / 2^31 per input (float32 rounding level; one int16
 * part alone left max|x| / 65534, which outlier channels of real models turned into 1e-3 logit
 * errors). Per record and row:
 *     acc[j] += float(sum_k xq1 q) * (xs1 scale[j]) + float(sum_k xq2 q) * (xs2 scale[j])
 *               + xsum * offset[j]
 * with xsum the group's float32 sum of x (the offset term). The integer sums are exact whatever
 * their order, and both instruction sets run the same float32 operations per output in the same
 * order: an 8-bit record's result is bit-identical across them; every result is bit-identical
 * across the thread count, M and the other rows (the AVX2 byte path's too: so 4- and 6-bit
 * results agree across instruction sets within the byte path's bound, not bit for bit).
 *
 * Every record is read once per 16 rows of x and reused from L1 for rows in blocks of 4
 * (AVX-512) or 2 (AVX2). Threads: panels split into contiguous ranges, one per OpenMP thread.
 */
#ifndef SWIFTSPEC_GEMM_Q_H
#define SWIFTSPEC_GEMM_Q_H

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
#define SSQ_AVX2 __attribute__((target("avx2,fma")))
#define SSQ_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vnni")))
/* xq holds row m's part 1 at m * 2K and its part 2 at m * 2K + K: row stride ldq = 2K */
#define SSQ_PART(ldq) ((ldq) >> 1)

enum { SSQ_ISA_AVX2 = 1, SSQ_ISA_AVX512 = 2 };
enum { SSQ_Q4 = 0, SSQ_Q8 = 1, SSQ_K4 = 2, SSQ_K6 = 3 };   /* record kinds (the header) */
#define SSQ_SB 256     /* inputs per super-block (K4, K6) */

static inline int32_t ssq_pair(const int16_t *xq) {      /* the input pair (xq[0], xq[1]) */
    int32_t v;
    memcpy(&v, xq, 4);
    return v;
}

/* Records are read in order: fetch SSQ_PREFETCH bytes ahead of the bytes [p, p + n) about to be
 * read into L1. Without it one core streamed 9-13 GB/s, with it 20-22 (Xeon, 1.5B gate|up-sized
 * matrix); 4-16 KiB ahead measured alike. Past the blob's end it is a no-op (no faults). */
#ifndef SSQ_PREFETCH
#define SSQ_PREFETCH 4096
#endif
static inline __attribute__((always_inline)) void ssq_prefetch(const uint8_t *p, long n) {
    for (long o = 0; o < n; o += 64) _mm_prefetch((const char *)p + SSQ_PREFETCH + o, _MM_HINT_T0);
}

/* Where a group's codes and scales lie: see the header's record layouts. */
typedef struct {
    int kind, G, KG;        /* kind SSQ_Q4 / Q8 / K4 / K6; group; groups along K */
    int has_off;            /* Q4, Q8: offsets stored; K4: always; K6: never (offset -32 scale) */
    long code_bytes;        /* one group's codes */
    long S;                 /* bytes of a record (Q4, Q8: one group; K4, K6: one super-block) */
    int sbg;                /* groups a record holds (1, or 256 / G) */
} SsqGeo;

static SsqGeo ssq_geo(int kind, int has_off, int G, int K) {
    SsqGeo q;
    q.kind = kind, q.G = G, q.KG = K / G;
    q.has_off = kind == SSQ_K4 ? 1 : kind == SSQ_K6 ? 0 : has_off;
    q.code_bytes = (long)G * (kind == SSQ_Q8 ? 16 : kind == SSQ_K6 ? 12 : 8);
    if (kind == SSQ_Q4 || kind == SSQ_Q8) {
        q.sbg = 1;
        q.S = q.code_bytes + 64 * (1 + q.has_off);
    } else {
        q.sbg = SSQ_SB / G;
        q.S = q.sbg * (q.code_bytes + 16L * (1 + q.has_off)) + 64 * (1 + q.has_off);
    }
    return q;
}

/* Group gg of a record: prefetch its bytes ahead (the record's tail with its first group). */
static inline __attribute__((always_inline))
void ssq_prefetch_group(const SsqGeo *q, int sbg, const uint8_t *codes, const uint8_t *tail, int gg) {
    if (sbg == 1) ssq_prefetch(codes, q->S);
    else {
        ssq_prefetch(codes, q->code_bytes);
        if (gg == 0) ssq_prefetch(tail, q->S - sbg * q->code_bytes);
    }
}

/* Q4 / K4: 8 k a 64-byte step, nibble j of each lane the code of k + 2j + t. K6: 8 k a 96-byte
 * step, the 64 bytes of a 4-bit step (low 4 bits) then one byte a lane (o, t) whose bits
 * 2j, 2j + 1 are bits 4, 5 of the code of k + 2j + t (codes 0..63 = Q6_K's q + 32). Q8: 4 k a
 * 64-byte step, int8 low byte k + t, high byte k + 2 + t. */
#define SSQ_STEP_K(kind) ((kind) == SSQ_Q8 ? 4 : 8)
#define SSQ_STEP_BYTES(kind) ((kind) == SSQ_K6 ? 96 : 64)
#define SSQ_NJ(kind) ((kind) == SSQ_Q8 ? 2 : 4)

/* A step's codes as int16 lanes, one register per input pair j (q[0..1] for Q8, else q[0..3]),
 * for vectors of W = 512 or 256 bits: v holds the step's code lanes (int16), HIGH (read for K6
 * only) the 8-bit lanes of its high bits. The one decoding of the layouts above for both ISAs. */
#define SSQ_CODES(W, kind, v, HIGH, q)                                                          \
    do {                                                                                        \
        const __m##W##i m4 = _mm##W##_set1_epi16(0x0F);                                         \
        if ((kind) == SSQ_Q8) {                                                                 \
            q[0] = _mm##W##_srai_epi16(_mm##W##_slli_epi16(v, 8), 8);                           \
            q[1] = _mm##W##_srai_epi16(v, 8);                                                   \
            break;                                                                              \
        }                                                                                       \
        q[0] = _mm##W##_and_si##W(v, m4);                                                       \
        q[1] = _mm##W##_and_si##W(_mm##W##_srli_epi16(v, 4), m4);                               \
        q[2] = _mm##W##_and_si##W(_mm##W##_srli_epi16(v, 8), m4);                               \
        q[3] = _mm##W##_srli_epi16(v, 12);                                                      \
        if ((kind) == SSQ_K6) {                                                                 \
            const __m##W##i m2 = _mm##W##_set1_epi16(0x30);                                     \
            const __m##W##i hb = _mm##W##_cvtepu8_epi16(HIGH);                                  \
            q[0] = _mm##W##_or_si##W(q[0], _mm##W##_and_si##W(_mm##W##_slli_epi16(hb, 4), m2)); \
            q[1] = _mm##W##_or_si##W(q[1], _mm##W##_and_si##W(_mm##W##_slli_epi16(hb, 2), m2)); \
            q[2] = _mm##W##_or_si##W(q[2], _mm##W##_and_si##W(hb, m2));                         \
            q[3] = _mm##W##_or_si##W(q[3], _mm##W##_and_si##W(_mm##W##_srli_epi16(hb, 2), m2)); \
        }                                                                                       \
    } while (0)

/* ------------------------------------------------------------------------------------------
 * AVX-512 VNNI. A step's codes as int16 lanes, one register per input pair j. */
static inline __attribute__((always_inline)) SSQ_AVX512
void ssq_codes_512(int kind, const uint8_t *c, __m512i *q) {
    const __m512i v = _mm512_loadu_si512((const void *)c);
    SSQ_CODES(512, kind, v, _mm256_loadu_si256((const __m256i *)(c + 64)), q);
}

/* Integer sums of one group's codes for R (1..4) rows x 2 parts, NCH independent accumulator
 * chains each (vpdpwssd's latency), folded at the end: s[2 r + e] = row r, part e. */
static inline __attribute__((always_inline)) SSQ_AVX512
void ssq_dot_512(int kind, const uint8_t *c, int G, const int16_t *xq, long ldq, int R, int NCH,
                 __m512i *s) {
    __m512i acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * R * NCH; i++) acc[i] = _mm512_setzero_si512();
    for (int k = 0; k < G; k += SSQ_STEP_K(kind), c += SSQ_STEP_BYTES(kind)) {
        __m512i q[4];
        ssq_codes_512(kind, c, q);
#pragma GCC unroll 8
        for (int i = 0; i < 2 * R; i++) {
            const int16_t *xr = xq + (i >> 1) * ldq + (i & 1) * SSQ_PART(ldq) + k;
            for (int j = 0; j < SSQ_NJ(kind); j++) {
                __m512i *a = &acc[i * NCH + j % NCH];
                *a = _mm512_dpwssd_epi32(*a, q[j], _mm512_set1_epi32(ssq_pair(xr + 2 * j)));
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < 2 * R; i++) {
        __m512i t = acc[i * NCH];
#pragma GCC unroll 4
        for (int h = 1; h < NCH; h++) t = _mm512_add_epi32(t, acc[i * NCH + h]);
        s[i] = t;
    }
}

/* Group g's scale and offset for the panel's 16 outputs (offset 0 when there is none). K4:
 * d sc, -(dmin m); K6: d sc, -32 d sc; every product exact in float32, as in the packed kinds. */
static inline __attribute__((always_inline)) SSQ_AVX512
void ssq_scales_512(const SsqGeo *q, int sbg, const uint8_t *tail, int gg, __m512 *sc,
                    __m512 *off) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    if (sbg == 1) {
        *sc = _mm512_loadu_ps((const float *)tail);
        *off = q->has_off ? _mm512_loadu_ps((const float *)tail + 16) : _mm512_setzero_ps();
        return;
    }
    const float *d = (const float *)(tail + 16L * sbg * (1 + q->has_off));
    __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(tail + 16 * gg))));
    *sc = _mm512_mul_ps(_mm512_loadu_ps(d), sub);
    if (q->kind == SSQ_K4) {
        __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(tail + 16L * sbg + 16 * gg))));
        *off = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(d + 16), m)), sign));
    } else {
        *off = _mm512_mul_ps(*sc, _mm512_set1_ps(-32.0f));
    }
}

/* acc (16 outputs of row gi's accumulator) += the group sums s1, s2 (see the header) */
static inline __attribute__((always_inline)) SSQ_AVX512
__m512 ssq_scale_512(__m512 acc, __m512i s1, __m512i s2, __m512 sc, __m512 off, const float *xs,
                     const float *xsum, long gi, int has_off) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(_mm512_set1_ps(xs[2 * gi]), sc),
                          acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2),
                          _mm512_mul_ps(_mm512_set1_ps(xs[2 * gi + 1]), sc), acc);
    if (has_off) acc = _mm512_fmadd_ps(_mm512_set1_ps(xsum[gi]), off, acc);
    return acc;
}

#define SSQ_BLOCK_512(R, NCH)                                                                  \
    do {                                                                                       \
        __m512i s[8];                                                                          \
        ssq_dot_512(kind, codes, G, xq + (long)(m0 + m) * 2 * K + (long)g * G, 2L * K, R, NCH, \
                    s);                                                                        \
        for (int r = 0; r < R; r++) {                                                          \
            long gi = (long)(m0 + m + r) * KG + g;                                             \
            acc[m + r] = ssq_scale_512(acc[m + r], s[2 * r], s[2 * r + 1], sc, off, xs, xsum,  \
                                       gi, has_off);                                           \
        }                                                                                      \
        m += R;                                                                                \
    } while (0)

/* Panels [p0, p1) for rows [0, M) (passes of SSQ_MB rows). xq int16 [M, 2, K] (the two parts);
 * xs float [M, K/G, 2] (their scales); xsum [M, K/G]. */
static inline __attribute__((always_inline)) SSQ_AVX512
void ssq_panels_512(const int kind, const SsqGeo *q, const uint8_t *W, int K, int N, int p0,
                    int p1, const int16_t *xq, const float *xs, const float *xsum, int M,
                    float *y, long ldy, const float *b) {
    const int G = q->G, KG = q->KG, has_off = kind == SSQ_K6 ? 1 : q->has_off;
    const int sbg = (kind == SSQ_Q4 || kind == SSQ_Q8) ? 1 : q->sbg;
    __m512 acc[SSQ_MB];
    for (int p = p0; p < p1; p++) {
        int n0 = p * SSQ_NB;
        int ncols = N - n0 < SSQ_NB ? N - n0 : SSQ_NB;
        for (int m0 = 0; m0 < M; m0 += SSQ_MB) {
            int mb = M - m0 < SSQ_MB ? M - m0 : SSQ_MB;
            for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
            const uint8_t *rec = W + (long)p * (KG / sbg) * q->S;
            for (int g = 0; g < KG; rec += q->S) {
                const uint8_t *tail = rec + sbg * q->code_bytes;
                for (int gg = 0; gg < sbg; gg++, g++) {
                    const uint8_t *codes = rec + gg * q->code_bytes;
                    __m512 sc, off;
                    ssq_scales_512(q, sbg, tail, gg, &sc, &off);
                    ssq_prefetch_group(q, sbg, codes, tail, gg);
                    int m = 0;
                    while (mb - m >= 4) SSQ_BLOCK_512(4, 1);
                    if (mb - m >= 2) SSQ_BLOCK_512(2, 2);
                    if (mb - m == 1) SSQ_BLOCK_512(1, 4);
                }
            }
            for (int r = 0; r < mb; r++) {
                float *yr = y + (long)(m0 + r) * ldy + n0;
                float t[SSQ_NB];
                _mm512_storeu_ps(t, acc[r]);
                for (int j = 0; j < ncols; j++) yr[j] = (b ? b[n0 + j] : 0.0f) + t[j];
            }
        }
    }
}

#define SSQ_ARGS const SsqGeo *q, const uint8_t *W, int K, int N, int p0, int p1,                \
                 const int16_t *xq, const float *xs, const float *xsum, int M, float *y, long ldy, \
                 const float *b
#define SSQ_PASS q, W, K, N, p0, p1, xq, xs, xsum, M, y, ldy, b
static SSQ_AVX512 void ssq_q4_512(SSQ_ARGS) { ssq_panels_512(SSQ_Q4, SSQ_PASS); }
static SSQ_AVX512 void ssq_q8_512(SSQ_ARGS) { ssq_panels_512(SSQ_Q8, SSQ_PASS); }
static SSQ_AVX512 void ssq_k4_512(SSQ_ARGS) { ssq_panels_512(SSQ_K4, SSQ_PASS); }
static SSQ_AVX512 void ssq_k6_512(SSQ_ARGS) { ssq_panels_512(SSQ_K6, SSQ_PASS); }

/* ------------------------------------------------------------------------------------------
 * AVX2: a step's two halves are outputs 0..7 (lo) and 8..15 (hi); the same codes as above. */
static inline __attribute__((always_inline)) SSQ_AVX2
void ssq_codes_256(int kind, const uint8_t *c, int h, __m256i *q) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * h));
    SSQ_CODES(256, kind, v, _mm_loadu_si128((const __m128i *)(c + 64 + 16 * h)), q);
}

/* Integer sums for R (1..2) rows x 2 parts: lo[2 r + e] (outputs 0..7), hi[2 r + e] (8..15). */
static inline __attribute__((always_inline)) SSQ_AVX2
void ssq_dot_256(int kind, const uint8_t *c, int G, const int16_t *xq, long ldq, int R,
                 __m256i *lo, __m256i *hi) {
    for (int r = 0; r < 2 * R; r++) { lo[r] = _mm256_setzero_si256(); hi[r] = lo[r]; }
    for (int k = 0; k < G; k += SSQ_STEP_K(kind), c += SSQ_STEP_BYTES(kind)) {
        __m256i q0[4], q1[4];
        ssq_codes_256(kind, c, 0, q0);
        ssq_codes_256(kind, c, 1, q1);
        for (int r = 0; r < 2 * R; r++) {    /* r = 2 row + part */
            const int16_t *xr = xq + (r >> 1) * ldq + (r & 1) * SSQ_PART(ldq) + k;
            __m256i sl = _mm256_setzero_si256(), sh = sl;
            for (int j = 0; j < SSQ_NJ(kind); j++) {
                __m256i xp = _mm256_set1_epi32(ssq_pair(xr + 2 * j));
                sl = _mm256_add_epi32(sl, _mm256_madd_epi16(q0[j], xp));
                sh = _mm256_add_epi32(sh, _mm256_madd_epi16(q1[j], xp));
            }
            lo[r] = _mm256_add_epi32(lo[r], sl);
            hi[r] = _mm256_add_epi32(hi[r], sh);
        }
    }
}

static inline __attribute__((always_inline)) SSQ_AVX2
void ssq_scales_256(const SsqGeo *q, int sbg, const uint8_t *tail, int gg, __m256 *sc,
                    __m256 *off) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    if (sbg == 1) {
        const float *f = (const float *)tail;
        for (int h = 0; h < 2; h++) {
            sc[h] = _mm256_loadu_ps(f + 8 * h);
            off[h] = q->has_off ? _mm256_loadu_ps(f + 16 + 8 * h) : _mm256_setzero_ps();
        }
        return;
    }
    const float *d = (const float *)(tail + 16L * sbg * (1 + q->has_off));
    for (int h = 0; h < 2; h++) {
        __m256 sub = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(tail + 16 * gg + 8 * h))));
        sc[h] = _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), sub);
        if (q->kind == SSQ_K4) {
            __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(tail + 16L * sbg + 16 * gg + 8 * h))));
            off[h] = _mm256_xor_ps(_mm256_mul_ps(_mm256_loadu_ps(d + 16 + 8 * h), m), sign);
        } else {
            off[h] = _mm256_mul_ps(sc[h], _mm256_set1_ps(-32.0f));
        }
    }
}

#define SSQ_XPARTS 2   /* int8 parts of the activations on the AVX2 byte path (below) */

/* ------------------------------------------------------------------------------------------
 * AVX2 byte path (Q4, K4, K6 where the CPU lacks AVX-512 VNNI): the codes as unsigned bytes
 * times SSQ_XPARTS = 2 int8 parts of the activations (vpmaddubsw: 32 byte products a µop, summed
 * in pairs into int16), instead of int16 codes times two int16 parts (vpmaddwd: 16 products a µop).
 *
 * Activations: each row's group of G inputs is split into two int8 parts, each scaled to its own
 * max, x ~ d1 b1 + d2 b2 (b = round(r / d) in [-127, 127], d = max|r| / 127, r the remainder of
 * the part before): at most max|x| / (4 127^2) ~ max|x| 1.6e-5 per input, against max|x| / 2^31
 * for the two int16 parts. On the real Qwen2.5-Coder 1.5B the logits stay within 2.1e-4 of
 * transformers' float32 ones (relative to the largest; bf16 weights alone move them more); a
 * third part (6e-8 per input, 9e-6 on the logits) cost 1.2-1.5x the GEMM time on AVX2 at
 * M = 1-2 (docs/benchmarks.md). The parts are stored in the order the code bytes pair with: per
 * 8 inputs k..k+7, bytes k, k+4, k+1, k+5 | k+2, k+6, k+3, k+7.
 *
 * A 4-bit step (64 bytes, 8 k of 16 outputs), half h = outputs 8h..8h+7, 16-bit lane (o, t):
 *     lo = v & 0x0F per byte: (q[o][k+t], q[o][k+4+t])     hi = (v >> 4) & 0x0F: (k+2+t, k+6+t)
 * so vpmaddubsw(lo, broadcast bytes (x_k, x_k+4, x_k+1, x_k+5)) gives lane (o, t) the sum
 * q[o][k+t] x[k+t] + q[o][k+4+t] x[k+4+t], and hi with (x_k+2, x_k+6, x_k+3, x_k+7) the other
 * two. K6 ORs bits 4, 5 of each code in from the step's 32 high-bit bytes (codes 0..63).
 * int16 bounds: a lane gains at most 2 * 2 * 15 * 127 = 7620 a 4-bit step (4 steps: 30480) and
 * 2 * 2 * 63 * 127 = 32004 a K6 step, so the int16 sums are widened to int32 (vpmaddwd by 1)
 * every 4 steps (every K6 step): exact integer sums, as in the int16 path. Per group and part:
 *     acc[j] += float(S_p) * (d_p scale[j])  (p = 1, 2),  then  + xsum * offset[j]
 * A row's result depends on that row only (not M, the threads or the neighbours). */
/* max |v[k]| over k < G (G % 8 == 0). */
static SSQ_AVX2 float ssq_absmax(const float *v, int G) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 mx = _mm256_setzero_ps();
    for (int k = 0; k < G; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(v + k), absmask));
    float t[8], amax = 0.0f;
    _mm256_storeu_ps(t, mx);
    for (int j = 0; j < 8; j++) amax = t[j] > amax ? t[j] : amax;
    return amax;
}

/* v[0..G) -> int8 b = round(v / d) (nearest even) in [-127, 127], stored per 8 inputs in the order k, k+4, k+1, k+5, k+2, k+6, k+3, k+7;
 * rest = v - d b;
 * returns d = max|v| / 127 (0 for an all-zero v). G % 8 == 0. */
static SSQ_AVX2 float ssq_int8_part(const float *v, int G, int8_t *b, float *rest) {
    const float amax = ssq_absmax(v, G);
    const float d = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f), vd = _mm256_set1_ps(d);
    const __m128i order = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (int k = 0; k < G; k += 8) {
        const __m256 x = _mm256_loadu_ps(v + k);
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
        q = _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        _mm256_storeu_ps(rest + k, _mm256_sub_ps(x, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(q))));
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        w = _mm_shuffle_epi8(_mm_packs_epi16(w, w), order);
        _mm_storel_epi64((__m128i *)(b + k), w);
    }
    return d;
}

/* Row m's group g of x -> SSQ_XPARTS int8 parts (xb [M, SSQ_XPARTS, K], the parts of a row K
 * apart), their scales xs [M, K/G, SSQ_XPARTS] and the float32 sum xsum [M, K/G] (as
 * ssq_quantize_x sums it). */
static SSQ_AVX2 void ssq_quantize_x8(const float *x, long ldx, int M, int K, int G, int8_t *xb,
                                     float *xs, float *xsum) {
    int KG = K / G;
    float rest[2][128];
    for (int m = 0; m < M; m++)
        for (int g = 0; g < KG; g++) {
            const float *xg = x + (long)m * ldx + (long)g * G;
            int8_t *b = xb + (long)m * SSQ_XPARTS * K + (long)g * G;
            __m256 acc = _mm256_setzero_ps();
            for (int k = 0; k < G; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xg + k));
            float t[8], s = 0.0f;
            _mm256_storeu_ps(t, acc);
            for (int j = 0; j < 8; j++) s += t[j];
            float *d = xs + SSQ_XPARTS * ((long)m * KG + g);
            const float *v = xg;
            for (int p = 0; p < SSQ_XPARTS; p++) {      /* part p from the remainder of part p - 1 */
                d[p] = ssq_int8_part(v, G, b + p * (long)K, rest[p % 2]);
                v = rest[p % 2];
            }
            xsum[(long)m * KG + g] = s;
        }
}

/* A step's code bytes for half h: lo (k+t, k+4+t), hi (k+2+t, k+6+t) of lane (o, t). */
static inline __attribute__((always_inline)) SSQ_AVX2
void ssq_codes8_256(int kind, const uint8_t *c, int h, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * h));
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (kind == SSQ_K6) {       /* lane byte j: bits 2j, 2j+1 = bits 4, 5 of the code of k+2j+t */
        const __m256i m2 = _mm256_set1_epi16(0x3030);
        const __m256i hb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(c + 64 + 16 * h)));
        /* t: bits 4, 5 of byte 0 = j 0 (k+t), of byte 1 = j 2 (k+4+t); t >> 2 the same for j 1, 3 */
        const __m256i t = _mm256_or_si256(_mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 8));
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(t, m2));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srli_epi16(t, 2), m2));
    }
}

/* One row's group: acc0, acc1 (outputs 0..7, 8..15) += sum over the parts of float(S_p) sf[p][h],
 * S_p the exact integer sums of the group's codes times part p. xb: the row's part 1 at this group
 * (parts K apart). */
static inline __attribute__((always_inline)) SSQ_AVX2
void ssq_group8_256(int kind, const uint8_t *c, int G, const int8_t *xb, long K,
                    const __m256 *sf, __m256 *acc0, __m256 *acc1) {
    const int flush = kind == SSQ_K6 ? 1 : 4;         /* steps an int16 sum can take */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s32[SSQ_XPARTS][2], s16[SSQ_XPARTS][2];
    for (int p = 0; p < SSQ_XPARTS; p++)
        for (int h = 0; h < 2; h++) s32[p][h] = s16[p][h] = _mm256_setzero_si256();
    const int steps = G / 8;
    for (int st = 0; st < steps; st++, c += SSQ_STEP_BYTES(kind)) {
        __m256i lo[2], hi[2];
        ssq_codes8_256(kind, c, 0, &lo[0], &hi[0]);
        ssq_codes8_256(kind, c, 1, &lo[1], &hi[1]);
        for (int p = 0; p < SSQ_XPARTS; p++) {
            int32_t a, b;
            memcpy(&a, xb + p * K + 8 * st, 4);
            memcpy(&b, xb + p * K + 8 * st + 4, 4);
            const __m256i xa = _mm256_set1_epi32(a), xc = _mm256_set1_epi32(b);
            for (int h = 0; h < 2; h++) {
                const __m256i prod = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa),
                                                      _mm256_maddubs_epi16(hi[h], xc));
                if (flush == 1)         /* K6: widened at once (no int16 sum to keep) */
                    s32[p][h] = _mm256_add_epi32(s32[p][h], _mm256_madd_epi16(prod, ones));
                else
                    s16[p][h] = _mm256_add_epi16(s16[p][h], prod);
            }
        }
        if (flush > 1 && ((st + 1) % flush == 0 || st + 1 == steps))
            for (int p = 0; p < SSQ_XPARTS; p++)
                for (int h = 0; h < 2; h++) {
                    s32[p][h] = _mm256_add_epi32(s32[p][h], _mm256_madd_epi16(s16[p][h], ones));
                    s16[p][h] = _mm256_setzero_si256();
                }
    }
    for (int p = 0; p < SSQ_XPARTS; p++) {
        *acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[p][0]), sf[2 * p], *acc0);
        *acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[p][1]), sf[2 * p + 1], *acc1);
    }
}

/* Panels [p0, p1) for rows [0, M). bytes = 0: xp is the int16 parts [M, 2, K], xs [M, K/G, 2];
 * bytes = 1 (the byte path below, 4- and 6-bit kinds): xp the int8 parts [M, SSQ_XPARTS, K], xs
 * [M, K/G, SSQ_XPARTS]. xsum [M, K/G]. */
static inline __attribute__((always_inline)) SSQ_AVX2
void ssq_panels_256(const int kind, const int bytes, const SsqGeo *q, const uint8_t *W, int K,
                    int N, int p0, int p1, const void *xp, const float *xs, const float *xsum,
                    int M, float *y, long ldy, const float *b) {
    const int G = q->G, KG = q->KG, has_off = kind == SSQ_K6 ? 1 : q->has_off;
    const int sbg = (kind == SSQ_Q4 || kind == SSQ_Q8) ? 1 : q->sbg;
    const int16_t *xq = (const int16_t *)xp;
    const int8_t *xb = (const int8_t *)xp;
    __m256 acc0[SSQ_MB], acc1[SSQ_MB];
    __m256i lo[4], hi[4];      /* [2 row + part] */
    for (int p = p0; p < p1; p++) {
        int n0 = p * SSQ_NB;
        int ncols = N - n0 < SSQ_NB ? N - n0 : SSQ_NB;
        for (int m0 = 0; m0 < M; m0 += SSQ_MB) {
            int mb = M - m0 < SSQ_MB ? M - m0 : SSQ_MB;
            for (int r = 0; r < mb; r++) { acc0[r] = _mm256_setzero_ps(); acc1[r] = acc0[r]; }
            const uint8_t *rec = W + (long)p * (KG / sbg) * q->S;
            for (int g = 0; g < KG; g++) {
                const int gg = g % sbg;               /* sbg: 1, or a power of 2 */
                if (g && !gg) rec += q->S;
                const uint8_t *tail = rec + sbg * q->code_bytes, *codes = rec + gg * q->code_bytes;
                __m256 sc[2], off[2];
                ssq_scales_256(q, sbg, tail, gg, sc, off);
                ssq_prefetch_group(q, sbg, codes, tail, gg);
                for (int i = 0; bytes && i < mb; i++) {
                    const long gi = (long)(m0 + i) * KG + g;
                    __m256 sf[2 * SSQ_XPARTS];
                    for (int e = 0; e < SSQ_XPARTS; e++) {
                        const __m256 d = _mm256_broadcast_ss(xs + SSQ_XPARTS * gi + e);
                        sf[2 * e] = _mm256_mul_ps(d, sc[0]);
                        sf[2 * e + 1] = _mm256_mul_ps(d, sc[1]);
                    }
                    ssq_group8_256(kind, codes, G, xb + (long)(m0 + i) * SSQ_XPARTS * K + (long)g * G, K,
                                   sf, &acc0[i], &acc1[i]);
                    if (has_off) {
                        const __m256 xt = _mm256_broadcast_ss(xsum + gi);
                        acc0[i] = _mm256_fmadd_ps(xt, off[0], acc0[i]);
                        acc1[i] = _mm256_fmadd_ps(xt, off[1], acc1[i]);
                    }
                }
                for (int m = 0; !bytes && m < mb; m += 2) {
                    int R = mb - m < 2 ? mb - m : 2;
                    const int16_t *xg = xq + (long)(m0 + m) * 2 * K + (long)g * G;
                    if (R == 2) ssq_dot_256(kind, codes, G, xg, 2L * K, 2, lo, hi);
                    else ssq_dot_256(kind, codes, G, xg, 2L * K, 1, lo, hi);
                    for (int r = 0; r < R; r++) {
                        int i = m + r;
                        long gi = (long)(m0 + i) * KG + g;
                        __m256 s1 = _mm256_broadcast_ss(xs + 2 * gi);
                        __m256 s2 = _mm256_broadcast_ss(xs + 2 * gi + 1);
                        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[2 * r]),
                                                  _mm256_mul_ps(s1, sc[0]), acc0[i]);
                        acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[2 * r]),
                                                  _mm256_mul_ps(s1, sc[1]), acc1[i]);
                        acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[2 * r + 1]),
                                                  _mm256_mul_ps(s2, sc[0]), acc0[i]);
                        acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[2 * r + 1]),
                                                  _mm256_mul_ps(s2, sc[1]), acc1[i]);
                        if (has_off) {
                            __m256 xt = _mm256_broadcast_ss(xsum + gi);
                            acc0[i] = _mm256_fmadd_ps(xt, off[0], acc0[i]);
                            acc1[i] = _mm256_fmadd_ps(xt, off[1], acc1[i]);
                        }
                    }
                }
            }
            for (int r = 0; r < mb; r++) {
                float *yr = y + (long)(m0 + r) * ldy + n0;
                float t[SSQ_NB];
                _mm256_storeu_ps(t, acc0[r]);
                _mm256_storeu_ps(t + 8, acc1[r]);
                for (int j = 0; j < ncols; j++) yr[j] = (b ? b[n0 + j] : 0.0f) + t[j];
            }
        }
    }
}

#define SSQ8_ARGS const SsqGeo *q, const uint8_t *W, int K, int N, int p0, int p1,               \
                  const int8_t *xb, const float *xs, const float *xsum, int M, float *y, long ldy, \
                  const float *b
#define SSQ8_PASS q, W, K, N, p0, p1, xb, xs, xsum, M, y, ldy, b
static SSQ_AVX2 void ssq8_q4_256(SSQ8_ARGS) { ssq_panels_256(SSQ_Q4, 1, SSQ8_PASS); }
static SSQ_AVX2 void ssq8_k4_256(SSQ8_ARGS) { ssq_panels_256(SSQ_K4, 1, SSQ8_PASS); }
static SSQ_AVX2 void ssq8_k6_256(SSQ8_ARGS) { ssq_panels_256(SSQ_K6, 1, SSQ8_PASS); }

static SSQ_AVX2 void ssq_q4_256(SSQ_ARGS) { ssq_panels_256(SSQ_Q4, 0, SSQ_PASS); }
static SSQ_AVX2 void ssq_q8_256(SSQ_ARGS) { ssq_panels_256(SSQ_Q8, 0, SSQ_PASS); }
static SSQ_AVX2 void ssq_k4_256(SSQ_ARGS) { ssq_panels_256(SSQ_K4, 0, SSQ_PASS); }
static SSQ_AVX2 void ssq_k6_256(SSQ_ARGS) { ssq_panels_256(SSQ_K6, 0, SSQ_PASS); }

/* ------------------------------------------------------------------------------------------ */

/* The instruction set ssq_gemm runs: the best this CPU has unless ssq_set_isa chose one. */
static int ssq_isa_now = 0;

static int ssq_cpu_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni"))
        return SSQ_ISA_AVX512;
    return SSQ_ISA_AVX2;
}

static int ssq_isa(void) {
    if (!ssq_isa_now) ssq_isa_now = ssq_cpu_isa();
    return ssq_isa_now;
}

/* Run `isa` (SSQ_ISA_*; 0: the best this CPU has) from now on; -1 when this CPU lacks it. */
static int ssq_set_isa(int isa) {
    int best = ssq_cpu_isa();
    if (isa == 0) isa = best;
    if (isa < SSQ_ISA_AVX2 || isa > best) return -1;
    ssq_isa_now = isa;
    return 0;
}

/* v[0..G) -> int16 codes q = round(v / d) (nearest even, as lrintf), d = max|v| / 32767 (0 for
 * an all-zero v); -> d. G % 8 == 0. AVX2 for every instruction set: the same bits on all. */
static SSQ_AVX2 float ssq_int16(const float *v, int G, int16_t *q) {
    const float amax = ssq_absmax(v, G);
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
    for (int k = 0; k < G; k += 16) {      /* |v inv| <= 32767 (+ rounding): packs saturate */
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + k), inv));
        __m256i b = k + 8 < G ? _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + k + 8), inv))
                              : _mm256_setzero_si256();
        __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        p = _mm256_max_epi16(p, _mm256_set1_epi16(-32767));
        if (k + 8 < G) _mm256_storeu_si256((__m256i *)(q + k), p);
        else _mm_storeu_si128((__m128i *)(q + k), _mm256_castsi256_si128(p));
    }
    return amax / 32767.0f;
}

/* Row m's group g of x -> two int16 parts and their scales, and the float32 sum (in 8 lanes
 * over k mod 8, then lanes 0..7 in order). */
static SSQ_AVX2 void ssq_quantize_x(const float *x, long ldx, int M, int K, int G, int16_t *xq,
                                    float *xs, float *xsum) {
    int KG = K / G;
    float rest[128];
    for (int m = 0; m < M; m++)
        for (int g = 0; g < KG; g++) {
            const float *xg = x + (long)m * ldx + (long)g * G;
            int16_t *q1 = xq + (long)m * 2 * K + (long)g * G, *q2 = q1 + K;
            __m256 acc = _mm256_setzero_ps();
            for (int k = 0; k < G; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xg + k));
            float t[8], s = 0.0f;
            _mm256_storeu_ps(t, acc);
            for (int j = 0; j < 8; j++) s += t[j];
            float d1 = ssq_int16(xg, G, q1);
            const __m256 vd1 = _mm256_set1_ps(d1);
            for (int k = 0; k < G; k += 8) {      /* x - d1 q1, exact in float32 but for huge q */
                __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(q1 + k))));
                _mm256_storeu_ps(rest + k, _mm256_sub_ps(_mm256_loadu_ps(xg + k), _mm256_mul_ps(vd1, q)));
            }
            float d2 = ssq_int16(rest, G, q2);
            xs[2 * ((long)m * KG + g)] = d1;
            xs[2 * ((long)m * KG + g) + 1] = d2;
            xsum[(long)m * KG + g] = s;
        }
}

static void ssq_run(int isa, const SsqGeo *q, const uint8_t *W, int K, int N, int p0, int p1,
                    const int16_t *xq, const float *xs, const float *xsum, int M, float *y,
                    long ldy, const float *b) {
    typedef void (*Fn)(SSQ_ARGS);
    static const Fn fn[2][4] = {{ssq_q4_256, ssq_q8_256, ssq_k4_256, ssq_k6_256},
                                {ssq_q4_512, ssq_q8_512, ssq_k4_512, ssq_k6_512}};
    fn[isa == SSQ_ISA_AVX512][q->kind](SSQ_PASS);
}

static void ssq_run8(const SsqGeo *q, const uint8_t *W, int K, int N, int p0, int p1,
                     const int8_t *xb, const float *xs, const float *xsum, int M, float *y,
                     long ldy, const float *b) {
    if (q->kind == SSQ_Q4) ssq8_q4_256(SSQ8_PASS);
    else if (q->kind == SSQ_K4) ssq8_k4_256(SSQ8_PASS);
    else ssq8_k6_256(SSQ8_PASS);
}

/* True when a GEMM of `kind` runs the AVX2 byte path: 4- and 6-bit records where the CPU runs
 * AVX2 (AVX-512 VNNI keeps its int16 path, vpdpwssd: 32 products a µop already). */
static int ssq_bytes(int isa, int kind) {
    return isa == SSQ_ISA_AVX2 && kind != SSQ_Q8;
}

/* y[M, N] = x[M, K] @ W (+ b); W a blob of `kind` records as above (G % 8 == 0; Q4, K4: G <=
 * 128; Q8, K6: G <= 32; K4, K6: K % 256 == 0 and G divides 256). has_off: Q4 / Q8
 * records hold offsets. Returns 0, -1 when the activations' parts cannot be allocated, -2 for
 * a bad shape. */
static int ssq_gemm(const uint8_t *W, int kind, int has_off, int G, int K, int N, const float *x,
                    long ldx, int M, float *y, long ldy, const float *b, int n_threads) {
    int P = (N + SSQ_NB - 1) / SSQ_NB, KG = K / G, isa = ssq_isa();
    if (G % 8 || G > ((kind == SSQ_Q4 || kind == SSQ_K4) ? 128 : 32) ||
        K % G || ((kind == SSQ_K4 || kind == SSQ_K6) && (K % SSQ_SB || SSQ_SB % G)))
        return -2;
    SsqGeo q = ssq_geo(kind, has_off, G, K);
    const int bytes = ssq_bytes(isa, kind), np = bytes ? SSQ_XPARTS : 2;
    /* the parts: int8 [M, SSQ_XPARTS, K] (byte path) or int16 [M, 2, K]; scales [M, KG, np]; sums [M, KG] */
    void *xp = malloc((bytes ? SSQ_XPARTS : 4) * (size_t)M * (size_t)K + 64);
    float *xs = (float *)malloc(sizeof(float) * (np + 1) * (size_t)M * (size_t)KG + 64);
    if (!xp || !xs) { free(xp); free(xs); return -1; }
    float *xsum = xs + np * (size_t)M * KG;
    if (bytes) ssq_quantize_x8(x, ldx, M, K, G, (int8_t *)xp, xs, xsum);
    else ssq_quantize_x(x, ldx, M, K, G, (int16_t *)xp, xs, xsum);
    int nt = n_threads <= 1 || P < 2 * n_threads ? 1 : n_threads;
#ifdef _OPENMP
    #pragma omp parallel num_threads(nt) if (nt > 1)
#endif
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), tn = omp_get_num_threads();
#else
        int t = 0, tn = 1;
#endif
        int q0 = (int)((long)P * t / tn), q1 = (int)((long)P * (t + 1) / tn);
        if (bytes) ssq_run8(&q, W, K, N, q0, q1, (const int8_t *)xp, xs, xsum, M, y, ldy, b);
        else ssq_run(isa, &q, W, K, N, q0, q1, (const int16_t *)xp, xs, xsum, M, y, ldy, b);
    }
    free(xp);
    free(xs);
    return 0;
}

#endif
