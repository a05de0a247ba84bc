"""Tree attention on the GPU: the kernel configs, the default rule, the wrapper and its reference.

`tree_attention` runs masked attention of N <= 64 tree tokens over the KV cache in one launch
(cuda/tree_attention.cu, four kernel versions). Each version has its own small config type:

  AttnConfigV1(cluster, stages, row_tiles)                 thread-block cluster, DSMEM combine
  AttnConfigV2(cluster, stages, row_tiles, warps)          v1 + mbarrier ring, mask bits, push combine
  AttnConfigV3(tiles_per_split, stages, row_tiles, warps, combine)
                                                          split-K, fp32 partials in a workspace
  AttnConfigV4(tiles_per_split, stages, row_tiles, warps, piece, early)
                                                          v3 with all tiles in flight, PDL combine

`tree_attention_config` is the default rule; `tree_attention_configs` lists every instantiated
config (the GPU tests run each). Configs are NamedTuples, so they compare equal to plain tuples.
"""
from __future__ import annotations

import ctypes
import math
from typing import NamedTuple

import torch

from swiftspec_mpi.gpu.launch import _lock, check_bf16, device_index, function, launch, launch_pdl, ptr

MAX_TREE_TOKENS = 64       # query tokens per tree_attention call
# Must match cuda/tree_attention.cu: 64-slot tiles, 128 threads in version 1, its instantiations.
_TILE, _V1_THREADS = 64, 128
_V2_MAXT = 16               # tiles per mask-bits chunk (tree_attn2::MAXT)
_SPLIT_MAX = 1024           # splits per (KV head, row group) at most (versions 3 and 4)
_V3_COMBINE_THREADS = 128   # tree_attention3_combine's block
_V4_COMBINE_ITEMS = 32      # float4 outputs per tree_attention4_combine block (x 4 split groups)
_LOG2E = 1.4426950408889634
ROW_TILES = (1, 2, 4)       # m16 row tiles per block, every version
_WORKSPACES: dict = {}      # device index -> (partial O fp32, partial (m, l) fp32, counters int32)
_RETIRED: list = []         # outgrown workspaces, kept alive: captured graphs may point at them


class AttnConfigV1(NamedTuple):
    """Version 1: `cluster` blocks per KV head (a thread-block cluster, combined through
    distributed shared memory), a cp.async ring of `stages` 64-slot tiles, `row_tiles` m16 row
    tiles per block."""
    cluster: int
    stages: int
    row_tiles: int

    VARIANTS = ((8, 4), (16, 2))       # instantiated (cluster, stages)

    def check(self) -> None:
        if (self.cluster, self.stages) not in self.VARIANTS or self.row_tiles not in ROW_TILES:
            raise ValueError(f"{self}: (cluster, stages) must be one of {self.VARIANTS}, row_tiles 1, 2 or 4")

    def kernel(self, D: int) -> tuple[str, int]:
        return f"tree_attention_d{D}_mt{self.row_tiles}_cs{self.cluster}_st{self.stages}", _V1_THREADS

    def smem_bytes(self, D: int) -> int:
        """The K/V ring."""
        return _ring_bytes(D, self.stages)


class AttnConfigV2(NamedTuple):
    """Version 2: version 1's decomposition with an mbarrier-completed ring, the mask read once
    as bits and a push-style cluster combine; `warps` per block."""
    cluster: int
    stages: int
    row_tiles: int
    warps: int

    VARIANTS = ((16, 2, 4), (8, 4, 4))     # instantiated (cluster, stages, warps)

    def check(self) -> None:
        if (self.cluster, self.stages, self.warps) not in self.VARIANTS or self.row_tiles not in ROW_TILES:
            raise ValueError(f"{self}: (cluster, stages, warps) must be one of {self.VARIANTS}, "
                             "row_tiles 1, 2 or 4")

    def kernel(self, D: int) -> tuple[str, int]:
        return (f"tree_attention2_d{D}_mt{self.row_tiles}_cs{self.cluster}_st{self.stages}_w{self.warps}",
                32 * self.warps)

    def smem_bytes(self, D: int) -> int:
        """The ring, the combine's receive buffer, the mask bits, the mbarriers (tree_attn2::Layout)."""
        rb = 16 * self.row_tiles
        per = -(-(rb * D // 4) // self.cluster)
        return (_ring_bytes(D, self.stages) + self.cluster * per * 16 + self.cluster * rb * 8
                + _V2_MAXT * rb * 8 + self.stages * 8)


class AttnConfigV3(NamedTuple):
    """Version 3: split-K over cluster-free blocks, splits = ceil(KV tiles / tiles_per_split),
    fp32 partials in the per-device workspace; combine 0 = the last block of each (KV head, row
    group) reduces them (ticket counter), 1 = a second kernel launched with PDL. 4 warps."""
    tiles_per_split: int
    stages: int
    row_tiles: int
    warps: int
    combine: int

    STAGES = (2,)                      # instantiated ring depths

    def check(self) -> None:
        if (self.stages not in self.STAGES or self.warps != 4 or self.row_tiles not in ROW_TILES
                or self.combine not in (0, 1) or int(self.tiles_per_split) < 1):
            raise ValueError(f"{self}: tiles_per_split >= 1, stages in {self.STAGES}, row_tiles 1, 2 "
                             "or 4, warps 4, combine 0 or 1")

    def kernel(self, D: int) -> tuple[str, int]:
        return f"tree_attention3_d{D}_mt{self.row_tiles}_st{self.stages}_w4", 128

    def smem_bytes(self, D: int) -> int:
        """The ring, the mask bits, the mbarriers and a flag (tree_attn3::Layout)."""
        return _ring_bytes(D, self.stages) + _V2_MAXT * 16 * self.row_tiles * 8 + self.stages * 8 + 16


class AttnConfigV4(NamedTuple):
    """Version 4: version 3's split-K with every tile of a block in flight (tiles_per_split <=
    stages), `warps` warps each taking `piece`-slot pieces of one row tile, one block partial, and
    a PDL combine kernel; early 1 = with pdl=True the combine lets the next kernel launch before
    it waits."""
    tiles_per_split: int
    stages: int
    row_tiles: int
    warps: int
    piece: int
    early: int

    VARIANTS = ((4, 1, 4, 32), (4, 2, 8, 32))   # instantiated (stages, row_tiles, warps, piece)

    def check(self) -> None:
        if ((self.stages, self.row_tiles, self.warps, self.piece) not in self.VARIANTS
                or not 1 <= int(self.tiles_per_split) <= self.stages or self.early not in (0, 1)):
            raise ValueError(f"{self}: (stages, row_tiles, warps, piece) must be one of {self.VARIANTS}, "
                             "1 <= tiles_per_split <= stages, early 0 or 1")

    def kernel(self, D: int) -> tuple[str, int]:
        return (f"tree_attention4_d{D}_mt{self.row_tiles}_w{self.warps}_pw{self.piece}_st{self.stages}",
                32 * self.warps)

    def smem_bytes(self, D: int) -> int:
        """max(ring, block-combine buffer), Q rows, mask bits, warp row maxima and sums, mbarriers
        (tree_attn4::Layout)."""
        rb, nw = 16 * self.row_tiles, self.warps
        red = nw * 16 * (D + 4) * 4
        return (max(_ring_bytes(D, self.stages), red) + rb * (D + 8) * 2 + self.stages * rb * 8
                + nw * 16 * 4 * 2 + self.stages * 8)


AttnConfig = AttnConfigV1 | AttnConfigV2 | AttnConfigV3 | AttnConfigV4


def _ring_bytes(D: int, stages: int) -> int:
    return stages * 2 * _TILE * (D + 8) * 2


def tree_attention_configs(rows: int | None = None) -> list[AttnConfig]:
    """Every instantiated config the GPU tests run (the defaults among them). With `rows`, only
    the row-tile counts that suit that many rows per KV head (<= 16: 1; <= 32: 1, 2; more: 2, 4)."""
    mts = ROW_TILES if rows is None else (1,) if rows <= 16 else (1, 2) if rows <= 32 else (2, 4)
    return ([AttnConfigV1(cs, st, mt) for cs, st in AttnConfigV1.VARIANTS for mt in mts]
            + [AttnConfigV2(cs, st, mt, nw) for cs, st, nw in AttnConfigV2.VARIANTS for mt in mts]
            + [AttnConfigV3(t, 2, mt, 4, c) for t, c in ((4, 1), (8, 1), (8, 0)) for mt in mts]
            + [AttnConfigV4(t, st, mt, nw, pw, early) for st, mt, nw, pw in AttnConfigV4.VARIANTS
               for t in (2, 4) for early in (0, 1) if mt in mts])


def tree_attention_cluster_config(rows: int, max_len: int) -> AttnConfigV1 | AttnConfigV2:
    """The cluster kernels' config (no workspace) for `rows` query rows per KV head and `max_len`
    mask columns: the default beyond the ranges where versions 3 and 4 win, and the default's
    stand-in while a CUDA graph is captured before the split-K workspace exists. Up to 32 rows
    and 8k slots version 2 (8 blocks per cluster with a 4-tile ring up to 2k slots, 16 with a
    2-tile ring beyond); otherwise version 1 (8/4 up to 2k slots, 16/2 beyond; 4 row tiles for
    more than 32 rows)."""
    if rows <= 32 and max_len <= 8192:
        mt = 1 if rows <= 16 else 2
        return AttnConfigV2(8, 4, mt, 4) if max_len <= 2048 or rows <= 16 else AttnConfigV2(16, 2, mt, 4)
    if max_len <= 2048:
        return AttnConfigV1(8, 4, 1 if rows <= 16 else 2 if rows <= 32 else 4)
    return AttnConfigV1(16, 2, 1 if rows <= 32 else 4)


def tree_attention_config(rows: int, max_len: int, head_dim: int = 128) -> AttnConfig:
    """The default config for `rows` = N * (H / Hkv) query rows per KV head, a mask of `max_len`
    columns (the largest context the call may see: a graph captured over a static [N, max_slots]
    mask gets the long-context choice) and `head_dim`:

    - up to 32 rows and 1.5k slots (2.25k at head_dim 64): version 4, 2 tiles per split, a
      4-tile ring, early trigger: 2/4/1/4/32/1 (up to 16 rows, or head_dim 64 up to 1.5k
      slots), else 2/4/2/8/32/1;
    - up to 32 rows and 8k slots: version 4 with 4 tiles per split, 4/4/1/4/32/1 (<= 16 rows)
      or 4/4/2/8/32/1;
    - 17..32 rows beyond 8k slots, and more than 128 rows beyond 2k: version 3, 8 tiles per
      split, PDL combine (8/2/2/4/1, 8/2/4/4/1);
    - everywhere else the cluster kernels (tree_attention_cluster_config).

    The short-context choices were timed inside the whole decode step
    (benchmarks/bench_attention_in_step.py), the others by sweeps of the attention alone
    (benchmarks/bench_kernels_gpu.py); docs/benchmarks.md has the figures.
    """
    if 16 < rows <= 32 and max_len > 8192:
        return AttnConfigV3(8, 2, 2, 4, 1)
    if rows > 128 and max_len > 2048:
        return AttnConfigV3(8, 2, 4, 4, 1)
    if rows <= 32 and (max_len <= 1536 or (head_dim <= 64 and max_len <= 2304)):
        if rows <= 16 or (head_dim <= 64 and max_len <= 1536):
            return AttnConfigV4(2, 4, 1, 4, 32, 1)
        return AttnConfigV4(2, 4, 2, 8, 32, 1)
    if rows <= 32 and max_len <= 8192:
        return AttnConfigV4(4, 4, 1, 4, 32, 1) if rows <= 16 else AttnConfigV4(4, 4, 2, 8, 32, 1)
    return tree_attention_cluster_config(rows, max_len)


def tree_attention_workspace(device: int, n_o: int, n_ml: int, n_counters: int):
    """The split-K workspace of versions 3 and 4 on `device`: (partial O, partial (m, l), ticket
    counters), float32 / float32 / int32 CUDA tensors of at least n_o / n_ml / n_counters
    elements. Made once per device and grown (at least doubling) when a call needs more; an
    outgrown one is kept alive (a captured CUDA graph may still point at it). The counters start
    at zero and every call leaves them at zero. Raises while a CUDA graph is being captured and
    the workspace is too small (no allocation may be captured): call once eagerly first."""
    def fits(ws):
        return ws is not None and ws[0].numel() >= n_o and ws[1].numel() >= n_ml and ws[2].numel() >= n_counters

    ws = _WORKSPACES.get(device)
    if fits(ws):
        return ws
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("tree_attention: split-K workspace too small while capturing a CUDA graph; "
                           "run the call once outside the capture first")
    with _lock:
        ws = _WORKSPACES.get(device)
        if fits(ws):
            return ws
        old = (0, 0, 0) if ws is None else (ws[0].numel(), ws[1].numel(), ws[2].numel())
        grow = lambda need, have: have if need <= have else max(need, 2 * have)   # noqa: E731
        dev = torch.device("cuda", device)
        new = (torch.zeros(grow(n_o, old[0]), dtype=torch.float32, device=dev),
               torch.zeros(grow(n_ml, old[1]), dtype=torch.float32, device=dev),
               torch.zeros(max(grow(n_counters, old[2]), 256), dtype=torch.int32, device=dev))
        if ws is not None:
            _RETIRED.append(ws)
        _WORKSPACES[device] = new
        return new


def _check_inputs(q, k_cache, v_cache, mask, out, n_valid):
    """tree_attention's argument checks; -> (out, n_valid pointer arg, n_valid int arg)."""
    check_bf16("q", q, 3)
    check_bf16("k_cache", k_cache, 3)
    check_bf16("v_cache", v_cache, 3)
    N, H, D = q.shape
    S, Hkv, Dk = k_cache.shape
    if not 1 <= N <= MAX_TREE_TOKENS:
        raise ValueError(f"tree_attention takes 1..{MAX_TREE_TOKENS} query tokens, got {N}")
    if Dk != D or D not in (64, 128) or H % Hkv:
        raise ValueError(f"head layout q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)} not supported")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache must have k_cache's shape and strides")
    if q.stride(1) != D or k_cache.stride(1) != D or k_cache.stride(0) % 8 or q.stride(0) % 8:
        raise ValueError("q / k_cache: head stride must be head_dim and token/slot strides multiples of 8")
    if mask.dim() != 2 or mask.shape[0] != N or mask.dtype not in (torch.bool, torch.uint8) \
            or mask.stride(1) != 1 or not mask.is_cuda:
        raise ValueError(f"mask must be a [N={N}, L] bool/uint8 CUDA tensor with last stride 1")
    if out is None:
        out = torch.empty((N, H, D), dtype=torch.bfloat16, device=q.device)
    else:
        check_bf16("out", out, 3)
        if tuple(out.shape) != (N, H, D) or out.stride(1) != D or out.stride(0) % 4:
            raise ValueError(f"out must be [N, H, D] = {(N, H, D)} with head stride D")
    if isinstance(n_valid, torch.Tensor):
        if n_valid.dtype != torch.int32 or n_valid.numel() != 1 or not n_valid.is_cuda:
            raise ValueError("n_valid tensor must be one int32 element on the GPU")
        return out, ptr(n_valid), 0
    nv = int(n_valid)
    if not 1 <= nv <= min(S, mask.shape[1]):
        raise ValueError(f"n_valid={nv} must be in 1..min(slots={S}, mask columns={mask.shape[1]})")
    return out, ctypes.c_uint64(0), nv


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   n_valid: int | torch.Tensor | None = None, out: torch.Tensor | None = None,
                   scale: float | None = None, config: AttnConfig | None = None,
                   pdl: bool = False) -> torch.Tensor:
    """Masked attention of N <= 64 tree tokens over L KV slots, GQA, one launch.

    Args:
      q:       [N, H, D] bfloat16. Head stride D, last stride 1; the token stride may be anything
               that keeps rows 16-byte aligned (a slice of a fused QKV output is fine).
      k_cache: [S, Hkv, D] bfloat16, one layer of the static KV buffer (S >= L slots). Head stride
               D, last stride 1, slot stride a multiple of 8. H % Hkv == 0; query head i reads KV
               head i // (H // Hkv). D in {64, 128}.
      v_cache: [S, Hkv, D] bfloat16, same strides as k_cache.
      mask:    [N, >= L] bool or uint8, last stride 1 (any row stride): mask[i, s] nonzero means
               token i sees slot s. Columns >= L are ignored.
      n_valid: L, the number of KV slots attended: an int, or an int32 CUDA tensor of one element
               that the kernel reads on the device (so a captured CUDA graph can be replayed at a
               new context length). Default: mask.shape[1].
      out:     [N, H, D] bfloat16 (head stride D, last stride 1), written in full; allocated if None.
      scale:   softmax scale, default 1/sqrt(D).
      config:  an AttnConfigV1..V4 (tree_attention_configs() lists them); versions 3 and 4 use
               the per-device workspace (tree_attention_workspace), so calls on different
               streams must not overlap. Default: tree_attention_config(N * H // Hkv,
               mask.shape[1], D).
      pdl:     launch with programmatic dependent launch: the launch overlaps the previous
               kernel's tail; the kernel waits for that kernel before reading anything, then lets
               the next kernel of the stream launch.

    Returns:
      out: [N, H, D] bfloat16 = softmax(q k^T * scale, masked) v per head. A token that sees no
      slot gets zeros.
    """
    out, nv_ptr, nv = _check_inputs(q, k_cache, v_cache, mask, out,
                                    mask.shape[1] if n_valid is None else n_valid)
    if n_valid is None:
        n_valid = mask.shape[1]
    N, H, D = q.shape
    Hkv = k_cache.shape[1]
    R = N * (H // Hkv)
    default = config is None
    if default:
        config = tree_attention_config(R, mask.shape[1], D)
    if not isinstance(config, (AttnConfigV1, AttnConfigV2, AttnConfigV3, AttnConfigV4)):
        raise TypeError(f"config {config!r}: give an AttnConfigV1..V4 (tree_attention_configs())")
    config.check()
    name, threads = config.kernel(D)
    rg = -(-R // (16 * config.row_tiles))
    dev = device_index(q)
    stream = torch.cuda.current_stream(dev).cuda_stream
    scale = D ** -0.5 if scale is None else float(scale)
    smem = config.smem_bytes(D)
    if isinstance(config, (AttnConfigV1, AttnConfigV2)):
        args = _common_args(q, k_cache, v_cache, mask, nv_ptr, nv) + [ptr(out), ctypes.c_int64(out.stride(0))] \
            + _head_args(N, H, Hkv, scale)
        f = function("tree_attention", "", name, dev, smem, config.cluster > 8)
        (launch_pdl if pdl else launch)(f, (config.cluster, Hkv, rg), threads, smem, stream, args)
        return out
    # split-K: splits over the largest length this call may see (a device-side n_valid: the mask's
    # columns), so one captured graph serves every shorter length (empty splits store m = -inf)
    max_len = mask.shape[1] if isinstance(n_valid, torch.Tensor) else nv
    splits = -(-(-(-max_len // _TILE)) // int(config.tiles_per_split))
    if isinstance(config, AttnConfigV3):
        splits = max(1, min(_SPLIT_MAX, splits))
    elif splits > _SPLIT_MAX:
        raise ValueError(f"config {config}: {splits} splits for {max_len} slots, at most {_SPLIT_MAX}")
    rb = 16 * config.row_tiles
    parts = splits * Hkv * rg * rb
    try:
        ws_o, ws_ml, ctr = tree_attention_workspace(dev, parts * D, parts * 2,
                                                    Hkv * rg if isinstance(config, AttnConfigV3) else 1)
    except RuntimeError:
        if not default:
            raise
        # the default while capturing with no workspace yet: the cluster kernels need none
        return tree_attention(q, k_cache, v_cache, mask, n_valid, out, scale,
                              tree_attention_cluster_config(R, mask.shape[1]), pdl)
    f = function("tree_attention", "", name, dev, smem, False)
    if isinstance(config, AttnConfigV3):
        args = _common_args(q, k_cache, v_cache, mask, nv_ptr, nv) + [ptr(out), ctypes.c_int64(out.stride(0))] \
            + _head_args(N, H, Hkv, scale) + [ptr(ws_o), ptr(ws_ml), ptr(ctr),
                                              ctypes.c_int32(1 if config.combine == 0 else 0)]
        (launch_pdl if pdl else launch)(f, (splits, Hkv, rg), threads, smem, stream, args)
        if config.combine == 1:
            # the combine kernel always with PDL: it launches while the main kernel runs and
            # waits for it (griddepcontrol.wait) before reading the workspace
            fc = function("tree_attention", "", "tree_attention3_combine", dev)
            gx = -(-(rb * D // 4) // _V3_COMBINE_THREADS)
            launch_pdl(fc, (gx, Hkv, rg), _V3_COMBINE_THREADS, 0, stream,
                       _combine_args(ws_o, ws_ml, splits, rb, D, N, H, Hkv, out))
        return out
    args = _common_args(q, k_cache, v_cache, mask, nv_ptr, nv) + _head_args(N, H, Hkv, scale) \
        + [ctypes.c_int32(int(config.tiles_per_split)), ptr(ws_o), ptr(ws_ml)]
    (launch_pdl if pdl else launch)(f, (splits, Hkv, rg), threads, smem, stream, args)
    # the combine always with PDL; `early` (pdl=True calls only) lets the next kernel launch
    # before its wait for the main kernel
    fc = function("tree_attention", "", "tree_attention4_combine", dev)
    gx = -(-(rb * D // 4) // _V4_COMBINE_ITEMS)
    launch_pdl(fc, (gx, Hkv, rg), 4 * _V4_COMBINE_ITEMS, 0, stream,
               _combine_args(ws_o, ws_ml, splits, rb, D, N, H, Hkv, out)
               + [ctypes.c_int32(1 if (config.early and pdl) else 0)])
    return out


def _common_args(q, k_cache, v_cache, mask, nv_ptr, nv) -> list:
    return [ptr(q), ctypes.c_int64(q.stride(0)), ptr(k_cache), ptr(v_cache), ctypes.c_int64(k_cache.stride(0)),
            ptr(mask), ctypes.c_int64(mask.stride(0)), nv_ptr, ctypes.c_int32(nv)]


def _head_args(N, H, Hkv, scale) -> list:
    return [ctypes.c_int32(N), ctypes.c_int32(H), ctypes.c_int32(Hkv), ctypes.c_float(scale * _LOG2E)]


def _combine_args(ws_o, ws_ml, splits, rb, D, N, H, Hkv, out) -> list:
    return [ptr(ws_o), ptr(ws_ml), ctypes.c_int32(splits), ctypes.c_int32(rb), ctypes.c_int32(D),
            ctypes.c_int32(N), ctypes.c_int32(H), ctypes.c_int32(Hkv), ptr(out), ctypes.c_int64(out.stride(0))]


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             mask: torch.Tensor, n_valid: int, scale: float | None = None) -> torch.Tensor:
    """float64 reference of tree_attention (any device): q [N, H, D], k_cache / v_cache
    [S, Hkv, D], mask [N, >= n_valid] -> [N, H, D] float64; rows that see nothing are zeros."""
    N, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    qf = q.double()
    kf = k_cache[:n_valid].double().repeat_interleave(G, dim=1)      # [L, H, D]
    vf = v_cache[:n_valid].double().repeat_interleave(G, dim=1)
    s = torch.einsum("nhd,lhd->hnl", qf, kf) * scale
    vis = mask[:, :n_valid].bool()
    s = s.masked_fill(~vis[None], -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hnl,lhd->nhd", p, vf)
