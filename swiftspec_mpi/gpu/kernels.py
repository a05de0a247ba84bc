"""Fused CUDA kernels for the GPU path: tree attention and the row-parallel GEMM (optionally
fused with the tensor-parallel all-reduce through NCCL's device API).

The sources live in cuda/*.cu (package data `swiftspec_mpi.cuda`). They are compiled with nvcc
through `cupy.RawModule(code=..., backend="nvcc")` (NVRTC cannot compile NCCL's device headers)
once per process and device, and CuPy keeps the cubin in its on-disk cache (CUPY_CACHE_DIR,
default ~/.cupy/kernel_cache), so later processes only load it. Kernels are launched with
cuLaunchKernel on torch tensors' data pointers, on `torch.cuda.current_stream()`, so they
order with torch's work and can be captured in CUDA graphs (no host sync, no allocation when
`out` is given, every size that may change between replays read from device memory).

Call `available()` first; every other function assumes it returned True.
"""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

MAX_TREE_TOKENS = 64       # query tokens per tree_attention call
MAX_GEMM_ROWS = 16         # rows M of gemm_rowparallel / gemm_allreduce
# Must match cuda/tree_attention.cu: 64-slot tiles, 128 threads, instantiated variants
# (cluster size = KV splits, cp.async ring stages); row tiles per block 1, 2 or 4.
_TA_TILE, _TA_THREADS = 64, 128
TREE_ATTENTION_VARIANTS = ((8, 4), (16, 3), (16, 2))
# Version 2 of the kernel (tree_attention2_*, must match its instantiations): (cluster, stages,
# warps per block); row tiles 1, 2 or 4. A config (cluster, stages, row_tiles, warps) selects it;
# a 3-tuple version 1.
TREE_ATTENTION_V2_VARIANTS = ((16, 2, 4), (8, 4, 4))
_TA2_MAXT = 16               # tiles per mask-bits chunk (tree_attn2::MAXT)
# Version 3 (tree_attention3_*: split-K over cluster-free blocks, fp32 partials in a global
# workspace): its instantiated ring depths. A config (tiles_per_split, stages, row_tiles, warps,
# combine) selects it: splits = ceil(KV tiles / tiles_per_split) (a launch-time number, any
# tiles_per_split >= 1), warps 4, combine 0 = the last block of each (KV head, row group) reduces
# the partials (ticket counter), 1 = a second kernel launched with PDL does.
TREE_ATTENTION_V3_STAGES = (2, 4)
# The version 3 configs that tree_attention_configs lists (tiles_per_split, stages, combine).
TREE_ATTENTION_V3_VARIANTS = ((1, 2, 1), (2, 2, 1), (4, 2, 1), (4, 4, 1), (8, 2, 1), (8, 4, 1),
                              (2, 2, 0), (4, 2, 0), (4, 4, 0), (8, 4, 0))
_TA3_MAX_SPLITS = 1024       # splits per (KV head, row group) at most
_TA3_COMBINE_THREADS = 128   # tree_attention3_combine's block
# Version 4 (tree_attention4_*: version 3's split-K with the per-block fixed work cut, all tiles of
# a block in flight, NW warps each taking PW-slot pieces of one row tile, one block partial, and a
# PDL combine kernel of 32 outputs x 4 split groups per block): its instantiated (stages,
# row_tiles, warps, piece width). A config (tiles_per_split, stages, row_tiles, warps, piece,
# early) selects it: tiles_per_split <= stages, splits = ceil(KV tiles / tiles_per_split),
# early 1 = with pdl=True the combine kernel lets the next kernel launch before it waits.
TREE_ATTENTION_V4_VARIANTS = ((4, 2, 8, 32), (4, 2, 16, 32), (4, 2, 8, 64), (2, 2, 8, 32), (1, 2, 4, 32),
                              (4, 1, 4, 32), (2, 1, 4, 32), (2, 4, 16, 32))
# The version 4 configs that tree_attention_configs lists: every variant with all its stages used,
# and the candidates for N <= 8 at 1k-4k also with `early`.
TREE_ATTENTION_V4_CONFIGS = tuple((st, st, mt, nw, pw, 0) for st, mt, nw, pw in TREE_ATTENTION_V4_VARIANTS) \
    + ((4, 4, 2, 8, 32, 1), (4, 4, 2, 8, 64, 1), (2, 2, 2, 8, 32, 1), (4, 4, 1, 4, 32, 1)) \
    + ((2, 4, 1, 4, 32, 1), (2, 4, 2, 8, 32, 1))     # the short-context defaults (2 tiles a split)
_TA4_COMBINE_ITEMS = 32      # float4 outputs per tree_attention4_combine block (x 4 split groups)
_TA4_PARTS = "all"           # benchmark-only knob: "main" / "combine" launches only that kernel
_TA3_WORKSPACES: dict = {}   # device index -> (partial O fp32, partial (m, l) fp32, counters int32)
_TA3_RETIRED: list = []      # outgrown workspaces, kept alive: captured graphs may point at them
# Must match cuda/gemm_allreduce.cu: (tiles per block T, 16-byte vectors per lane and chunk U,
# L2 prefetch hint bytes PF, register double buffering PIPE) of
# gemm_rowparallel_m{8,16}_t<T>_u<U>_p<PF>_s<PIPE>; the GEMM + all-reduce exists for fewer.
GEMM_VARIANTS = ((1, 4, 0, 0), (1, 4, 256, 1), (2, 4, 256, 1), (2, 4, 0, 1), (4, 4, 256, 1),
                 (4, 2, 256, 1), (2, 8, 256, 0), (1, 8, 256, 1))
GEMM_ALLREDUCE_VARIANTS = ((1, 4, 0, 0), (2, 4, 256, 1), (1, 8, 256, 1))
_GEMM_THREADS = 256          # must match cuda/gemm_allreduce.cu
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_LOG2E = 1.4426950408889634

_lock = threading.Lock()
_modules: dict = {}        # (source name, variant, device index) -> cupy.RawModule
_functions: dict = {}      # (source name, variant, kernel name, device index) -> CUfunction (int)
_available: bool | None = None


def cuda_source_dir() -> Path:
    """Folder of the .cu files: the installed package data (swiftspec_mpi/cuda), or cuda/ of a
    source checkout (editable install)."""
    here = Path(__file__).resolve().parent
    for p in (here.parent / "cuda", here.parent.parent / "cuda"):
        if (p / "tree_attention.cu").is_file():
            return p
    raise FileNotFoundError(f"CUDA sources not found next to {here}; reinstall swiftspec-mpi")


def import_cupy():
    """`import cupy`, also from a source checkout whose root is on sys.path (pytest's conftest,
    PYTHONPATH=.): the checkout's cuda/ folder (a regular package holding the .cu files) would
    then shadow the `cuda` namespace package (cuda.pathfinder, cuda.bindings) CuPy imports.
    The root is left out of sys.path for the import, and a wrongly imported `cuda` evicted."""
    if "cupy" in sys.modules:
        return sys.modules["cupy"]
    root = Path(__file__).resolve().parent.parent.parent

    def is_root(p: str) -> bool:
        try:
            return Path(p or os.getcwd()).resolve() == root
        except OSError:
            return False

    for name in [m for m in sys.modules if m == "cuda" or m.startswith("cuda.")]:
        locs = list(getattr(sys.modules[name], "__path__", None) or [])
        f = getattr(sys.modules[name], "__file__", None)
        if f:
            locs.append(str(Path(f).parent))
        if any(is_root(str(Path(x).parent)) for x in locs):
            del sys.modules[name]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if not is_root(p)]
    try:
        import cupy
    finally:
        sys.path[:] = saved
    return cupy


def available() -> bool:
    """True when the fused kernels can run here: CuPy importable, an NVIDIA GPU of compute
    capability >= 9.0 (Hopper: clusters, which tree attention uses) visible to torch, and nvcc
    found (CuPy's nvcc backend: $NVCC, PATH or $CUDA_PATH/bin). Cached after the first call."""
    global _available
    if _available is None:
        _available = _probe_available()
    return _available


def _probe_available() -> bool:
    try:
        import_cupy()
        from cupy.cuda import get_nvcc_path
    except Exception:
        return False
    try:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
            return False
        return get_nvcc_path() is not None or shutil.which("nvcc") is not None
    except Exception:
        return False


def _module(name: str, variant: str, device: int):
    """Compiled RawModule of cuda/<name>.cu for `device` (variant "nccl" adds NCCL's device API).
    SWIFTSPEC_KERNELS_LINEINFO=1 compiles with -lineinfo (source lines in Nsight Compute)."""
    key = (name, variant, device)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            cupy = import_cupy()
            major, minor = torch.cuda.get_device_capability(device)
            opts = ["-std=c++17", f"-arch=sm_{major}{minor}", "-O3"]
            if os.environ.get("SWIFTSPEC_KERNELS_LINEINFO"):
                opts.append("-lineinfo")
            if variant == "nccl":
                from . import nccl_shim

                inc = nccl_shim.nccl_include_dir()
                if inc is None:
                    raise RuntimeError("nccl_device.h not found: install nvidia-nccl-cu12/cu13 >= 2.28 "
                                       "or set NCCL_INCLUDE")
                # The version define makes CuPy's cache key (source + options) follow the headers.
                opts += ["-I" + inc, "-DSWIFTSPEC_WITH_NCCL",
                         f"-DSWIFTSPEC_NCCL_VERSION={nccl_shim.header_version(inc)}"]
            code = (cuda_source_dir() / f"{name}.cu").read_text()
            with cupy.cuda.Device(device):
                # -split-compile=0: nvcc optimizes the kernels on all CPU cores (first use of
                # tree_attention.cu: 22 -> 13 s on 2 cores); the machine code is the same
                # (every .text and .nv.info section byte-identical, checked with nvcc 13.0).
                # A toolkit without the option compiles without it.
                try:
                    mod = cupy.RawModule(code=code, backend="nvcc", options=tuple(opts + ["-split-compile=0"]))
                    mod.compile()
                except Exception as e:            # cupy's CompileException
                    if "split-compile" not in str(e):
                        raise
                    mod = cupy.RawModule(code=code, backend="nvcc", options=tuple(opts))
                    mod.compile()
            _modules[key] = mod
    return mod


def _function(name: str, variant: str, kernel: str, device: int, dyn_smem: int = 0,
              nonportable_cluster: bool = False) -> int:
    key = (name, variant, kernel, device)
    f = _functions.get(key)
    if f is None:
        cupy = import_cupy()
        from cupy.cuda import driver

        mod = _module(name, variant, device)
        with cupy.cuda.Device(device):
            f = mod.get_function(kernel).kernel.ptr
            if dyn_smem > 48 * 1024:
                driver.funcSetAttribute(f, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn_smem)
            if nonportable_cluster:
                driver.funcSetAttribute(f, _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        _functions[key] = f
    return f


_launch_kernel = None


def _launch(f: int, grid: tuple, block: int, smem: int, stream: int, args: list) -> None:
    """cuLaunchKernel with args given as ctypes scalars (their C types must match the kernel).
    Launch-configuration errors raise here (CUDADriverError); faults surface at the next sync."""
    global _launch_kernel
    if _launch_kernel is None:
        from cupy.cuda import driver

        _launch_kernel = driver.launchKernel
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    _launch_kernel(f, grid[0], grid[1], grid[2], block, 1, 1, smem, stream, ctypes.addressof(params), 0)


class _LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute (cuda.h): id, pad, 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):         # CUlaunchConfig (cuda.h)
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_launch_kernel_ex = None


def _launch_pdl(f: int, grid: tuple, block: int, smem: int, stream: int, args: list) -> None:
    """cuLaunchKernelEx with programmatic stream serialization (PDL): the kernel may start while
    the previous kernel of the stream finishes, and must `griddepcontrol.wait` before reading
    anything that kernel writes. Captured into CUDA graphs as a programmatic edge."""
    global _launch_kernel_ex
    if _launch_kernel_ex is None:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_kernel_ex = fn
    attr = _LaunchAttribute()
    attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1                            # programmaticStreamSerializationAllowed (int) = 1
    cfg = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, smem, ctypes.c_void_p(stream),
                        ctypes.pointer(attr), 1)
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    rc = _launch_kernel_ex(ctypes.byref(cfg), ctypes.c_void_p(f), params, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


_memcpy_async = None


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cuMemcpyAsync of nbytes between two unified addresses (device memory or pinned host
    memory) on `stream`; captured as a memcpy node when the stream is capturing a CUDA graph."""
    global _memcpy_async
    if _memcpy_async is None:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpyAsync
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _memcpy_async = fn
    rc = _memcpy_async(dst, src, nbytes, ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpyAsync failed with CUresult {rc}")


def _ptr(t: torch.Tensor) -> ctypes.c_uint64:
    return ctypes.c_uint64(t.data_ptr())


def _check_bf16(name: str, t: torch.Tensor, ndim: int) -> None:
    if not t.is_cuda or t.dtype != torch.bfloat16 or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-d bfloat16 CUDA tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        raise ValueError(f"{name} must have a contiguous last dim and a 16-byte aligned start")


def tree_attention_smem_bytes(head_dim: int, stages: int, config: tuple | None = None) -> int:
    """Dynamic shared memory of one tree_attention block. Version 1 (config None or a 3-tuple):
    its K/V ring of `stages` 64-slot tiles. Version 2 (a 4-tuple config): the ring, the combine's
    receive buffer, the mask bits and the ring's mbarriers (tree_attn2::Layout). Version 3 (a
    5-tuple): the ring, the mask bits, the mbarriers and a flag (tree_attn3::Layout). Version 4
    (a 6-tuple): max(ring, block-combine buffer), Q rows, mask bits, warp row maxima and sums,
    mbarriers (tree_attn4::Layout)."""
    ring = stages * 2 * _TA_TILE * (head_dim + 8) * 2
    if config is None or len(config) == 3:
        return ring
    if len(config) == 6:
        mt, nw = config[2], config[3]
        rb = 16 * mt
        red = nw * 16 * (head_dim + 4) * 4
        return max(ring, red) + rb * (head_dim + 8) * 2 + stages * rb * 8 + nw * 16 * 4 * 2 + stages * 8
    if len(config) == 5:
        rb = 16 * config[2]
        return ring + _TA2_MAXT * rb * 8 + stages * 8 + 16
    cs, mt = config[0], config[2]
    rb = 16 * mt
    items = rb * head_dim // 4
    per = -(-items // cs)
    return ring + cs * per * 16 + cs * rb * 8 + _TA2_MAXT * rb * 8 + stages * 8


def tree_attention_configs(rows: int | None = None) -> list[tuple]:
    """Every instantiated config: version 1 (cluster, stages, row_tiles), version 2
    (cluster, stages, row_tiles, warps), the listed version 3 ones (tiles_per_split, stages,
    row_tiles, warps, combine) and the listed version 4 ones (tiles_per_split, stages, row_tiles,
    warps, piece, early). With `rows`, only row-tile counts that suit that many rows per
    KV head (<= 16: 1; <= 32: 1, 2; more: 2, 4)."""
    mts = (1, 2, 4) if rows is None else (1,) if rows <= 16 else (1, 2) if rows <= 32 else (2, 4)
    return ([(cs, st, mt) for cs, st in TREE_ATTENTION_VARIANTS for mt in mts]
            + [(cs, st, mt, nw) for cs, st, nw in TREE_ATTENTION_V2_VARIANTS for mt in mts]
            + [(t, st, mt, 4, c) for t, st, c in TREE_ATTENTION_V3_VARIANTS for mt in mts]
            + [c for c in TREE_ATTENTION_V4_CONFIGS if c[2] in mts])


def tree_attention_cluster_config(rows: int, max_len: int) -> tuple[int, ...]:
    """The best version 1 / 2 config (thread-block clusters, no workspace) for `rows` query rows
    per KV head and `max_len` mask columns: what tree_attention_config chose before version 3,
    and the default's stand-in while a CUDA graph is captured before version 3's workspace exists.

    From the sweeps on the H200 (benchmarks/bench_kernels_gpu.py, Llama-3-8B heads, header of
    cuda/tree_attention.cu): up to 32 rows (N <= 8 at G = 4), version 2 up to 8k slots: 8 blocks
    per cluster holding all of a block's tiles (2 at 1k) for <= 2k slots (N = 8 at 1k: 8.1 us vs
    9.7 for version 1), 16 per cluster with a 2-stage ring beyond (4k: 17.4 vs 18.7); at 16k
    version 1's 16/2/1 (44.5 vs 45.7). More rows (N = 64): version 1, 4 row tiles per block (65 us
    at 4k, 167 at 16k; version 2 80 / 223).
    """
    if rows <= 32 and max_len <= 8192:
        mt = 1 if rows <= 16 else 2
        return (8, 4, mt, 4) if max_len <= 2048 or rows <= 16 else (16, 2, mt, 4)
    if max_len <= 2048:
        return 8, 4, 1 if rows <= 16 else 2 if rows <= 32 else 4
    return 16, 2, 1 if rows <= 32 else 4


def tree_attention_config(rows: int, max_len: int, head_dim: int = 128) -> tuple[int, ...]:
    """Config used by default for `rows` = N * (H / Hkv) query rows per KV head, a mask of
    `max_len` columns (the largest context the call may see; a graph captured over a static
    [N, max_slots] mask gets the long-context choice) and `head_dim`. A 3-tuple (cluster, stages,
    row_tiles) is the version 1 kernel, a 4-tuple (cluster, stages, row_tiles, warps) version 2,
    a 5-tuple (tiles_per_split, stages, row_tiles, warps, combine) version 3, a 6-tuple
    (tiles_per_split, stages, row_tiles, warps, piece, early) version 4.

    Up to 32 rows and 1.5k slots (2.25k at head_dim 64) the choice comes from timing the configs
    inside the whole decode step (eighth GPU session, 2026-12-01, benchmarks/bench_attention_in_step.py:
    the step graph of the 8B / 1B shapes, N = 1 and 8, one graph per config, alternating rounds),
    not from chains of attention calls as the sweeps below: there the attention's neighbours (the
    QKV GEMV before it, the O GEMV after it, both streaming weights) change the ranking. Version 4
    with 2 tiles per split and a 4-tile ring wins everywhere in that range: 2/4/1/4/32, and
    2/4/2/8/32 for 17..32 rows at head_dim 128 (and 1.5k-2.25k slots at 64). 8B step, device ms,
    old default -> new: 640 slots 4.149 -> 4.120 (N = 1), 4.345 -> 4.314 (N = 8); 1152 slots
    4.220 -> 4.157, 4.481 -> 4.340; 1B: 1152 slots 0.894 -> 0.877, 0.971 -> 0.955 (N = 8,
    2/4/1/4/32); 2176 slots 0.890 -> 0.878, 0.991 -> 0.966; 384 slots: within +-0.01 of the old
    version 2 defaults. At 2k-4k slots for the 8B and 4k for the 1B the long-context defaults
    below stayed the best in the same measurement. With these configs the combine kernel's early
    trigger (`early` = 1: the O GEMV's blocks launch during the attention) pays in the step, the
    same bits: 8B 4.119 -> 4.090 (N = 1), 4.315 -> 4.303 (N = 8); 1B 0.869 -> 0.858, 0.954 ->
    0.944 (1152 slots), where with the old 2/2/1/4/32 it cost 0.07 ms; and so it does for the
    long-context 4/4/1/4/32 and 4/4/2/8/32 below: 8B 4.158 -> 4.140, 4.360 -> 4.347 (2176 slots),
    4.255 -> 4.234, 4.535 -> 4.520 (4224 slots); 1B 0.893 -> 0.890, 0.995 -> 0.985 (4224).

    Version 4 (second sweep of 2026-12-01, same run as the old defaults; µs plain / PDL) for 17..32
    rows up to 8k slots: 2/2/1/4/32/0 at 1k (N = 8: 7.55 / 6.74 vs 8.18 / 7.76 for version 2's
    8/4/2/4), 4/4/2/8/32/0 beyond 2k (4k: 11.72 / 10.85 vs 17.21 / 16.51 for 16/2/2/4); and
    4/4/1/4/32/0 for up to 16 rows at 2k-8k slots (N = 1 at 4k: 9.97 / 8.97 vs 12.53 / 12.56 for
    8/4/1/4). Elsewhere version 4 was slower (N = 8 at 16k: 38.1 vs 37.1 µs PDL; N = 64 at 4k:
    60.7 vs 40.6) or not measured, and the choices below stand.

    Third sweep (2026-12-01, fifth session; µs plain / PDL): version 4 also wins up to 16 rows at
    1k-2k slots, where version 2 was still the default: 2/2/1/4/32/0 at 1k (N = 1: 6.46 / 5.60 vs
    6.84 / 6.41 for 8/4/1/4; N = 2: 6.52 / 5.78 vs 6.91 / 6.49; N = 4: 6.71 / 5.84 vs 7.51 / 7.08),
    4/4/1/4/32/0 at 2k (N = 1: 7.55 / 6.70 vs 8.50 / 8.59); at 2k with 32 rows the long-context
    4/4/2/8/32/0 beats 2/2/1/4/32/0 (N = 8: 9.23 / 8.33 vs 9.93 / 9.12). Below 1k version 2 stays
    faster with PDL (512 slots, N = 1: 5.01 vs 5.27; N = 8: 6.19 vs 6.47; 256 slots: 4.72 vs 5.12,
    5.75 vs 6.17). So: version 2 up to 768 slots, 2/2/1/4/32/0 up to 1.5k (a step graph's mask
    is max_slots wide: 1k of context plus room), then 4/4/1/4/32/0 (<= 16 rows) or 4/4/2/8/32/0
    (17..32) up to 8k; checked at 8k (N = 1: 16.22 PDL vs 15.94 for version 3's best; N = 8: the
    best) and at 4k with N = 2, 4 (within 1 % of the best).

    From the first sweep of 2026-12-01 on the H200 (header of cuda/tree_attention.cu,
    docs/benchmarks.md), version 3 with its PDL combine kernel where it measured faster:
    17..32 rows beyond 8k slots (N = 8 at 16k: 8/2/2/4/1 37.7 us vs 44.9 for version 1's 16/2/1)
    and more than 128 rows beyond 2k slots (N = 64: 8/2/4/4/1 40.9 us vs 64.4 at 4k, 156.3 vs
    165.9 at 16k). Everywhere else the cluster kernels (tree_attention_cluster_config).
    """
    if 16 < rows <= 32 and max_len > 8192:
        return 8, 2, 2, 4, 1
    if rows > 128 and max_len > 2048:
        return 8, 2, 4, 4, 1
    if rows <= 32 and (max_len <= 1536 or (head_dim <= 64 and max_len <= 2304)):
        if rows <= 16 or (head_dim <= 64 and max_len <= 1536):
            return 2, 4, 1, 4, 32, 1
        return 2, 4, 2, 8, 32, 1
    if rows <= 32 and max_len <= 8192:
        return (4, 4, 1, 4, 32, 1) if rows <= 16 else (4, 4, 2, 8, 32, 1)
    return tree_attention_cluster_config(rows, max_len)


def tree_attention_workspace(device: int, n_o: int, n_ml: int, n_counters: int):
    """Version 3's global workspace on `device`: (partial O, partial (m, l), ticket counters),
    float32 / float32 / int32 CUDA tensors of at least n_o / n_ml / n_counters elements. Made
    once per device and grown (at least doubling) when a call needs more; an outgrown one is
    kept alive (a captured CUDA graph may still point at it). The counters start at zero and
    every call leaves them at zero. Raises while a CUDA graph is being captured and the
    workspace is too small (no allocation may be captured): call once eagerly first."""
    ws = _TA3_WORKSPACES.get(device)
    if ws is not None and ws[0].numel() >= n_o and ws[1].numel() >= n_ml and ws[2].numel() >= n_counters:
        return ws
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("tree_attention version 3: workspace too small while capturing a CUDA graph; "
                           "run the call once outside the capture first")
    with _lock:
        ws = _TA3_WORKSPACES.get(device)
        if ws is not None and ws[0].numel() >= n_o and ws[1].numel() >= n_ml and ws[2].numel() >= n_counters:
            return ws
        old = (0, 0, 0) if ws is None else (ws[0].numel(), ws[1].numel(), ws[2].numel())
        grow = lambda need, have: have if need <= have else max(need, 2 * have)   # noqa: E731
        dev = torch.device("cuda", device)
        new = (torch.zeros(grow(n_o, old[0]), dtype=torch.float32, device=dev),
               torch.zeros(grow(n_ml, old[1]), dtype=torch.float32, device=dev),
               torch.zeros(max(grow(n_counters, old[2]), 256), dtype=torch.int32, device=dev))
        if ws is not None:
            _TA3_RETIRED.append(ws)
        _TA3_WORKSPACES[device] = new
        return new


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   n_valid: int | torch.Tensor | None = None, out: torch.Tensor | None = None,
                   scale: float | None = None, config: tuple[int, ...] | None = None,
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
      config:  version 1: (cluster, stages, row_tiles), (cluster, stages) one of
               TREE_ATTENTION_VARIANTS; version 2: (cluster, stages, row_tiles, warps),
               (cluster, stages, warps) one of TREE_ATTENTION_V2_VARIANTS; version 3:
               (tiles_per_split, stages, row_tiles, 4, combine), stages one of
               TREE_ATTENTION_V3_STAGES, combine 0 (last block) or 1 (second kernel, PDL); it
               uses the per-device workspace (tree_attention_workspace), so calls on different
               streams must not overlap. row_tiles 1, 2 or 4 (m16 row tiles per block); cluster
               = KV splits per KV head. The listed ones: tree_attention_configs(). Default:
               tree_attention_config(N * H // Hkv, mask.shape[1], D).
      pdl:     launch with programmatic dependent launch: the launch overlaps the previous
               kernel's tail; the kernel waits for that kernel before reading anything, then lets
               the next kernel of the stream launch.

    Returns:
      out: [N, H, D] bfloat16 = softmax(q k^T * scale, masked) v per head. A token that sees no
      slot gets zeros.
    """
    _check_bf16("q", q, 3)
    _check_bf16("k_cache", k_cache, 3)
    _check_bf16("v_cache", v_cache, 3)
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
        _check_bf16("out", out, 3)
        if tuple(out.shape) != (N, H, D) or out.stride(1) != D or out.stride(0) % 4:
            raise ValueError(f"out must be [N, H, D] = {(N, H, D)} with head stride D")
    if n_valid is None:
        n_valid = mask.shape[1]
    if isinstance(n_valid, torch.Tensor):
        if n_valid.dtype != torch.int32 or n_valid.numel() != 1 or not n_valid.is_cuda:
            raise ValueError("n_valid tensor must be one int32 element on the GPU")
        nv_ptr, nv = _ptr(n_valid), 0
    else:
        nv = int(n_valid)
        if not 1 <= nv <= min(S, mask.shape[1]):
            raise ValueError(f"n_valid={nv} must be in 1..min(slots={S}, mask columns={mask.shape[1]})")
        nv_ptr = ctypes.c_uint64(0)
    G = H // Hkv
    R = N * G
    default = config is None
    config = tuple(tree_attention_config(R, mask.shape[1], D) if config is None else config)
    if len(config) == 3:
        cs, st, mt = config
        if (cs, st) not in TREE_ATTENTION_VARIANTS or mt not in (1, 2, 4):
            raise ValueError(f"config {config}: (cluster, stages) must be one of "
                             f"{TREE_ATTENTION_VARIANTS} and row_tiles 1, 2 or 4")
        name, threads = f"tree_attention_d{D}_mt{mt}_cs{cs}_st{st}", _TA_THREADS
    elif len(config) == 4:
        cs, st, mt, nw = config
        if (cs, st, nw) not in TREE_ATTENTION_V2_VARIANTS or mt not in (1, 2, 4):
            raise ValueError(f"config {config}: (cluster, stages, warps) must be one of "
                             f"{TREE_ATTENTION_V2_VARIANTS} and row_tiles 1, 2 or 4")
        name, threads = f"tree_attention2_d{D}_mt{mt}_cs{cs}_st{st}_w{nw}", 32 * nw
    elif len(config) == 5:
        tps, st, mt, nw, comb = config
        if st not in TREE_ATTENTION_V3_STAGES or nw != 4 or mt not in (1, 2, 4) or comb not in (0, 1) \
                or int(tps) < 1:
            raise ValueError(f"config {config}: (tiles_per_split >= 1, stages in {TREE_ATTENTION_V3_STAGES}, "
                             "row_tiles 1, 2 or 4, warps 4, combine 0 or 1)")
        name, threads = f"tree_attention3_d{D}_mt{mt}_st{st}_w4", 128
    elif len(config) == 6:
        tps, st, mt, nw, pw, early = config
        if (st, mt, nw, pw) not in TREE_ATTENTION_V4_VARIANTS or not 1 <= int(tps) <= st or early not in (0, 1):
            raise ValueError(f"config {config}: (stages, row_tiles, warps, piece) must be one of "
                             f"{TREE_ATTENTION_V4_VARIANTS}, 1 <= tiles_per_split <= stages, early 0 or 1")
        name, threads = f"tree_attention4_d{D}_mt{mt}_w{nw}_pw{pw}_st{st}", 32 * nw
    else:
        raise ValueError(f"config {config}: 3 (version 1), 4 (version 2), 5 (version 3) or 6 (version 4) values")
    rg = -(-R // (16 * mt))
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(dev).cuda_stream
    scale = D ** -0.5 if scale is None else float(scale)
    if len(config) == 6:
        return _tree_attention4(q, k_cache, v_cache, mask, n_valid, nv_ptr, nv, out, scale, config, pdl,
                                default, dev, stream, name, threads, rg, R)
    args = [_ptr(q), ctypes.c_int64(q.stride(0)), _ptr(k_cache), _ptr(v_cache), ctypes.c_int64(k_cache.stride(0)),
            _ptr(mask), ctypes.c_int64(mask.stride(0)), nv_ptr, ctypes.c_int32(nv),
            _ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(N), ctypes.c_int32(H), ctypes.c_int32(Hkv), ctypes.c_float(scale * _LOG2E)]
    if len(config) == 5:
        # Splits over the largest length this call may see (a device-side n_valid: the mask's
        # columns), so one captured graph serves every shorter length (empty splits store m = -inf).
        max_len = mask.shape[1] if isinstance(n_valid, torch.Tensor) else nv
        n_tiles = -(-max_len // _TA_TILE)
        splits = max(1, min(_TA3_MAX_SPLITS, -(-n_tiles // int(tps))))
        rb = 16 * mt
        parts = splits * Hkv * rg * rb
        try:
            ws_o, ws_ml, ctr = tree_attention_workspace(dev, parts * D, parts * 2, Hkv * rg)
        except RuntimeError:
            if not default:
                raise
            # default config while capturing with no workspace yet: the cluster kernels need none
            return tree_attention(q, k_cache, v_cache, mask, n_valid, out, scale,
                                  tree_attention_cluster_config(R, mask.shape[1]), pdl)
        smem = tree_attention_smem_bytes(D, st, config)
        f = _function("tree_attention", "", name, dev, smem, False)
        args += [_ptr(ws_o), _ptr(ws_ml), _ptr(ctr), ctypes.c_int32(1 if comb == 0 else 0)]
        (_launch_pdl if pdl else _launch)(f, (splits, Hkv, rg), threads, smem, stream, args)
        if comb == 1:
            # The combine kernel always with PDL: it launches while the main kernel runs and
            # waits for it (griddepcontrol.wait) before reading the workspace.
            fc = _function("tree_attention", "", "tree_attention3_combine", dev)
            gx = -(-(rb * D // 4) // _TA3_COMBINE_THREADS)
            cargs = [_ptr(ws_o), _ptr(ws_ml), ctypes.c_int32(splits), ctypes.c_int32(rb), ctypes.c_int32(D),
                     ctypes.c_int32(N), ctypes.c_int32(H), ctypes.c_int32(Hkv), _ptr(out),
                     ctypes.c_int64(out.stride(0))]
            _launch_pdl(fc, (gx, Hkv, rg), _TA3_COMBINE_THREADS, 0, stream, cargs)
        return out
    smem = tree_attention_smem_bytes(D, st, config)
    f = _function("tree_attention", "", name, dev, smem, cs > 8)
    (_launch_pdl if pdl else _launch)(f, (cs, Hkv, rg), threads, smem, stream, args)
    return out


def _tree_attention4(q, k_cache, v_cache, mask, n_valid, nv_ptr, nv, out, scale, config, pdl, default,
                     dev, stream, name, threads, rg, R):
    """Version 4 launch (tree_attention's checks done): the main kernel over the splits, then
    tree_attention4_combine with PDL. Splits over the largest length the call may see (a
    device-side n_valid: the mask's columns), so one captured graph serves every shorter length."""
    tps, st, mt, nw, pw, early = config
    N, H, D = q.shape
    Hkv = k_cache.shape[1]
    max_len = mask.shape[1] if isinstance(n_valid, torch.Tensor) else nv
    n_tiles = -(-max_len // _TA_TILE)
    splits = -(-n_tiles // int(tps))
    if splits > _TA3_MAX_SPLITS:
        raise ValueError(f"config {config}: {splits} splits for {max_len} slots, at most {_TA3_MAX_SPLITS}")
    rb = 16 * mt
    parts = splits * Hkv * rg * rb
    try:
        ws_o, ws_ml, _ = tree_attention_workspace(dev, parts * D, parts * 2, 1)
    except RuntimeError:
        if not default:
            raise
        # default config while capturing with no workspace yet: the cluster kernels need none
        return tree_attention(q, k_cache, v_cache, mask, n_valid, out, scale,
                              tree_attention_cluster_config(R, mask.shape[1]), pdl)
    if _TA4_PARTS != "combine":
        smem = tree_attention_smem_bytes(D, st, config)
        f = _function("tree_attention", "", name, dev, smem, False)
        args = [_ptr(q), ctypes.c_int64(q.stride(0)), _ptr(k_cache), _ptr(v_cache), ctypes.c_int64(k_cache.stride(0)),
                _ptr(mask), ctypes.c_int64(mask.stride(0)), nv_ptr, ctypes.c_int32(nv),
                ctypes.c_int32(N), ctypes.c_int32(H), ctypes.c_int32(Hkv), ctypes.c_float(scale * _LOG2E),
                ctypes.c_int32(int(tps)), _ptr(ws_o), _ptr(ws_ml)]
        (_launch_pdl if pdl else _launch)(f, (splits, Hkv, rg), threads, smem, stream, args)
    if _TA4_PARTS != "main":
        # always with PDL: it launches while the main kernel runs and waits for it before reading;
        # `early` (pdl=True calls only) lets the next kernel launch before that wait
        fc = _function("tree_attention", "", "tree_attention4_combine", dev)
        gx = -(-(rb * D // 4) // _TA4_COMBINE_ITEMS)
        cargs = [_ptr(ws_o), _ptr(ws_ml), ctypes.c_int32(splits), ctypes.c_int32(rb), ctypes.c_int32(D),
                 ctypes.c_int32(N), ctypes.c_int32(H), ctypes.c_int32(Hkv), _ptr(out), ctypes.c_int64(out.stride(0)),
                 ctypes.c_int32(1 if (early and pdl) else 0)]
        _launch_pdl(fc, (gx, Hkv, rg), 4 * _TA4_COMBINE_ITEMS, 0, stream, cargs)
    return out


def _gemm_checks(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None):
    _check_bf16("x", x, 2)
    _check_bf16("w", w, 2)
    M, K = x.shape
    N, Kw = w.shape
    if (Kw != K or not 1 <= M <= MAX_GEMM_ROWS or N % 8 or K % 8 or not w.is_contiguous() or x.stride(0) % 8
            or w.data_ptr() % 16 or x.data_ptr() % 16):
        raise ValueError(f"gemm: x {tuple(x.shape)} w {tuple(w.shape)}: need M <= {MAX_GEMM_ROWS}, "
                         "N and K multiples of 8, w contiguous, x row stride a multiple of 8, "
                         "16-byte aligned x and w")
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    else:
        _check_bf16("out", out, 2)
        if tuple(out.shape) != (M, N):
            raise ValueError(f"out must be [M, N] = {(M, N)}")
    return M, N, K, out


def gemm_rowparallel_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """Config used by default for an [M, K] x [N, K]^T product: gemm_regs_config's (T, U, PF, PIPE)."""
    return gemm_regs_config(M, N, K)


def gemm_regs_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(T, U, PF, PIPE) of the register-pipelined kernel: n-tiles of 8 W rows per block, 16-byte W
    vectors per lane and k-chunk, L2 prefetch hint (0 or 256 bytes), register double buffering of
    the W loads. gemm_allreduce runs the same config (or one with the same U: the same summation
    order), so at TP = 1 it gives gemm_rowparallel's bits.

    From the sweep on the H200 (docs/benchmarks.md, "Fused kernels (H200)"): 2 tiles per block,
    4 vectors, L2::256B prefetch, double buffering is the fastest variant for M = 1 and 8 on both
    Llama-3-8B shapes (o_proj 11.1 us, down_proj 31.5 us; 2 / 8 / 256 / 0 is ~6 % faster at M = 16).
    Two blocks fit per SM (126 registers per thread): when N / 16 blocks would fill fewer than
    3/4 of those slots on the current GPU, T = 1 doubles the blocks (Llama-3.2-1B's o_proj and
    down_proj, N = 2048: 256 blocks instead of 128 on 132 SMs). T does not change the summation
    order (U does), so the bits stay the same.
    """
    if -(-N // 16) < 1.5 * _sm_count():
        return 1, 4, 256, 1
    return 2, 4, 256, 1


_sm_counts: dict = {}


def _sm_count() -> int:
    """SMs of the current CUDA device (132 on an H200; cached per device)."""
    dev = torch.cuda.current_device() if torch.cuda.is_available() else -1
    n = _sm_counts.get(dev)
    if n is None:
        n = _sm_counts[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if dev >= 0 else 132
    return n


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
    args = [_ptr(x), ctypes.c_int64(x.stride(0)), _ptr(w), _ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K)]
    if config not in GEMM_VARIANTS:
        raise ValueError(f"config {config} must be one of {GEMM_VARIANTS}")
    t, u, pf, pipe = config
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    f = _function("gemm_allreduce", "", f"gemm_rowparallel_m{8 if M <= 8 else 16}_t{t}_u{u}_p{pf}_s{pipe}", dev)
    (_launch_pdl if pdl else _launch)(f, (-(-(N // 8) // t), 1, 1), _GEMM_THREADS, 0,
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
    _check_bf16("x", x, 2)
    _check_bf16("w", w, 2)
    M, K = x.shape
    I2, Kw = w.shape
    I = I2 // 2
    if Kw != K or I2 % 16 or not 1 <= M <= MAX_GEMM_ROWS or K % 8 or not w.is_contiguous() or x.stride(0) % 8:
        raise ValueError(f"gemm_swiglu: x {tuple(x.shape)} w {tuple(w.shape)}: need M <= {MAX_GEMM_ROWS}, "
                         "w rows 2I with I a multiple of 8, K a multiple of 8, w contiguous")
    if out is None:
        out = torch.empty((M, I), dtype=torch.bfloat16, device=x.device)
    else:
        _check_bf16("out", out, 2)
        if tuple(out.shape) != (M, I):
            raise ValueError(f"out must be [M, I] = {(M, I)}")
    if config not in (None, "regs"):
        raise ValueError(f"gemm_swiglu config must be None or 'regs', not {config!r}")
    # T = 2 (a gate and an up tile per block) and U = 4, the plain kernel's summation order, or
    # the bits would differ from silu_mul(gemm_rowparallel(x, w)).
    args = [_ptr(x), ctypes.c_int64(x.stride(0)), _ptr(w), _ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(I), ctypes.c_int32(K)]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    f = _function("gemm_allreduce", "", f"gemm_swiglu_m{8 if M <= 8 else 16}_t2_u4_p256_s1", dev)
    (_launch_pdl if pdl else _launch)(f, (I // 8, 1, 1), _GEMM_THREADS, 0,
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
    _check_bf16("x", x, 2)
    _check_bf16("w", w, 2)
    _check_bf16("qkv", qkv, 2)
    _check_bf16("k_cache", k_cache, 3)
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
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    args = [_ptr(x), ctypes.c_int64(x.stride(0)), _ptr(w), _ptr(qkv), ctypes.c_int64(qkv.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(K), _ptr(positions), _ptr(write_slots), _ptr(cos), _ptr(sin),
            ctypes.c_int32(cos.shape[0]), _ptr(k_cache), _ptr(v_cache), ctypes.c_int64(k_cache.stride(0)),
            ctypes.c_int32(S), ctypes.c_int32(n_heads), ctypes.c_int32(Hkv), ctypes.c_int32(D)]
    f = _function("gemm_allreduce", "", f"gemm_qkv_rope_m{8 if M <= 8 else 16}_u4_p256_s1{'_w4' if w4 else ''}", dev)
    (_launch_pdl if pdl else _launch)(f, (grid, 1, 1), 128 if w4 else _GEMM_THREADS, 0,
                                      torch.cuda.current_stream(dev).cuda_stream, args)


QKV_W4_DEFAULT = True


def qkv_w4_pays(blocks: int) -> bool:
    """Whether gemm_qkv_rope's default takes the 4-warp kernel ("regs-w4": 3 blocks per SM, same
    bits) for `blocks` blocks: where it needs fewer waves than the 8-warp kernel (2 per SM) and
    the latter at most 2 (with many waves the last one's waste matters little) -- the Llama-3-8B
    QKV, 384 blocks: one wave of 396 instead of 1.45 of 264 on an H200."""
    sm = _sm_count()
    regs_waves = -(-blocks // (2 * sm))
    return QKV_W4_DEFAULT and -(-blocks // (3 * sm)) < regs_waves <= 2


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
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    f = _function("gemm_allreduce", "nccl", f"gemm_allreduce_m{8 if M <= 8 else 16}_t{t}_u{u}_p{pf}_s{pipe}", dev)
    # Always the full persistent grid: block b owns tile groups b, b + n_ctas, ... on every call,
    # which the double-buffered window relies on (a block with no tile still meets its barrier).
    grid = ar.n_ctas
    args = [_ptr(x), ctypes.c_int64(x.stride(0)), _ptr(w), _ptr(out), ctypes.c_int64(out.stride(0)),
            ctypes.c_int32(M), ctypes.c_int32(N), ctypes.c_int32(K),
            ctypes.c_uint64(ar.window), _ptr(ar.dev_comm), _ptr(ar.seq)]
    _launch(f, (grid, 1, 1), _GEMM_THREADS, 0, torch.cuda.current_stream(dev).cuda_stream, args)
    return out


def devcomm_sizeof(device: int | None = None) -> int:
    """sizeof(ncclDevComm) as the kernels were compiled (checked against the shim's probe)."""
    dev = torch.cuda.current_device() if device is None else device
    f = _function("gemm_allreduce", "nccl", "nccl_devcomm_sizeof", dev)
    buf = torch.zeros(1, dtype=torch.int64, device=f"cuda:{dev}")
    _launch(f, (1, 1, 1), 1, 0, torch.cuda.current_stream(dev).cuda_stream, [_ptr(buf)])
    return int(buf.item())


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             mask: torch.Tensor, n_valid: int, scale: float | None = None) -> torch.Tensor:
    """float64 reference of tree_attention (any device): [N, H, D] float64; rows that see
    nothing are zeros."""
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
