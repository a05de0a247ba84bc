/* The CPU decode GEMMs on one Qwen2.5-Coder-1.5B decoder layer (qkv 2048x1536, o 1536x1536,
 * gate|up 17920x1536, down 1536x8960) plus its LM head (151936x1536), random weights, M = 1, 2,
 * 4, 8, 16 rows, the kernels alternated, best of 9:
 *   layer  q4  one-level 4-bit records, group 32 (scale + offset float32: 6 bits a weight)
 *          k4  GGUF Q4_K in its two levels (4.75 bits)          bf16  bf16 panels (gemm_avx2.h)
 *   head   q8  8-bit records, group 16 (scale float32: 10 bits)
 *          k6  GGUF Q6_K in its two levels (6.625 bits)          bf16  bf16 panels
 * Needs no Python, no model files: for a quiet machine where the real benchmark cannot run.
 *
 *   gcc -O3 -fopenmp -I swiftspec_mpi/packed/csrc benchmarks/bench_q4_kernel.c -o /tmp/bq -lm
 *   taskset -c 0,1 /tmp/bq 2 [isa]  # threads; isa 1 AVX2, 2 AVX-512 VNNI (default: the best)
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "gemm_avx2.h"
#include "gemm_q.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

typedef struct { int n, k, kind, g, off; long bytes; uint8_t *q; } Packed;

/* Random codes, sane scales (float32 tails, or small sub-scales and d for K4 / K6). */
static Packed make_packed(int n, int k, int kind, int g, int off) {
    SsqGeo geo = ssq_geo(kind, off, g, k);
    long P = (n + 15) / 16, nrec = (long)P * (k / g / geo.sbg);
    Packed m = {n, k, kind, g, geo.has_off, nrec * geo.S, 0};
    m.q = aligned_alloc(64, (m.bytes + 63) / 64 * 64);
    for (long i = 0; i < m.bytes; i++) m.q[i] = (uint8_t)rand();
    for (long r = 0; r < nrec; r++) {
        uint8_t *tail = m.q + r * geo.S + geo.sbg * geo.code_bytes;
        if (geo.sbg == 1) {
            float *sc = (float *)tail;
            for (int j = 0; j < 16 * (1 + geo.has_off); j++) sc[j] = 1e-3f * (1 + rand() % 100);
        } else {
            int8_t *sub = (int8_t *)tail;
            for (int j = 0; j < 16 * geo.sbg * (1 + geo.has_off); j++) sub[j] = (int8_t)(rand() % 64);
            float *d = (float *)(tail + 16L * geo.sbg * (1 + geo.has_off));
            for (int j = 0; j < 16 * (1 + geo.has_off); j++) d[j] = 1e-4f * (1 + rand() % 100);
        }
    }
    return m;
}

static uint16_t *make_bf16(int n, int k) {
    long wb = (long)(n + 15) / 16 * k * 16;
    uint16_t *b = aligned_alloc(64, wb * 2);
    for (long i = 0; i < wb; i++) b[i] = (uint16_t)(0x3c00 + rand() % 0x400);
    return b;
}

static const int LN[4] = {2048, 1536, 17920, 1536}, LK[4] = {1536, 1536, 1536, 8960};

int main(int argc, char **argv) {
    int nt = argc > 1 ? atoi(argv[1]) : 2;
    int isa = argc > 2 ? atoi(argv[2]) : 0;        /* 1 AVX2, 2 AVX-512 VNNI, 0 the CPU's best */
    if (ssq_set_isa(isa) != 0) { printf("this CPU cannot run isa %d\n", isa); return 1; }
    Packed q4[4], k4[4];
    uint16_t *lb[4];
    double bytes_q4 = 0, bytes_k4 = 0, bytes_b = 0;
    for (int i = 0; i < 4; i++) {
        q4[i] = make_packed(LN[i], LK[i], SSQ_Q4, 32, 1);
        k4[i] = make_packed(LN[i], LK[i], SSQ_K4, 32, 1);
        lb[i] = make_bf16(LN[i], LK[i]);
        bytes_q4 += q4[i].bytes, bytes_k4 += k4[i].bytes, bytes_b += 2.0 * LN[i] * LK[i];
    }
    Packed q8 = make_packed(151936, 1536, SSQ_Q8, 16, 0), k6 = make_packed(151936, 1536, SSQ_K6, 16, 0);
    uint16_t *hb = make_bf16(151936, 1536);
    float *x = malloc(sizeof(float) * 16 * 8960), *y = malloc(sizeof(float) * 16 * 151936);
    for (int i = 0; i < 16 * 8960; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    printf("threads %d, packed GEMM on %s; ms per call, best of 9\n", nt,
           ssq_isa() == SSQ_ISA_AVX512 ? "AVX-512 VNNI" : "AVX2");
    printf("| M | layer q4 | layer k4 | layer bf16 | bf16 / k4 | head q8 | head k6 | head bf16 | bf16 / k6 |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (int M = 1; M <= 16; M *= 2) {
        double best[6] = {1e9, 1e9, 1e9, 1e9, 1e9, 1e9};
        for (int rep = 0; rep < 9; rep++) {
            double t[7];
            t[0] = now();
            for (int i = 0; i < 4; i++)
                ssq_gemm(q4[i].q, SSQ_Q4, 1, 32, LK[i], LN[i], x, LK[i], M, y, LN[i], NULL, nt);
            t[1] = now();
            for (int i = 0; i < 4; i++)
                ssq_gemm(k4[i].q, SSQ_K4, 1, 32, LK[i], LN[i], x, LK[i], M, y, LN[i], NULL, nt);
            t[2] = now();
            for (int i = 0; i < 4; i++)
                ssm_gemm_packed(lb[i], 1, LK[i], LN[i], x, LK[i], M, y, LN[i], NULL, nt);
            t[3] = now();
            ssq_gemm(q8.q, SSQ_Q8, 0, 16, 1536, 151936, x, 1536, M, y, 151936, NULL, nt);
            t[4] = now();
            ssq_gemm(k6.q, SSQ_K6, 0, 16, 1536, 151936, x, 1536, M, y, 151936, NULL, nt);
            t[5] = now();
            ssm_gemm_packed(hb, 1, 1536, 151936, x, 1536, M, y, 151936, NULL, nt);
            t[6] = now();
            for (int j = 0; j < 6; j++) best[j] = t[j + 1] - t[j] < best[j] ? t[j + 1] - t[j] : best[j];
        }
        printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", M, 1e3 * best[0],
               1e3 * best[1], 1e3 * best[2], best[2] / best[1], 1e3 * best[3], 1e3 * best[4],
               1e3 * best[5], best[5] / best[4]);
    }
    printf("MB a layer: q4 %.1f, k4 %.1f, bf16 %.1f; head: q8 %.1f, k6 %.1f, bf16 %.1f\n",
           bytes_q4 / 1e6, bytes_k4 / 1e6, bytes_b / 1e6, q8.bytes / 1e6, k6.bytes / 1e6,
           2.0 * 151936 * 1536 / 1e6);
    return 0;
}
