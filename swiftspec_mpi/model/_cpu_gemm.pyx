# cython: language_level=3
"""Thin Cython binding of csrc/gemm_avx2.h (the packed-weight CPU GEMM); see
swiftspec_mpi/cpu_linear.py for the tensor-level API, shapes and layout."""

cdef extern from "gemm_avx2.h":
    int ssm_cpu_has_avx2()
    void ssm_gemm_packed(const void *W, int is_bf16, int K, int N, const float *x, long ldx,
                         int M, float *y, long ldy, const float *b, int n_threads) nogil


def has_avx2() -> bool:
    """True when this CPU runs AVX2 + FMA (the kernel's instruction set)."""
    return bool(ssm_cpu_has_avx2())


def gemm_packed(size_t w, bint is_bf16, int K, int N, size_t x, long ldx, int M, size_t y,
                long ldy, size_t b, int n_threads):
    """y[M, N] = x[M, K] @ W (+ b) on raw addresses (see cpu_linear.linear_packed)."""
    with nogil:
        ssm_gemm_packed(<const void *>w, is_bf16, K, N, <const float *>x, ldx, M,
                        <float *>y, ldy, <const float *>b, n_threads)
