/* The two CPU decode GEMMs on one Qwen2.5-Coder-1.5B decoder layer (qkv 2048x1536, o 1536x1536,
 * gate|up 17920x1536, down 1536x8960) plus its LM head (151936x1536): packed 4-bit records
 * (gemm_q.h, group 32 as GGUF Q4_K; head 8-bit group 16 as Q6_K) against bf16 panels
 * (gemm_avx2.h), random weights, M = 1, 2, 4, 8, 16 rows, the kernels alternated, best of 9.
 * Needs no Python, no model files: for a quiet machine where the real benchmark cannot run.
 *
 *   gcc -O3 -fopenmp -I swiftspec_mpi/model/csrc benchmarks/bench_q4_kernel.c -o /tmp/bq -lm
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

typedef struct { int n, k, bits, g, off; uint8_t *q; uint16_t *b; } Mat;

static Mat make(int n, int k, int bits, int g, int off) {
    Mat m = {n, k, bits, g, off, 0, 0};
    long P = (n + 15) / 16, S = (long)g * (bits == 4 ? 8 : 16) + 64 * (1 + off);
    long qb = P * (k / g) * S;
    m.q = aligned_alloc(64, (qb + 63) / 64 * 64);
    for (long i = 0; i < qb; i++) m.q[i] = (uint8_t)rand();
    for (long r = 0; r < P * (k / g); r++) {          /* sane float scales and offsets */
        float *sc = (float *)(m.q + r * S + (long)g * (bits == 4 ? 8 : 16));
        for (int j = 0; j < 16 * (1 + off); j++) sc[j] = 1e-3f * (1 + rand() % 100);
    }
    long wb = P * (long)k * 16;
    m.b = aligned_alloc(64, wb * 2);
    for (long i = 0; i < wb; i++) m.b[i] = (uint16_t)(0x3c00 + rand() % 0x400);
    return m;
}

int main(int argc, char **argv) {
    int nt = argc > 1 ? atoi(argv[1]) : 2;
    Mat layer[4] = {make(2048, 1536, 4, 32, 1), make(1536, 1536, 4, 32, 1),
                    make(17920, 1536, 4, 32, 1), make(1536, 8960, 4, 32, 1)};
    Mat head = make(151936, 1536, 8, 16, 0);
    float *x = malloc(sizeof(float) * 16 * 8960), *y = malloc(sizeof(float) * 16 * 151936);
    for (int i = 0; i < 16 * 8960; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    int isa = argc > 2 ? atoi(argv[2]) : 0;        /* 1 AVX2, 2 AVX-512 VNNI, 0 the CPU's best */
    if (ssq_set_isa(isa) != 0) { printf("this CPU cannot run isa %d\n", isa); return 1; }
    printf("threads %d, packed GEMM on %s; ms per call, best of 9\n", nt,
           ssq_isa() == SSQ_ISA_AVX512 ? "AVX-512 VNNI" : "AVX2");
    printf("| M | layer 4-bit | layer bf16 | bf16/4-bit | head 8-bit | head bf16 | bf16/8-bit |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int M = 1; M <= 16; M *= 2) {
        double b4 = 1e9, bb = 1e9, h8 = 1e9, hb = 1e9;
        for (int rep = 0; rep < 9; rep++) {
            double t = now();
            for (int i = 0; i < 4; i++)
                ssq_gemm(layer[i].q, SSQ_Q4, 1, 32, layer[i].k, layer[i].n, x, layer[i].k, M, y,
                         layer[i].n, NULL, nt);
            double t1 = now();
            for (int i = 0; i < 4; i++)
                ssm_gemm_packed(layer[i].b, 1, layer[i].k, layer[i].n, x, layer[i].k, M, y,
                                layer[i].n, NULL, nt);
            double t2 = now();
            ssq_gemm(head.q, SSQ_Q8, 0, 16, head.k, head.n, x, head.k, M, y, head.n, NULL, nt);
            double t3 = now();
            ssm_gemm_packed(head.b, 1, head.k, head.n, x, head.k, M, y, head.n, NULL, nt);
            double t4 = now();
            b4 = t1 - t < b4 ? t1 - t : b4;
            bb = t2 - t1 < bb ? t2 - t1 : bb;
            h8 = t3 - t2 < h8 ? t3 - t2 : h8;
            hb = t4 - t3 < hb ? t4 - t3 : hb;
        }
        printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", M, 1e3 * b4, 1e3 * bb,
               bb / b4, 1e3 * h8, 1e3 * hb, hb / h8);
    }
    /* one decode step of the 28-layer model (M = 1), the weights' bytes per step */
    double bytes4 = 0, bytesb = 0;
    for (int i = 0; i < 4; i++) {
        bytes4 += (double)((layer[i].n + 15) / 16) * (layer[i].k / 32) * (32 * 8 + 128);
        bytesb += 2.0 * layer[i].n * layer[i].k;
    }
    printf("bytes per layer: 4-bit %.1f MB, bf16 %.1f MB\n", bytes4 / 1e6, bytesb / 1e6);
    return 0;
}
