"""The CuPy/ctypes launch layer of the fused CUDA kernels: compile cuda/*.cu, look up functions,
launch them on torch tensors.

The sources live in cuda/*.cu (package data `swiftspec_mpi.cuda`). They are compiled with nvcc
through `cupy.RawModule(code=..., backend="nvcc")` (NVRTC cannot compile NCCL's device headers)
once per process and device, and CuPy keeps the cubin in its on-disk cache (CUPY_CACHE_DIR,
default ~/.cupy/kernel_cache), so later processes only load it. Kernels are launched with
cuLaunchKernel (or cuLaunchKernelEx for programmatic dependent launch) on torch tensors' data
pointers, on `torch.cuda.current_stream()`, so they order with torch's work and can be captured
in CUDA graphs.

Call `available()` first; every other function assumes it returned True. The kernel wrappers
are in gpu/kernels.py (GEMVs), gpu/tree_attention.py and gpu/fused_ops.py.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import torch

from swiftspec_mpi.core import switches

_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14

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


_LOCAL_HEADER = re.compile(r'^#include "(\w+\.cuh)"$', re.M)


def cuda_source(name: str) -> str:
    """Text of cuda/<name>.cu with each local header it includes (`#include "x.cuh"`, a file of
    cuda/) pasted in place: what RawModule compiles, so CuPy's cache key covers the headers too."""
    folder = cuda_source_dir()
    return _LOCAL_HEADER.sub(lambda m: (folder / m.group(1)).read_text(), (folder / f"{name}.cu").read_text())


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


def module(name: str, variant: str, device: int):
    """Compiled RawModule of cuda/<name>.cu for `device` (variant "nccl" adds NCCL's device API,
    a variant "-DNAME=VALUE [-DNAME2=VALUE2 ...]" those defines).
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
            if switches.flag("SWIFTSPEC_KERNELS_LINEINFO"):
                opts.append("-lineinfo")
            if variant.startswith("-D"):        # compile-time settings of the source (defines)
                opts += variant.split()
            elif variant == "nccl":
                from swiftspec_mpi.gpu import nccl_shim   # its own import of cupy/ctypes: only for NCCL builds

                inc = nccl_shim.nccl_include_dir()
                if inc is None:
                    raise RuntimeError("nccl_device.h not found: install nvidia-nccl-cu12/cu13 >= 2.28 "
                                       "or set NCCL_INCLUDE")
                # The version define makes CuPy's cache key (source + options) follow the headers.
                opts += ["-I" + inc, "-DSWIFTSPEC_WITH_NCCL",
                         f"-DSWIFTSPEC_NCCL_VERSION={nccl_shim.header_version(inc)}"]
            code = cuda_source(name)
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


def function(name: str, variant: str, kernel: str, device: int, dyn_smem: int = 0,
             nonportable_cluster: bool = False) -> int:
    """The CUfunction of `kernel` in cuda/<name>.cu (compiled for `device` on first use), with its
    dynamic shared memory limit raised to `dyn_smem` and, if asked, non-portable cluster sizes."""
    key = (name, variant, kernel, device)
    f = _functions.get(key)
    if f is None:
        cupy = import_cupy()
        from cupy.cuda import driver

        mod = module(name, variant, device)
        with cupy.cuda.Device(device):
            f = mod.get_function(kernel).kernel.ptr
            if dyn_smem > 48 * 1024:
                driver.funcSetAttribute(f, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn_smem)
            if nonportable_cluster:
                driver.funcSetAttribute(f, _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        _functions[key] = f
    return f


_launch_kernel = None


def launch(f: int, grid: tuple, block: int, smem: int, stream: int, args: list) -> None:
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


def launch_pdl(f: int, grid: tuple, block: int, smem: int, stream: int, args: list) -> None:
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


def ptr(t: torch.Tensor) -> ctypes.c_uint64:
    """A tensor's data pointer as a kernel argument."""
    return ctypes.c_uint64(t.data_ptr())


def check_bf16(name: str, t: torch.Tensor, ndim: int) -> None:
    """ValueError unless `t` is an `ndim`-d bfloat16 CUDA tensor, last dim contiguous, 16-byte aligned."""
    if not t.is_cuda or t.dtype != torch.bfloat16 or t.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-d bfloat16 CUDA tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        raise ValueError(f"{name} must have a contiguous last dim and a 16-byte aligned start")


def device_index(t: torch.Tensor) -> int:
    """The CUDA device index of tensor `t` (the current device when it has none)."""
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


_sm_counts: dict = {}


def sm_count() -> int:
    """SMs of the current CUDA device (132 on an H200; cached per device)."""
    dev = torch.cuda.current_device() if torch.cuda.is_available() else -1
    n = _sm_counts.get(dev)
    if n is None:
        n = _sm_counts[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if dev >= 0 else 132
    return n
