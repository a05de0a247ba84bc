# cython: language_level=3
"""Thin Cython binding of csrc/gemm_avx2.h (float32/bf16 panels) and csrc/gemm_q.h (packed
4-/8-bit records), the CPU decode GEMMs; see packed/cpu_linear.py and packed/cpu_quant.py for the
tensor-level API, shapes and layouts."""

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


cdef extern from "gemm_q.h":
    int ssq_gemm(const unsigned char *W, int kind, int has_off, int G, int K, int N,
                 const float *x, long ldx, int M, float *y, long ldy, const float *b,
                 int n_threads) nogil
    int ssq_isa()
    int ssq_set_isa(int isa)


_QUANT_ISAS = {"avx2": 1, "avx512vnni": 2}


def quant_isa() -> str:
    """The instruction set the packed GEMM runs: 'avx512vnni' where this CPU has it, else 'avx2'."""
    return {v: k for k, v in _QUANT_ISAS.items()}[ssq_isa()]


def set_quant_isa(name: str | None) -> None:
    """Run the packed GEMM with `name` ('avx2', 'avx512vnni'; None: the best this CPU has).
    Results are bit-identical across them; this exists to check that and to time each."""
    if ssq_set_isa(0 if name is None else _QUANT_ISAS.get(name, -1)) != 0:
        raise ValueError(f"this CPU cannot run the packed GEMM with {name!r}")


def gemm_quant(size_t w, int kind, bint has_offset, int group, int K, int N, size_t x, long ldx,
               int M, size_t y, long ldy, size_t b, int n_threads):
    """y[M, N] = x[M, K] @ W (+ b), W a blob of packed records of `kind` (SSQ_Q4 0, SSQ_Q8 1,
    SSQ_K4 2, SSQ_K6 3; see cpu_quant.QuantPanels)."""
    cdef int rc
    with nogil:
        rc = ssq_gemm(<const unsigned char *>w, kind, has_offset, group, K, N,
                      <const float *>x, ldx, M, <float *>y, ldy, <const float *>b, n_threads)
    if rc == -2:
        raise ValueError(f"packed GEMM: no records of kind {kind} with group {group} for K = {K}")
    if rc != 0:
        raise MemoryError("packed GEMM: cannot allocate the group sums of x")


from libc.stdint cimport int64_t


cdef extern from "layer_ops.h":
    void sso_add_rmsnorm(float *x, long ldx, const float *a, long lda, const float *w, float eps,
                         float *out, long ldo, int M, int H) nogil
    int sso_rope_kv(float *qkv, long ldqkv, const int64_t *pos, const float *cos_t,
                    const float *sin_t, long P, int M, int nh, int nkv, int hd, float *kc,
                    float *vc, long start) nogil
    int sso_attention(const float *q, long ldq, int M, int nh, int nkv, int hd, const float *kc,
                      const float *vc, int S, const unsigned char *mask, long ldm, float *out,
                      long ldo, float scale, int n_threads) nogil
    void sso_silu_mul(const float *gu, long ldg, int M, int I, float *out, long ldo) nogil


def add_rmsnorm(size_t x, long ldx, size_t a, long lda, size_t w, float eps, size_t out, long ldo,
                int M, int H):
    """x += a (a = 0: none); out = rmsnorm(x) * w, on raw float32 addresses (packed/cpu_ops.py)."""
    with nogil:
        sso_add_rmsnorm(<float *>x, ldx, <const float *>a, lda, <const float *>w, eps,
                        <float *>out, ldo, M, H)


def rope_kv(size_t qkv, long ldqkv, size_t pos, size_t cos_t, size_t sin_t, long P, int M,
            int nh, int nkv, int hd, size_t kc, size_t vc, long start):
    """RoPE on qkv's q and k heads in place, k and v into the cache (packed/cpu_ops.py)."""
    cdef int rc
    with nogil:
        rc = sso_rope_kv(<float *>qkv, ldqkv, <const int64_t *>pos, <const float *>cos_t,
                         <const float *>sin_t, P, M, nh, nkv, hd, <float *>kc, <float *>vc, start)
    if rc != 0:
        raise ValueError(f"RoPE: a position lies outside the tables' {P} rows")


def attention(size_t q, long ldq, int M, int nh, int nkv, int hd, size_t kc, size_t vc, int S,
              size_t mask, long ldm, size_t out, long ldo, float scale, int n_threads):
    """Masked grouped-query attention of M rows over S slots (packed/cpu_ops.py)."""
    cdef int rc
    with nogil:
        rc = sso_attention(<const float *>q, ldq, M, nh, nkv, hd, <const float *>kc,
                           <const float *>vc, S, <const unsigned char *>mask, ldm, <float *>out,
                           ldo, scale, n_threads)
    if rc != 0:
        raise MemoryError("CPU attention: cannot allocate its scratch")


def silu_mul(size_t gu, long ldg, int M, int I, size_t out, long ldo):
    """out = silu(gu[:, :I]) * gu[:, I:] (packed/cpu_ops.py)."""
    with nogil:
        sso_silu_mul(<const float *>gu, ldg, M, I, <float *>out, ldo)
