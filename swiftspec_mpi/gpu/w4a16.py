"""4-bit weights on the GPU: the W4A16 kernels of cuda/w4a16.cu on torch tensors, and their weight kind.

`W4A16Weight` is one linear layer's packed 4-bit weight in the kernels' device layout, repacked at
load time from the loaders' `swiftspec_mpi.packed.int4.PackedInt4` (W = q * scale + offset per
group of 32, 64 or 128 inputs):

    qweight  uint8 [N, K / 2]    the codes, tile-major: the 16 rows of a tile and 128 k's of a chunk
                                 are 1 KiB in one piece (16 rows x 64 bytes), permuted inside each
                                 row's 64 bytes so that lane q of a warp reads one 16-byte vector
                                 per row (see the layout comment of cuda/w4a16.cu; `repack_codes` /
                                 `unpack_device`)
    so       int32 [N, K / g]    bf16 scale (low half) and bf16 offset (high half) per group, tile-
                                 major like the codes: a tile's 16 rows x 128 / g words per chunk

Only whole tiles are contiguous: rows [r, e) of the dense weight are bytes [r K / 2, e K / 2) of
qweight when r and e are multiples of 16 (so `cat_rows` concatenates).

K must be a multiple of 128 and N of 16. Scale and offset are held as bf16; the GEMV multiplies
bf16 activations on tensor cores, accumulates in float32 and applies each group's scale and offset
to its sum in float32 (default; or dequantizes each weight to bf16 first: VARIANTS):

    gemm(x [M, K], w)             -> [M, N] bf16, M <= MAX_ROWS (32), one launch (PDL optional)
    gemm_swiglu(x, w)             -> bf16(bf16(silu(G)) * U), [G | U] = gemm(x, w): [M, N / 2], the
                                     SwiGLU in the GEMV's epilogue (bits of silu_mul after gemm)
    gemm_allreduce(x, w, ar)      -> the same summed over the ranks of a DeviceAllReduce (M <= 16)
    dequantize(w)                 -> bf16 [N, K]: bf16(q * scale + offset), rounded once
    linear(x, w, b=None)          -> F.linear for any weight: this kind through gemm (M <= 32) or
                                     dequantize + cuBLAS (prompts), a dense tensor through F.linear

Launched like kernels.gemm_rowparallel: cuLaunchKernel(Ex) on `torch.cuda.current_stream()`, no
host sync, no allocation when `out` is given, so CUDA graphs capture them.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiftspec_mpi.gpu.launch import function, launch, launch_pdl, ptr, sm_count
from swiftspec_mpi.packed.int4 import PackedInt4, unpack_codes

MAX_ROWS = 32                  # rows M of gemm (m-blocks of 8: 1, 2 or 4)
MAX_ALLREDUCE_ROWS = 16        # rows M of gemm_allreduce (the DeviceAllReduce window's 16 rows)
CHUNK = 128                    # k's of one lane-chunk; K % CHUNK == 0
TILE = 16                      # W rows of one MMA tile; N % TILE == 0
# (tiles per block T, 128-k units per warp and chunk U, exact group scaling E) of
# w4a16_gemm_mb*_g*_t<T>_u<U>_e<E>. E = 0: each weight dequantized to bf16 (a subtract and an FMA
# per pair) before the MMA; E = 1: the MMAs take the codes as bf16 (128 + q), each group's sum is
# scaled in fp32 afterwards (s P + (o - 128 s) X, X from an all-ones MMA): fewer instructions and
# no rounding of W. (1, 1, 1) runs 3 blocks per SM (80 registers), (1, 2, *) 2, the others 1. The
# fused all-reduce exists for T = 1, U = 2 and both E, and for T = 1, U = 1, E = 1.
VARIANTS = ((1, 2, 0), (2, 2, 0), (1, 2, 1), (2, 2, 1), (1, 4, 1), (1, 1, 1))
_default = None                # None: the shape rule of default_config
_ALLREDUCE_UE = ((2, 0), (2, 1), (1, 1))   # (U, E) of the fused all-reduce kernels (T = 1)
_SWIGLU_UE = ((1, 1), (2, 1))              # (U, E) of the gate|up + SwiGLU kernels (T = 1)
_THREADS = 256
# nibble i of a device word holds relative k PERM[i]: pairs (i, i + 4) are k's (2i, 2i + 1)
PERM = (0, 2, 4, 6, 1, 3, 5, 7)
_SOURCE = "w4a16"


@dataclass
class W4A16Weight:
    """One layer's 4-bit weight in the device layout of cuda/w4a16.cu (module docstring)."""
    qweight: torch.Tensor      # uint8 [N, K // 2], permuted codes, tile-major
    so: torch.Tensor           # int32 [N, K // group], bf16 (scale, offset) pairs, tile-major
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight this stands for."""
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.so]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def supported(n: int, k: int, group: int) -> bool:
    """Whether the kernels take an [n, k] weight of this group size."""
    return group in (32, 64, 128) and k % CHUNK == 0 and n % TILE == 0 and n > 0


def to_tiles(t: torch.Tensor, per_chunk: int) -> torch.Tensor:
    """Row-major [N, C * per_chunk] (C chunks of 128 k's, `per_chunk` elements each) -> the same
    shape, tile-major: the elements of (tile N / 16, chunk c) are 16 x per_chunk in one piece."""
    n, width = t.shape
    return t.reshape(n // TILE, TILE, width // per_chunk, per_chunk).transpose(1, 2).reshape(n, width).contiguous()


def from_tiles(t: torch.Tensor, per_chunk: int) -> torch.Tensor:
    """The inverse of `to_tiles`."""
    n, width = t.shape
    return t.reshape(n // TILE, width // per_chunk, TILE, per_chunk).transpose(1, 2).reshape(n, width).contiguous()


def repack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """PackedInt4 codes uint8 [N, K/2] (low nibble = even k) -> the device layout uint8 [N, K/2]:
    the byte of row n = 16 t + r, chunk c, lane q, part p, j at offset 16 t K/2 + 1024 c + 64 r +
    16 q + 4 p + j holds the codes of k = 128 c + 32 p + 8 q + PERM[2j] (low nibble) and
    + PERM[2j + 1] (high nibble)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    codes = unpack_codes(qweight).view(n, k // CHUNK, 4, 4, 8)          # [n, c, p, q, r]
    perm = torch.tensor(PERM, device=qweight.device)
    c = codes.permute(0, 1, 3, 2, 4).index_select(4, perm)              # [n, c, q, p, nibble]
    return to_tiles((c[..., 0::2] | (c[..., 1::2] << 4)).reshape(n, k // 2), CHUNK // 2)


def unpack_device(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of `repack_codes`: device layout -> PackedInt4 codes uint8 [N, K/2]."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    b = from_tiles(qweight, CHUNK // 2).view(n, k // CHUNK, 4, 4, 4)    # [n, c, q, p, byte]
    nib = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(n, k // CHUNK, 4, 4, 8)
    inv = torch.empty(8, dtype=torch.long)
    inv[list(PERM)] = torch.arange(8)
    codes = nib.index_select(4, inv.to(qweight.device)).permute(0, 1, 3, 2, 4).reshape(n, k)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def pack_scales(scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 scale, offset [N, G] -> int32 [N, G]: bf16 scale (low half), bf16 offset (high)."""
    pair = torch.stack((scale.to(torch.bfloat16), offset.to(torch.bfloat16)), dim=-1).contiguous()
    return pair.view(torch.int32).reshape(scale.shape)


def from_packed(w: PackedInt4, device, rows_per_step: int = 4096) -> W4A16Weight:
    """Repack a PackedInt4 (any device) into a W4A16Weight on `device`, `rows_per_step` rows at a
    time (the temporaries stay small). Raises ValueError for shapes the kernels do not take."""
    w.check()
    n, k = w.shape
    if not supported(n, k, w.group):
        raise ValueError(f"4-bit weight [{n}, {k}] group {w.group}: the GPU kernels need K % {CHUNK} == 0 "
                         f"and N % {TILE} == 0")
    device = torch.device(device)
    q = torch.empty(n, k // 2, dtype=torch.uint8, device=device)
    so = torch.empty(n, k // w.group, dtype=torch.int32, device=device)
    rows_per_step = max(TILE, rows_per_step // TILE * TILE)            # whole tiles per part
    for r in range(0, n, rows_per_step):
        e = min(n, r + rows_per_step)
        q[r:e] = repack_codes(w.qweight[r:e].to(device))
        so[r:e] = to_tiles(pack_scales(w.scale[r:e].to(device), w.offset[r:e].to(device)), CHUNK // w.group)
    return W4A16Weight(q, so, w.group)


def to_packed(w: W4A16Weight) -> PackedInt4:
    """The PackedInt4 (on w's device) of the weights the kernels use: scale and offset as their
    bf16 values (exact in float32)."""
    so = from_tiles(w.so, CHUNK // w.group)
    pair = so.view(torch.bfloat16).view(so.shape[0], so.shape[1], 2).float()
    return PackedInt4(unpack_device(w.qweight), pair[..., 0].contiguous(), pair[..., 1].contiguous(), w.group)


def cat_rows(ws: list[W4A16Weight]) -> W4A16Weight:
    """Row concatenation (the fused QKV and gate|up weights); the same K and group."""
    if len({(w.shape[1], w.group) for w in ws}) != 1:
        raise ValueError("cat_rows: the weights differ in K or group")
    return W4A16Weight(torch.cat([w.qweight for w in ws]), torch.cat([w.so for w in ws]), ws[0].group)


def _dev(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _check_x(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None, max_rows: int):
    n, k = w.shape
    if not (x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(-1) == 1):
        raise ValueError(f"x must be a 2-d bfloat16 CUDA tensor with last stride 1, got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if x.shape[1] != k or not 1 <= m <= max_rows or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError(f"w4a16: x {tuple(x.shape)} for a [{n}, {k}] weight: need [M, {k}] with "
                         f"1 <= M <= {max_rows}, row stride a multiple of 8, 16-byte aligned")
    if not supported(n, k, w.group) or w.qweight.device != x.device:
        raise ValueError(f"w4a16: weight [{n}, {k}] group {w.group} on {w.qweight.device}: unsupported here")
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    elif not (out.is_cuda and out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n) and out.stride(-1) == 1):
        raise ValueError(f"out must be a [{m}, {n}] bfloat16 CUDA tensor with last stride 1")
    return m, n, k, out


def _mb(m: int) -> int:
    return 1 if m <= 8 else 2 if m <= 16 else 4


def default_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(T, U, E) for an [m, k] x [n, k]^T product (the `set_default` variant if one is set): exact
    group scaling, one 16-row tile a block, and of (1, 1, 1) (3 blocks per SM, 1 chunk of 128 k's
    a warp and step) and (1, 2, 1) (2 blocks per SM, 2 chunks) the one whose wave of blocks fills
    the SMs better, (1, 1, 1) counted 12 % faster at equal fill (measured on an H200: 8B QKV and
    gate|up, 70B QKV and gate|up take (1, 1, 1); 8B O and down, 70B O and down (1, 2, 1)). By N
    and K only, never M: a row's bits do not depend on the batch size (E = 0 is faster at M = 16-32
    but would make them; benchmarks/bench_w4a16.py sweeps VARIANTS)."""
    if _default is not None:
        return _default
    tiles, sms = n // TILE, sm_count()

    def fill(per_sm: int) -> float:            # tiles over the slots of the waves they take
        slots = per_sm * sms
        return tiles / (slots * -(-tiles // slots))

    return (1, 1, 1) if 1.12 * fill(3) >= fill(2) else (1, 2, 1)


def set_default(config: tuple | None) -> None:
    """The variant `gemm` and `gemm_allreduce` use for every shape (benchmarks compare them; a CUDA
    graph keeps the variant it captured); None restores the shape rule of `default_config`.
    gemm_allreduce runs T = 1 with the variant's U and E where it is instantiated, else U = 2."""
    global _default
    if config is not None and tuple(config) not in VARIANTS:
        raise ValueError(f"config {config} must be one of {VARIANTS}")
    _default = None if config is None else tuple(config)


def gemm(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None = None, pdl: bool = False,
         config: tuple | None = None) -> torch.Tensor:
    """out = x @ W^T with W the dequantized 4-bit weight.

    Args:
      x:      [M, K] bfloat16, 1 <= M <= 32, last stride 1, row stride a multiple of 8, aligned.
      w:      W4A16Weight [N, K] on x's device.
      out:    [M, N] bfloat16, last stride 1; allocated if None (written in full).
      pdl:    programmatic dependent launch (the weight loads overlap the previous kernel).
      config: (T, U, E), one of VARIANTS; default `default_config`.

    Returns:
      out: [M, N] bfloat16, float32 accumulation.
    """
    m, n, k, out = _check_x(x, w, out, MAX_ROWS)
    config = default_config(m, n, k) if config is None else tuple(config)
    if config not in VARIANTS:
        raise ValueError(f"config {config} must be one of {VARIANTS}")
    t, u, e = config
    dev = _dev(x)
    f = function(_SOURCE, "", f"w4a16_gemm_mb{_mb(m)}_g{w.group}_t{t}_u{u}_e{e}", dev)
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w.qweight), ptr(w.so), ptr(out),
            ctypes.c_int64(out.stride(0)), ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_int32(k)]
    grid = -(-(n // TILE) // t)
    (launch_pdl if pdl else launch)(f, (grid, 1, 1), _THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def swiglu_ok(x: torch.Tensor, w: W4A16Weight) -> bool:
    """Whether `gemm_swiglu` takes x [M, K] and the gate|up weight w [2I, K]: M <= 32, a 16-byte
    aligned x with row stride a multiple of 8, I % 16 == 0, and a kernel for the variant
    `default_config` picks for [2I, K] (T = 1 and (U, E) in _SWIGLU_UE)."""
    n, k = w.shape
    if not (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.shape[1] == k and x.stride(-1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and n % 32 == 0):
        return False
    t, u, e = default_config(x.shape[0], n, k)
    return t == 1 and (u, e) in _SWIGLU_UE


def gemm_swiglu(x: torch.Tensor, w: W4A16Weight, out: torch.Tensor | None = None,
                pdl: bool = False) -> torch.Tensor:
    """The gate|up projection with the SwiGLU in its epilogue: out = bf16(bf16(silu(G)) * U) where
    [G | U] = gemm(x, w) (bf16), bit for bit fused_ops.silu_mul(gemm(x, w)), in one launch and
    without the [M, 2I] intermediate. Block j computes gate rows 8j..8j+7 and up rows I+8j..I+8j+7
    (two half tiles, cuda/w4a16.cu `SWI`).

    Args:
      x:   [M, K] bfloat16, as for gemm; `swiglu_ok(x, w)` must hold.
      w:   W4A16Weight [2I, K]: the gate rows [0, I) then the up rows [I, 2I) (cat_rows).
      out: [M, I] bfloat16, last stride 1; allocated if None (written in full).
      pdl: programmatic dependent launch.

    Returns:
      out: [M, I] bfloat16.
    """
    if not swiglu_ok(x, w):
        raise ValueError(f"gemm_swiglu: x {tuple(x.shape)} w {w.shape}: see swiglu_ok")
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    if out is None:
        out = torch.empty((m, n // 2), dtype=torch.bfloat16, device=x.device)
    elif not (out.is_cuda and out.dtype == torch.bfloat16 and tuple(out.shape) == (m, n // 2) and out.stride(-1) == 1):
        raise ValueError(f"out must be a [{m}, {n // 2}] bfloat16 CUDA tensor with last stride 1")
    _, u, _ = default_config(m, n, k)
    dev = _dev(x)
    f = function(_SOURCE, "", f"w4a16_swiglu_mb{_mb(m)}_g{w.group}_t1_u{u}_e1", dev)
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w.qweight), ptr(w.so), ptr(out),
            ctypes.c_int64(out.stride(0)), ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_int32(k)]
    (launch_pdl if pdl else launch)(f, (n // TILE, 1, 1), _THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def gemm_allreduce(x: torch.Tensor, w: W4A16Weight, ar, out: torch.Tensor | None = None) -> torch.Tensor:
    """out = all_reduce_sum(x @ W^T) over the ranks of `ar` (nccl_shim.DeviceAllReduce with
    max_n >= N), in one kernel: the row-parallel o_proj / down_proj of tensor parallelism with
    4-bit weights. Collective: every rank calls it with the same shapes. x: [M, K_local], M <= 16;
    w: this rank's W4A16Weight [N, K_local]. T = 1 with the default's U and E (U = 2 where no
    kernel has them): at TP = 1 it gives gemm's bits when the default has T = 1 (U and E fix the
    summation order)."""
    m, n, k, out = _check_x(x, w, out, MAX_ALLREDUCE_ROWS)
    if n > ar.max_n:
        raise ValueError(f"N={n} exceeds the DeviceAllReduce window (max_n={ar.max_n})")
    _, u, e = default_config(m, n, k)
    u = u if (u, e) in _ALLREDUCE_UE else 2
    dev = _dev(x)
    f = function(_SOURCE, "nccl", f"w4a16_allreduce_mb{_mb(m)}_g{w.group}_t1_u{u}_e{e}", dev)
    args = [ptr(x), ctypes.c_int64(x.stride(0)), ptr(w.qweight), ptr(w.so), ptr(out),
            ctypes.c_int64(out.stride(0)), ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_int32(k),
            ctypes.c_uint64(ar.window), ptr(ar.dev_comm), ptr(ar.seq)]
    launch(f, (ar.n_ctas, 1, 1), _THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def dequantize(w: W4A16Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 [N, K] weights the GEMV multiplies (one launch; `out` written in full)."""
    n, k = w.shape
    if out is None:
        out = torch.empty((n, k), dtype=torch.bfloat16, device=w.device)
    elif not (out.dtype == torch.bfloat16 and tuple(out.shape) == (n, k) and out.stride(-1) == 1
              and out.stride(0) % 8 == 0 and out.device == w.device):
        raise ValueError(f"out must be a [{n}, {k}] bfloat16 tensor on {w.device}, rows 16-byte aligned")
    dev = _dev(out)
    f = function(_SOURCE, "", f"w4a16_dequant_g{w.group}", dev)
    grid = min(-(-(n * (k // 8)) // _THREADS), 64 * sm_count())
    launch(f, (grid, 1, 1), _THREADS, 0, torch.cuda.current_stream(dev).cuda_stream,
            [ptr(w.qweight), ptr(w.so), ptr(out), ctypes.c_int64(out.stride(0)), ctypes.c_int32(n),
             ctypes.c_int32(k)])
    return out


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """F.linear(x, W, b) where W may be a W4A16Weight: x [M, K] bf16 -> [M, N] bf16. Up to
    MAX_ROWS rows through `gemm` (with `pdl`), more (prompts) through `dequantize` and cuBLAS."""
    if not isinstance(w, W4A16Weight):
        return F.linear(x, w, b)
    if x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1 and x.stride(0) % 8 == 0 \
            and x.data_ptr() % 16 == 0 and x.shape[0] > 0:
        y = gemm(x, w, pdl=pdl)
    else:
        y = F.linear(x, dequantize(w))
    return y if b is None else y.add_(b)


def reference(x: torch.Tensor, w: PackedInt4) -> torch.Tensor:
    """float64 x @ dequantize(w)^T on the CPU (the tests' reference)."""
    from swiftspec_mpi.packed.int4 import dequantize as dq
    return x.double().cpu() @ dq(w).double().cpu().T
