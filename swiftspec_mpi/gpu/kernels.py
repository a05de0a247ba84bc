"""The GEMV kernel wrappers (cuda/gemm_allreduce.cu) and the one import point of the fused kernels.

Decode-sized products out = x @ w.T (M <= 16 rows): `gemm_rowparallel`, `gemm_swiglu` (gate|up
with the SwiGLU in the epilogue), `gemm_qkv_rope` (QKV with RoPE and the KV-cache write in the
epilogue) and `gemm_allreduce` (the product summed over a tensor-parallel group in the same
kernel, NCCL device API). Tree attention (gpu/tree_attention.py) and the launch layer's
`available` / `memcpy_async` are re-exported, so callers import `kernels` alone.

Call `available()` first; every other function assumes it returned True.
"""
from __future__ import annotations

import ctypes

import torch

from swiftspec_mpi.gpu.launch import (available, check_bf16, device_index, function, import_cupy,  # noqa: F401
                                      launch, launch_pdl, memcpy_async, ptr, sm_count)
from swiftspec_mpi.gpu.tree_attention import (MAX_TREE_TOKENS, AttnConfigV1, AttnConfigV2,  # noqa: F401
                                              AttnConfigV3, AttnConfigV4, tree_attention,
                                              tree_attention_cluster_config, tree_attention_config,
                                              tree_attention_configs, tree_attention_reference,
                                              tree_attention_workspace)

MAX_GEMM_ROWS = 16         # rows M of gemm_rowparallel / gemm_allreduce
# Must match cuda/gemm_allreduce.cu: (tiles per block T, 16-byte vectors per lane and chunk U,
# L2 prefetch hint bytes PF, register double buffering PIPE) of
# gemm_rowparallel_m{8,16}_t<T>_u<U>_p<PF>_s<PIPE>; the GEMM + all-reduce exists for fewer.
GEMM_VARIANTS = ((1, 4, 0, 0), (1, 4, 256, 1), (2, 4, 256, 1), (2, 4, 0, 1), (4, 4, 256, 1),
                 (4, 2, 256, 1), (2, 8, 256, 0), (1, 8, 256, 1))
GEMM_ALLREDUCE_VARIANTS = ((1, 4, 0, 0), (2, 4, 256, 1), (1, 8, 256, 1))
_GEMM_THREADS = 256          # must match cuda/gemm_allreduce.cu


def _gemm_checks(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None):
    check_bf16("x", x, 2)
    check_bf16("w", w, 2)
    M, K = x.shape
    N, Kw = w.shape
    if (Kw != K or not 1 <= M <= MAX_GEMM_ROWS or N % 8 or K % 8 or not w.is_contiguous() or x.stride(0) % 8
            or w.data_ptr() % 16 or x.data_ptr() % 16):
        raise ValueError(f"gemm: x {tuple(x.shape)} w {tuple(w.shape)}: need M <= {MAX_GEMM_ROWS}, "
                         "N and K multiples of 8, w contiguous, x row stride a multiple of 8, "
                         "16-byte aligned x and w")
    return M, N, K, _output(x, out, M, N)


def _output(x: torch.Tensor, out: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
    """`out` checked to be a [rows, cols] bfloat16 CUDA tensor, or a new one on x's device."""
    if out is None:
        return torch.empty((rows, cols), dtype=torch.bfloat16, device=x.device)
    check_bf16("out", out, 2)
    if tuple(out.shape) != (rows, cols):
        raise ValueError(f"out must be [{rows}, {cols}]")
    return out


def gemm_rowparallel_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """Config used by default for an [M, K] x [N, K]^T product: gemm_regs_config's (T, U, PF, PIPE)."""
    return gemm_regs_config(M, N, K)


def gemm_regs_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(T, U, PF, PIPE) of the register-pipelined kernel: n-tiles of 8 W rows per block, 16-byte W
    vectors per lane and k-chunk, L2 prefetch hint (0 or 256 bytes), register double buffering of
    the W loads. gemm_allreduce runs the same config (or one with the same U: the same summation
    order), so at TP = 1 it gives gemm_rowparallel's bits.

    The rule: 2 tiles per block, 4 vectors, the L2::256B prefetch hint and double buffering
    (the fastest variant for M = 1 and 8 on the Llama-3-8B shapes, benchmarks/bench_gemv_configs.py),
    except where N / 16 blocks would fill fewer than 3/4 of the GPU's two blocks per SM: then
    T = 1 doubles the blocks (Llama-3.2-1B's o_proj and down_proj, N = 2048). T does not change
    the summation order (U does), so the bits stay the same.
    """
    if -(-N // 16) < 1.5 * sm_count():
        return 1, 4, 256, 1
    return 2, 4, 256, 1


def gemm_rowparallel(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                     config: tuple | None = None, pdl: bool = False) -> torch.Tensor:
    """out = x @ w.T for decode-sized x (the local part of a row-parallel projection), no all-reduce.

    Args:
      x:      [M, K] bfloat16, M <= 16, last stride 1, row stride a multiple of 8.
      w:      [N, K] bfloat16 contiguous (nn.Linear weight layout), N % 8 == 0, K % 8 == 0,
              16-byte aligned.
      out:    [M, N] bfloat16, last stride 1; allocated if None.
      config: (T, U, PF, PIPE), one of GEMM_VARIANTS; default gemm_rowparallel_config(M, N, K).
              Variants with the same U give the same bits.
      pdl:    launch with programmatic dependent launch: the kernel starts streaming w while the
              previous kernel in the stream finishes (x is read, out written only after it
              completed). Only for a w that the previous kernel does not write (a weight).

    Returns:
      out: [M, N] bfloat16, fp32 accumulation.
    """
    M, N, K, out = _gemm_checks(x, w, out)
    config = gemm_rowparallel_config(M, N, K) if config is None else tuple(config)
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w), ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K)]
    if config not in GEMM_VARIANTS:
        raise ValueError(f"config {config} must be one of {GEMM_VARIANTS}")
    t, u, pf, pipe = config
    dev = device_index(x)
    f = function("gemm_allreduce", "", f"gemm_rowparallel_m{8 if M <= 8 else 16}_t{t}_u{u}_p{pf}_s{pipe}", dev)
    (launch_pdl if pdl else launch)(f, (-(-(N // 8) // t), 1, 1), _GEMM_THREADS, 0,
                                      torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def gemm_swiglu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                pdl: bool = False, config=None) -> torch.Tensor:
    """The gate|up projection with the SwiGLU fused into its epilogue, for decode-sized x:
    out = bf16(bf16(silu(g)) * u) with [g | u] = gemm_rowparallel(x, w), bit for bit what
    fused_ops.silu_mul(gemm_rowparallel(x, w)) gives, in one launch and without the [M, 2I]
    intermediate.

    Args:
      x:   [M, K] bfloat16, M <= 16, last stride 1, row stride a multiple of 8.
      w:   [2I, K] bfloat16 contiguous: the gate rows [0, I) then the up rows [I, 2I); I % 8 == 0.
      out: [M, I] bfloat16, last stride 1; allocated if None.
      pdl: programmatic dependent launch, as for gemm_rowparallel.
      config: None or "regs" (the register-pipelined kernel, T = 2, U = 4: the only one).

    Returns:
      out: [M, I] bfloat16.
    """
    check_bf16("x", x, 2)
    check_bf16("w", w, 2)
    M, K = x.shape
    I2, Kw = w.shape
    I = I2 // 2
    if Kw != K or I2 % 16 or not 1 <= M <= MAX_GEMM_ROWS or K % 8 or not w.is_contiguous() or x.stride(0) % 8:
        raise ValueError(f"gemm_swiglu: x {tuple(x.shape)} w {tuple(w.shape)}: need M <= {MAX_GEMM_ROWS}, "
                         "w rows 2I with I a multiple of 8, K a multiple of 8, w contiguous")
    out = _output(x, out, M, I)
    if config not in (None, "regs"):
        raise ValueError(f"gemm_swiglu config must be None or 'regs', not {config!r}")
    # T = 2 (a gate and an up tile per block) and U = 4, the plain kernel's summation order, or
    # the bits would differ from silu_mul(gemm_rowparallel(x, w)).
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w), ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(I), ctypes.c_int32(K)]
    dev = device_index(x)
    f = function("gemm_allreduce", "", f"gemm_swiglu_m{8 if M <= 8 else 16}_t2_u4_p256_s1", dev)
    (launch_pdl if pdl else launch)(f, (I // 8, 1, 1), _GEMM_THREADS, 0,
                                      torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def gemm_qkv_rope(x: torch.Tensor, w: torch.Tensor, qkv: torch.Tensor, positions: torch.Tensor,
                  write_slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, pdl: bool = False,
                  config=None) -> None:
    """The QKV projection with RoPE and the KV-cache write fused into its epilogue, in one launch:
    bit for bit `qkv = gemm_rowparallel(x, w)` followed by
    `fused_ops.rope_kv_write(qkv, positions, write_slots, cos, sin, k_cache, v_cache, n_heads)`,
    except that the k and v columns of qkv are not written (they only go to the cache).

    Args:
      x:           [M, K] bfloat16, M <= 16, last stride 1, row stride a multiple of 8.
      w:           [(n_heads + 2 Hkv) D, K] bfloat16 contiguous: q heads, k heads, v heads.
      qkv:         [M, (n_heads + 2 Hkv) D] bfloat16, last stride 1: its q part gets the rotated q.
      positions:   [M] int64 CUDA: RoPE positions (clamped to the tables).
      write_slots: [M] int64 CUDA: KV slots (a slot outside [0, S) is not written).
      cos, sin:    [P, D] bfloat16 contiguous rotate-half tables (Transformer.rope_cos / rope_sin).
      k_cache, v_cache: [S, Hkv, D] bfloat16, head stride D, last stride 1, same strides.
      n_heads:     local q heads. D % 16 == 0.
      pdl:         programmatic dependent launch, as for gemm_rowparallel.
      config:      None (the default: "regs-w4" where qkv_w4_pays, else "regs"), "regs" (8 warps
                   per block) or "regs-w4" (4 warps, 3 blocks per SM); both give the same bits.
    """
    check_bf16("x", x, 2)
    check_bf16("w", w, 2)
    check_bf16("qkv", qkv, 2)
    check_bf16("k_cache", k_cache, 3)
    M, K = x.shape
    S, Hkv, D = k_cache.shape
    cols = (n_heads + 2 * Hkv) * D
    if (tuple(w.shape) != (cols, K) or not w.is_contiguous() or tuple(qkv.shape) != (M, cols)
            or not 1 <= M <= MAX_GEMM_ROWS or K % 8 or D % 16 or x.stride(0) % 8):
        raise ValueError(f"gemm_qkv_rope: x {tuple(x.shape)} w {tuple(w.shape)} qkv {tuple(qkv.shape)} "
                         f"k_cache {tuple(k_cache.shape)} n_heads {n_heads}: need w [(H + 2 Hkv) D, K] "
                         f"contiguous, qkv [M, (H + 2 Hkv) D], M <= {MAX_GEMM_ROWS}, K % 8 == 0, D % 16 == 0")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(1) != D \
            or v_cache.dtype != torch.bfloat16:
        raise ValueError("k_cache / v_cache: same shape and strides, head stride D, bfloat16")
    for name, t in (("positions", positions), ("write_slots", write_slots)):
        if not (t.is_cuda and t.dtype == torch.int64 and t.dim() == 1 and t.shape[0] == M and t.stride(0) == 1):
            raise ValueError(f"{name} must be a contiguous [{M}] int64 CUDA tensor")
    for name, t in (("cos", cos), ("sin", sin)):
        if not (t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] == D and t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [P, {D}] bfloat16 CUDA tensor")
    grid = (n_heads + Hkv) * D // 16 + Hkv * D // 16
    if config is None:
        config = "regs-w4" if qkv_w4_pays(grid) else "regs"
    if config not in ("regs", "regs-w4"):
        raise ValueError(f"gemm_qkv_rope config must be None, 'regs' or 'regs-w4', not {config!r}")
    w4 = config == "regs-w4"                 # U = 4 either way: the same bits
    dev = device_index(x)
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w), ptr(qkv), ctypes.c_int64(qkv.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(K), ptr(positions), ptr(write_slots), ptr(cos), ptr(sin),
            ctypes.c_int32(cos.shape[0]), ptr(k_cache), ptr(v_cache), ctypes.c_int64(k_cache.stride(0)),
            ctypes.c_int32(S), ctypes.c_int32(n_heads), ctypes.c_int32(Hkv), ctypes.c_int32(D)]
    f = function("gemm_allreduce", "", f"gemm_qkv_rope_m{8 if M <= 8 else 16}_u4_p256_s1{'_w4' if w4 else ''}", dev)
    (launch_pdl if pdl else launch)(f, (grid, 1, 1), 128 if w4 else _GEMM_THREADS, 0,
                                      torch.cuda.current_stream(dev).cuda_stream, args)


def qkv_w4_pays(blocks: int) -> bool:
    """Whether gemm_qkv_rope's default takes the 4-warp kernel ("regs-w4": 3 blocks per SM, same
    bits) for `blocks` blocks: where it needs fewer waves than the 8-warp kernel (2 per SM) and
    the latter at most 2 (with many waves the last one's waste matters little) -- the Llama-3-8B
    QKV, 384 blocks: one wave of 396 instead of 1.45 of 264 on an H200."""
    sm = sm_count()
    regs_waves = -(-blocks // (2 * sm))
    return -(-blocks // (3 * sm)) < regs_waves <= 2


def gemm_allreduce(x: torch.Tensor, w: torch.Tensor, ar, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = all_reduce_sum(x @ w.T) over the ranks of `ar`, in one kernel (row-parallel o_proj /
    down_proj of tensor parallelism). Collective: every rank calls it with the same shapes.

    Args:
      x:   [M, K_local] bfloat16, M <= 16 (this rank's slice of the input features).
      w:   [N, K_local] bfloat16 contiguous (this rank's column slice of the weight).
      ar:  nccl_shim.DeviceAllReduce of this rank's communicator, created with max_n >= N.
      out: [M, N] bfloat16; allocated if None. Every rank gets the same bits.

    Returns:
      out: [M, N] bfloat16, the fp32 sum over ranks of the fp32 partial products, rounded once.
    """
    M, N, K, out = _gemm_checks(x, w, out)
    if N > ar.max_n:
        raise ValueError(f"N={N} exceeds the DeviceAllReduce window (max_n={ar.max_n})")
    config = gemm_regs_config(M, N, K)     # U = 4: gemm_rowparallel's bits
    # the plain kernel's config, else an instantiated one with the same U (the same bits)
    same_u = sorted((c for c in GEMM_ALLREDUCE_VARIANTS if c[1] == config[1]),
                    key=lambda c: c != (2, 4, 256, 1))           # the sweep's best first
    if config not in GEMM_ALLREDUCE_VARIANTS and not same_u:
        raise RuntimeError(f"no GEMM + all-reduce kernel with U={config[1]} (config {config})")
    t, u, pf, pipe = config if config in GEMM_ALLREDUCE_VARIANTS else same_u[0]
    dev = device_index(x)
    f = function("gemm_allreduce", "nccl", f"gemm_allreduce_m{8 if M <= 8 else 16}_t{t}_u{u}_p{pf}_s{pipe}", dev)
    # Always the full persistent grid: block b owns tile groups b, b + n_ctas, ... on every call,
    # which the double-buffered window relies on (a block with no tile still meets its barrier).
    grid = ar.n_ctas
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w), ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K),
            ctypes.c_uint64(ar.window), ptr(ar.dev_comm), ptr(ar.seq)]
    launch(f, (grid, 1, 1), _GEMM_THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def devcomm_sizeof(device: int | None = None) -> int:
    """sizeof(ncclDevComm) as the kernels were compiled (checked against the shim's probe)."""
    dev = torch.cuda.current_device() if device is None else device
    f = function("gemm_allreduce", "nccl", "nccl_devcomm_sizeof", dev)
    buf = torch.zeros(1, dtype=torch.int64, device=f"cuda:{dev}")
    launch(f, (1, 1, 1), 1, 0, torch.cuda.current_stream(dev).cuda_stream, [ptr(buf)])
    return int(buf.item())
