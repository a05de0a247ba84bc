"""Fused elementwise kernels of the GPU decode step (cuda/fused_ops.cu), launched on torch tensors.

Three kernels, each replacing several small torch launches of `Transformer._layers`:

  add_rmsnorm    x += a (optional); out = rms_norm(x) * w              (add + rms_norm)
  rope_kv_write  RoPE on q (in place) and k, k and v into the KV slots  (mul, roll, addcmul, 2 index_copy_)
  silu_mul       out = silu(gate) * up of the fused gate|up output      (silu, mul)

bf16 only, fp32 arithmetic, the same bf16 roundings as the torch ops they replace (add_rmsnorm
rounds its output once). They run on `torch.cuda.current_stream()`, allocate nothing when `out`
is given, never sync with the host, and read positions and KV slots on the device, so a CUDA graph
of `Transformer.forward_graphable` can hold them. Loaded and launched through the helpers of
`swiftspec_mpi.gpu.kernels` (same CuPy nvcc module cache).

`enabled()` says whether `forward_graphable` uses them: the kernels are available
(`kernels.available()`) and they are not switched off, either by the environment variable
SWIFTSPEC_FUSED_OPS=0 (read at import) or by `set_enabled(False)` (benchmarks compare both in
one process; a CUDA graph keeps whatever path was active when it was captured).

The projections (switch SWIFTSPEC_FUSED_GEMM, or `set_gemm_mode`): "pdl" (default) runs every
bias-free projection on the GEMV kernels (gpu/kernels.py) and launches every kernel of the layer
with programmatic dependent launch (PDL), so each launch, and the first weight loads of each
projection, overlap the kernel before it. It sums in another order than cuBLAS, so its logits
are not cuBLAS's bits, but they are as close to a float32 model
(tests/test_fused_ops_gpu.py::test_pdl_mode_is_as_accurate_as_cublas). "cublas" keeps every
GEMM on cuBLAS (F.linear): the fused path then gives the same bits as the torch ops path.
Random-weight models amplify the summation-order differences through depth (logits 2-4 % apart
at 16-32 layers; a near-tie argmax can flip).
"""
from __future__ import annotations

import ctypes

import torch

from swiftspec_mpi.core import switches
from swiftspec_mpi.gpu.kernels import MAX_GEMM_ROWS
from swiftspec_mpi.gpu.launch import available, function, launch_pdl, ptr
from swiftspec_mpi.gpu.launch import launch as launch_plain

_SOURCE = "fused_ops"
_RMS_MAX_THREADS = 512      # must not exceed __launch_bounds__ of add_rmsnorm_v* in fused_ops.cu
_EW_THREADS = 256           # rope_kv_write_v*, silu_mul_v* (__launch_bounds__(256))
_EW_MAX_BLOCKS = 4096       # grid-stride loops: more work than this just loops
_enabled = switches.flag("SWIFTSPEC_FUSED_OPS")
GEMM_MODES = switches.SWITCHES["SWIFTSPEC_FUSED_GEMM"].choices      # ("pdl", "cublas")
_gemm_mode = switches.choice("SWIFTSPEC_FUSED_GEMM")


def set_gemm_mode(mode: str) -> None:
    """"pdl" (default): every projection that the kernel takes (no bias, [out, in] contiguous
    weights, <= kernels.MAX_GEMM_ROWS tokens; see `pdl_gemm_ok`) on our GEMV kernels, and every
    kernel of the layer launched with programmatic dependent launch, so each kernel's launch and
    the next projection's first weight loads overlap the kernel before it; "cublas": always
    F.linear."""
    global _gemm_mode
    if mode not in GEMM_MODES:
        raise ValueError(f"gemm mode must be one of {GEMM_MODES}, not {mode!r}")
    _gemm_mode = mode


def gemm_mode() -> str:
    """The projections' mode: "pdl" or "cublas" (see set_gemm_mode)."""
    return _gemm_mode


def pdl_gemm_ok(weights: list, m: int) -> bool:
    """Whether the "pdl" mode can run `kernels.gemm_rowparallel(x [m, K], w)` for every w: [N, K]
    bfloat16 contiguous CUDA tensors (not 4-bit weights), N and K multiples of 8, 16-byte
    aligned, m <= MAX_GEMM_ROWS."""
    if not weights or not 1 <= m <= MAX_GEMM_ROWS:
        return False
    return all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_cuda and w.dtype == torch.bfloat16
               and w.is_contiguous() and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0
               and w.data_ptr() % 16 == 0 for w in weights)


def set_enabled(flag: bool) -> None:
    """Switch the fused path of `Transformer.forward_graphable` on or off (process-wide)."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    """True when forward_graphable should use these kernels: not switched off and available."""
    return _enabled and available()


def launch(pdl: bool, f: int, grid: tuple, block: int, smem: int, stream: int, args: list) -> None:
    """Launch a fused_ops kernel; with `pdl` through programmatic dependent launch: the launch
    overlaps the tail of the previous kernel in the stream, the kernel waits for that kernel
    (griddepcontrol.wait) before reading anything and then lets the next kernel launch. Same
    results either way; in a CUDA graph the dependency becomes a programmatic edge."""
    (launch_pdl if pdl else launch_plain)(f, grid, block, smem, stream, args)


def _dev(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _is_bf16_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.bfloat16 and t.stride(-1) == 1


def _aligned(*ts: torch.Tensor) -> bool:
    """16-byte aligned bases and row strides that are multiples of 8 elements (V = 8 path)."""
    return all(t.data_ptr() % 16 == 0 and (t.dim() < 2 or t.stride(0) % 8 == 0) for t in ts)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _rows_check(name: str, t: torch.Tensor, n: int, cols: int) -> None:
    _need(_is_bf16_cuda(t) and t.dim() == 2 and tuple(t.shape) == (n, cols),
          f"{name} must be a [{n}, {cols}] bfloat16 CUDA tensor with last stride 1, "
          f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")


def add_rmsnorm(x: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Residual add + RMSNorm in one launch: x += a (in place, rounded to bf16 like x.add_(a)),
    then out = bf16(x * rsqrt(mean(x^2, -1) + eps) * weight) in fp32.

    Args:
      x:      [N, H] bfloat16 CUDA, last stride 1 (any row stride): the residual stream, updated
              in place when `a` is given.
      a:      [N, H] bfloat16 (last stride 1) or None for a plain RMSNorm of x (x untouched).
      weight: [H] bfloat16 contiguous.
      eps:    the norm's epsilon.
      out:    [N, H] bfloat16 (last stride 1), written in full; allocated if None. Must not
              overlap x or a.
      pdl:    launch with programmatic dependent launch (see `launch`).

    Returns:
      out: [N, H] bfloat16.
    """
    _need(_is_bf16_cuda(x) and x.dim() == 2, f"x must be a 2-d bfloat16 CUDA tensor, got {x.dtype} {tuple(x.shape)}")
    N, H = x.shape
    if a is not None:
        _rows_check("a", a, N, H)
    _need(_is_bf16_cuda(weight) and weight.dim() == 1 and weight.shape[0] == H,
          f"weight must be a contiguous [{H}] bfloat16 CUDA tensor, got {tuple(weight.shape)}")
    if out is None:
        out = torch.empty((N, H), dtype=torch.bfloat16, device=x.device)
    else:
        _rows_check("out", out, N, H)
    if N == 0:
        return out
    ts = [x, weight, out] + ([a] if a is not None else [])
    V = 8 if H % 8 == 0 and _aligned(*ts) else 1
    chunks = H // V
    threads = min(_RMS_MAX_THREADS, max(32, -(-chunks // 32) * 32))
    dev = _dev(x)
    f = function(_SOURCE, "", f"add_rmsnorm_v{V}", dev)
    args = [ptr(x), ctypes.c_int64(x.stride(0)),
            ctypes.c_uint64(a.data_ptr() if a is not None else 0),
            ctypes.c_int64(a.stride(0) if a is not None else 0),
            ptr(weight), ptr(out), ctypes.c_int64(out.stride(0)), ctypes.c_int32(H), ctypes.c_float(eps)]
    launch(pdl, f, (N, 1, 1), threads, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_heads: int, pdl: bool = False) -> None:
    """RoPE on the q and k heads of the fused QKV output + the KV-cache write, in one launch.

    With half = D / 2 and p = positions[t], every q/k head vector x of token t becomes
        y[j] = bf16(bf16(x[j] * cos[p, j]) + x[(j + half) % D] * sin[p, j])
    i.e. torch.addcmul(x * cos, roll(x, half, -1), sin) with the model's rotate-half tables
    (`Transformer.rope_cos` / `rope_sin`, the sign of rotate_half folded into sin).

    Args:
      qkv:         [N, (n_heads + 2 * Hkv) * D] bfloat16 CUDA, last stride 1: q heads, then k
                   heads, then v heads of each token (bias already added). The q part is rotated
                   in place (so qkv[:, :n_heads*D].view(N, n_heads, D) is the attention's q);
                   the k and v parts are read only.
      positions:   [N] int64 CUDA: RoPE position of each token (clamped to the tables' rows).
      write_slots: [N] int64 CUDA: KV slot of each token (a slot outside [0, S) is not written).
      cos, sin:    [P, D] bfloat16 CUDA contiguous: the RoPE tables.
      k_cache:     [S, Hkv, D] bfloat16 CUDA (one layer), head stride D, last stride 1:
                   k_cache[write_slots[t]] = rotated k of token t.
      v_cache:     [S, Hkv, D] bfloat16, same shape and strides: v_cache[write_slots[t]] = v of t.
      n_heads:     local query heads (H). D must be even.
      pdl:         launch with programmatic dependent launch (see `launch`).

    Returns None; writes qkv's q part, k_cache and v_cache.
    """
    _need(_is_bf16_cuda(qkv) and qkv.dim() == 2, f"qkv must be a 2-d bfloat16 CUDA tensor, got {tuple(qkv.shape)}")
    _need(_is_bf16_cuda(k_cache) and k_cache.dim() == 3, "k_cache must be a [S, Hkv, D] bfloat16 CUDA tensor")
    S, Hkv, D = k_cache.shape
    _need(D % 2 == 0 and k_cache.stride(1) == D, f"k_cache: need an even head_dim and head stride D, got {k_cache.stride()}")
    _need(v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride() and _is_bf16_cuda(v_cache),
          "v_cache must have k_cache's shape, strides and dtype")
    N = qkv.shape[0]
    _need(qkv.shape[1] == (n_heads + 2 * Hkv) * D,
          f"qkv has {qkv.shape[1]} columns, expected (n_heads {n_heads} + 2 * {Hkv}) * {D}")
    for name, t in (("positions", positions), ("write_slots", write_slots)):
        _need(t.is_cuda and t.dtype == torch.int64 and t.dim() == 1 and t.shape[0] == N and t.stride(0) == 1,
              f"{name} must be a contiguous [{N}] int64 CUDA tensor, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        _need(_is_bf16_cuda(t) and t.dim() == 2 and t.shape[1] == D and t.is_contiguous(),
              f"{name} must be a contiguous [P, {D}] bfloat16 CUDA tensor, got {tuple(t.shape)}")
    _need(cos.shape == sin.shape, "cos and sin must have the same shape")
    if N == 0:
        return
    half = D // 2
    V = 8 if half % 8 == 0 and k_cache.stride(0) % 8 == 0 and _aligned(qkv, cos, sin, k_cache, v_cache) else 1
    units = (n_heads + Hkv) * (half // V) + Hkv * (D // V)
    total = N * units
    blocks = min(-(-total // _EW_THREADS), _EW_MAX_BLOCKS)
    dev = _dev(qkv)
    f = function(_SOURCE, "", f"rope_kv_write_v{V}", dev)
    args = [ptr(qkv), ctypes.c_int64(qkv.stride(0)), ptr(positions), ptr(write_slots),
            ptr(cos), ptr(sin), ctypes.c_int32(cos.shape[0]), ptr(k_cache), ptr(v_cache),
            ctypes.c_int64(k_cache.stride(0)), ctypes.c_int32(S), ctypes.c_int32(N),
            ctypes.c_int32(n_heads), ctypes.c_int32(Hkv), ctypes.c_int32(D)]
    launch(pdl, f, (blocks, 1, 1), _EW_THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)


def silu_mul(gu: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of the fused gate|up GEMM output, in one launch:
    out = bf16(bf16(silu(gu[:, :I])) * gu[:, I:]) (the roundings of F.silu then mul_).

    Args:
      gu:  [N, 2 * I] bfloat16 CUDA, last stride 1 (any row stride): gate columns then up columns.
      out: [N, I] bfloat16 (last stride 1), written in full; allocated if None.
      pdl: launch with programmatic dependent launch (see `launch`).

    Returns:
      out: [N, I] bfloat16.
    """
    _need(_is_bf16_cuda(gu) and gu.dim() == 2 and gu.shape[1] % 2 == 0,
          f"gu must be a [N, 2*I] bfloat16 CUDA tensor with last stride 1, got {tuple(gu.shape)}")
    N, I2 = gu.shape
    I = I2 // 2
    if out is None:
        out = torch.empty((N, I), dtype=torch.bfloat16, device=gu.device)
    else:
        _rows_check("out", out, N, I)
    if N == 0 or I == 0:
        return out
    V = 8 if I % 8 == 0 and _aligned(gu, out) else 1
    total = N * (I // V)
    blocks = min(-(-total // _EW_THREADS), _EW_MAX_BLOCKS)
    dev = _dev(gu)
    f = function(_SOURCE, "", f"silu_mul_v{V}", dev)
    args = [ptr(gu), ctypes.c_int64(gu.stride(0)), ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(N), ctypes.c_int32(I)]
    launch(pdl, f, (blocks, 1, 1), _EW_THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


_TOPK_KS = (1, 8, 16, 32)        # logits_topk_{part,merge}_k<K> in fused_ops.cu
TOPK_MAX = _TOPK_KS[-1]
_TOPK_THREADS = 256              # fused_ops::TOPK_THREADS
_TOPK_CHUNK = 8192               # fused_ops::TOPK_CHUNK: columns of one part's single pass
_TOPK_MAX_PARTS = 32             # fused_ops::TOPK_MAX_PARTS


def topk_ok(logits: torch.Tensor, k: int) -> bool:
    """Whether `logits_topk(logits, k)` takes these logits: 2-d float32 CUDA, last stride 1, a
    positive number of columns below 2^31, 1 <= k <= TOPK_MAX and <= the columns, the fused
    kernels on and buildable."""
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1
            and 1 <= k <= min(TOPK_MAX, logits.shape[1]) and logits.shape[1] < 2 ** 31
            and enabled() and available())


def logits_topk(logits: torch.Tensor, k: int, logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row and (with `logprobs`) their log-softmax, reading the
    logits once (cuda/fused_ops.cu, logits_topk: P <= 32 blocks per row of 8192+ columns each,
    then one warp per row merging their lists): what the engine reads of a step.

    Args:
      logits:   [N, V] float32 CUDA, last stride 1 (any row stride); `topk_ok` must hold.
      k:        1 <= k <= TOPK_MAX.
      logprobs: values as log_softmax(logits) (x - logsumexp of the row), else the logits.

    Returns:
      ids:  [N, k] int64, each row's indices by value, largest first; ties: the lower index first
            (for k = 1 torch.argmax's index).
      vals: [N, k] float32, their log-probs (or logits). Equal to torch.topk(torch.log_softmax(
            logits, -1), k) up to the fp32 rounding of the log-sum-exp (a few ulps).
    """
    _need(topk_ok(logits, k), f"logits_topk: logits {logits.dtype} {tuple(logits.shape)} on "
                              f"{logits.device}, k={k}: need 2-d float32 CUDA with last stride 1, "
                              f"1 <= k <= {TOPK_MAX} and k <= V")
    N, V = logits.shape
    ids = torch.empty((N, k), dtype=torch.int64, device=logits.device)
    vals = torch.empty((N, k), dtype=torch.float32, device=logits.device)
    if N == 0:
        return ids, vals
    K = next(kk for kk in _TOPK_KS if kk >= k)
    chunk = max(_TOPK_CHUNK, -(-V // (_TOPK_MAX_PARTS * _TOPK_CHUNK)) * _TOPK_CHUNK)
    P = -(-V // chunk)
    dev = _dev(logits)
    pv = torch.empty((N * P * K + 2 * N * P,), dtype=torch.float32, device=logits.device)  # values, then m, s
    pi = torch.empty((N * P * K,), dtype=torch.int32, device=logits.device)
    pm, ps = pv[N * P * K:N * P * (K + 1)], pv[N * P * (K + 1):]
    stream = torch.cuda.current_stream(dev).cuda_stream
    f = function(_SOURCE, "", f"logits_topk_part_k{K}_l{1 if logprobs else 0}", dev)
    launch(False, f, (P, N, 1), _TOPK_THREADS, 0, stream,
           [ptr(logits), ctypes.c_int64(logits.stride(0)), ctypes.c_int32(V), ctypes.c_int32(chunk),
            ctypes.c_int32(k), ptr(pv), ptr(pi), ptr(pm), ptr(ps)])
    f = function(_SOURCE, "", f"logits_topk_merge_k{K}", dev)
    launch(False, f, (N, 1, 1), 32, 0, stream,
           [ptr(pv), ptr(pi), ptr(pm), ptr(ps), ctypes.c_int32(P), ctypes.c_int32(k),
            ctypes.c_int32(1 if logprobs else 0), ptr(ids), ctypes.c_int64(k), ptr(vals), ctypes.c_int64(k)])
    return ids, vals


# ------------------------------------------------------------------ torch references (tests)
def add_rmsnorm_reference(x: torch.Tensor, a: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(new x, out) as `Transformer._layers` computes them: x.add_(a) in bf16, then F.rms_norm.
    Does not modify its inputs."""
    x = x.clone()
    if a is not None:
        x.add_(a)
    return x, torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_reference(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as `Transformer._layers` does it: qk [N, heads, D] -> rotated [N, heads, D]."""
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin.index_select(0, positions).unsqueeze(1)
    return torch.addcmul(qk * c, torch.roll(qk, qk.shape[-1] // 2, -1), s)


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """F.silu(gate).mul_(up) as `Transformer._layers` does it: gu [N, 2I] -> [N, I]."""
    I = gu.shape[1] // 2
    return torch.nn.functional.silu(gu[:, :I]).mul_(gu[:, I:])
