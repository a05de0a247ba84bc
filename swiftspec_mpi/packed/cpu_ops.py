"""The small operations of a decoder layer on the CPU (csrc/layer_ops.h), for decode-sized batches.

Every tensor is float32 on the CPU with contiguous rows (a row stride may exceed the row):

    add_rmsnorm(x [M, H], a [M, H] | None, w [H], eps) -> h [M, H]   (x += a in place first)
    rope_kv(qkv [M, (nh + 2 nkv) hd], positions [M] int64, cos, sin [P, hd], nh, nkv,
            kc, vc [slots, nkv, hd], start)      RoPE on q and k in place; k, v -> slots start + m
    attention(q [M, >= nh hd], kc, vc [>= S, nkv, hd], mask [M, S] bool, nh) -> o [M, nh hd]
    silu_mul(gu [M, 2 I]) -> [M, I]

`Transformer.forward` runs a layer with these where `usable` says so (M <= MAX_ROWS rows with a
mask: one-token steps, tree verifies and draft expansions); prompts keep torch's SDPA. Each
row's result depends on that row's inputs only (and, in attention, on its visible slots in slot
order), so a token gets the same numbers in a one-token step as in a tree verify.
"""
from __future__ import annotations

import math

import torch

from swiftspec_mpi.packed import _cpu_gemm

MAX_ROWS = 64   # the largest batch the layer runs with these ops (the scratch is per row)


def usable(x_dtype: torch.dtype, n_rows: int, head_dim: int, hidden: int) -> bool:
    """True when a layer of these sizes can run on these ops (float32, M <= MAX_ROWS, hd a
    multiple of 16 up to 128, hidden a multiple of 8)."""
    return (x_dtype == torch.float32 and n_rows <= MAX_ROWS and head_dim % 16 == 0
            and head_dim <= 128 and hidden % 8 == 0)


def add_rmsnorm(x: torch.Tensor, a: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] += a (when given; in place); returns rmsnorm(x) * w as a new [M, H]."""
    M, H = x.shape
    out = torch.empty(M, H, dtype=torch.float32)
    _cpu_gemm.add_rmsnorm(x.data_ptr(), x.stride(0), 0 if a is None else a.data_ptr(),
                          0 if a is None else a.stride(0), w.data_ptr(), eps, out.data_ptr(), H,
                          M, H)
    return out


def rope_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            nh: int, nkv: int, kc: torch.Tensor, vc: torch.Tensor, start: int) -> None:
    """RoPE on qkv's q and k heads (in place), then its k and v heads into kc, vc [slots, nkv,
    hd] at slots [start, start + M)."""
    M = qkv.shape[0]
    hd = kc.shape[-1]
    if start + M > kc.shape[0] or positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("rope_kv: slots past the cache, or positions not contiguous int64")
    _cpu_gemm.rope_kv(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), cos.shape[0], M, nh, nkv, hd, kc.data_ptr(), vc.data_ptr(),
                      start)


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor,
              nh: int, n_threads: int | None = None) -> torch.Tensor:
    """Masked grouped-query attention: q rows [M, >= nh hd] (heads side by side), kc, vc
    [>= S, nkv, hd], mask [M, S] bool (True = visible) -> [M, nh hd], scale 1 / sqrt(hd)."""
    M, S = mask.shape
    nkv, hd = kc.shape[1], kc.shape[2]
    if mask.dtype != torch.bool or S > kc.shape[0]:
        raise ValueError("attention: the mask must be bool [M, S] with S <= the cache's slots")
    mask = mask.contiguous()
    out = torch.empty(M, nh * hd, dtype=torch.float32)
    nt = torch.get_num_threads() if n_threads is None else n_threads
    _cpu_gemm.attention(q.data_ptr(), q.stride(0), M, nh, nkv, hd, kc.data_ptr(), vc.data_ptr(),
                        S, mask.data_ptr(), mask.stride(0), out.data_ptr(), nh * hd,
                        1.0 / math.sqrt(hd), nt)
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [M, 2 I] (gate, then up) -> silu(gate) * up [M, I]."""
    M, I2 = gu.shape
    out = torch.empty(M, I2 // 2, dtype=torch.float32)
    _cpu_gemm.silu_mul(gu.data_ptr(), gu.stride(0), M, I2 // 2, out.data_ptr(), I2 // 2)
    return out
