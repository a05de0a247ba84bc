"""ctypes shim over NCCL's host API for what CuPy does not wrap: symmetric memory windows
(`ncclMemAlloc`, `ncclCommWindowRegister`) and device communicators (`ncclDevCommCreate`), which
the fused GEMM + all-reduce kernel (cuda/gemm_allreduce.cu) needs; plus the few plain calls
(unique id, communicator init, all-reduce) used to set one up and to time against.

It loads the libnccl.so.2 of the installed `nvidia-nccl-cu12` / `nvidia-nccl-cu13` wheel (the
same file torch and CuPy load, so communicator handles are interchangeable), or the file named
by `NCCL_LIBRARY`. Struct layouts that change between NCCL versions (`ncclDevCommRequirements`
grew a size/magic/version header in 2.29 and more fields since) are not hard-coded: a tiny host
program compiled once with nvcc against the headers of the same wheel prints the layout and
the initializer bytes (cached under ~/.cache/swiftspec_mpi/). Needs NCCL >= 2.28.

Typical use, one process per GPU of a tensor-parallel group (ids broadcast over MPI):

    nccl = get_nccl()
    uid = nccl.get_unique_id() if rank == 0 else None
    uid = mpi_comm.bcast(uid, root=0)
    comm = nccl.comm_init_rank(world, uid, rank)         # on the current CUDA device
    ar = DeviceAllReduce(comm, max_n=4096, n_ctas=2 * n_sms)
    kernels.gemm_allreduce(x, w, ar, out=y)               # y = all_reduce(x @ w.T)
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

NCCL_WIN_COLL_SYMMETRIC = 0x01
NCCL_SUM = 0
NCCL_FLOAT32 = 7
NCCL_BFLOAT16 = 9
_MIN_VERSION = 22800  # 2.28.0: first release with the device API


class NcclError(RuntimeError):
    """A failed NCCL call: the function, the NCCL result code and NCCL's own message."""


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class NcclTeam(ctypes.Structure):
    _fields_ = [("nRanks", ctypes.c_int), ("rank", ctypes.c_int), ("stride", ctypes.c_int)]


def _nccl_package_dirs() -> list[Path]:
    """Folders of the installed nvidia-nccl wheel (namespace package nvidia.nccl), if any."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])]


def nccl_include_dir() -> str | None:
    """Folder holding nccl.h and nccl_device.h: $NCCL_INCLUDE, else the nvidia-nccl wheel's
    include/, else $NCCL_HOME/include, $CUDA_HOME/include, /usr/include. None if none has
    nccl_device.h (NCCL < 2.28 or not installed)."""
    cands = []
    if os.environ.get("NCCL_INCLUDE"):
        cands.append(Path(os.environ["NCCL_INCLUDE"]))
    cands += [d / "include" for d in _nccl_package_dirs()]
    for var in ("NCCL_HOME", "CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands += [Path("/usr/local/cuda/include"), Path("/usr/include")]
    for c in cands:
        if (c / "nccl.h").is_file() and (c / "nccl_device.h").is_file():
            return str(c)
    return None


def nccl_library_path() -> str | None:
    """libnccl.so.2 to load: $NCCL_LIBRARY, else the nvidia-nccl wheel's lib/, else None (then
    the dynamic loader's search path is used)."""
    if os.environ.get("NCCL_LIBRARY"):
        return os.environ["NCCL_LIBRARY"]
    for d in _nccl_package_dirs():
        p = d / "lib" / "libnccl.so.2"
        if p.is_file():
            return str(p)
    return None


def header_version(include_dir: str) -> int:
    """NCCL_VERSION_CODE of the headers in include_dir (e.g. 22809 for 2.28.9)."""
    major = minor = patch = None
    for line in (Path(include_dir) / "nccl.h").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define":
            if parts[1] == "NCCL_MAJOR":
                major = int(parts[2])
            elif parts[1] == "NCCL_MINOR":
                minor = int(parts[2])
            elif parts[1] == "NCCL_PATCH":
                patch = int(parts[2])
    if None in (major, minor, patch):
        raise NcclError(f"cannot read NCCL_MAJOR/MINOR/PATCH from {include_dir}/nccl.h")
    if (major, minor) > (2, 8):
        return major * 10000 + minor * 100 + patch
    return major * 1000 + minor * 100 + patch


_PROBE_SRC = r"""
#include <cstdio>
#include <cstddef>
#include <cstring>
#include <nccl.h>
#include <nccl_device.h>
int main() {
#ifdef NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER
  ncclDevCommRequirements_t r = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  ncclDevCommRequirements_t r;
  memset(&r, 0, sizeof(r));
#endif
  std::printf("{\"version\": %d, \"req_size\": %zu, \"lsa_barrier_count_offset\": %zu, "
              "\"devcomm_size\": %zu, \"req_bytes\": \"",
              (int)NCCL_VERSION_CODE, sizeof(r), offsetof(ncclDevCommRequirements_t, lsaBarrierCount),
              sizeof(ncclDevComm));
  for (size_t i = 0; i < sizeof(r); ++i) std::printf("%02x", ((const unsigned char*)&r)[i]);
  std::printf("\"}\n");
  return 0;
}
"""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    d = Path(base) / "swiftspec_mpi"
    d.mkdir(parents=True, exist_ok=True)
    return d


def probe_layout(include_dir: str, nvcc: str | None = None) -> dict:
    """Layout of ncclDevCommRequirements / ncclDevComm for the headers in include_dir, from a host
    program built with nvcc (cached by the headers' content). Keys: version, req_size,
    lsa_barrier_count_offset, devcomm_size, req_bytes (hex of the initializer, or zeros)."""
    inc = Path(include_dir)
    h = hashlib.sha256(_PROBE_SRC.encode())
    for f in sorted(inc.rglob("*.h")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    cache = _cache_dir() / f"nccl_layout-{h.hexdigest()[:16]}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    nvcc = nvcc or shutil.which("nvcc") or (
        str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"))
    if not Path(nvcc).exists() and shutil.which(nvcc) is None:
        raise NcclError("nvcc not found: it is needed once to read the NCCL struct layouts; "
                        "put CUDA's bin/ on PATH or set CUDA_HOME")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.cu", Path(tmp) / "probe"
        src.write_text(_PROBE_SRC)
        r = subprocess.run([nvcc, "-std=c++17", "-I", include_dir, str(src), "-o", str(exe)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise NcclError(f"building the NCCL layout probe failed:\n{r.stderr}")
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    layout = json.loads(out)
    tmpf = cache.with_suffix(f".tmp{os.getpid()}")
    tmpf.write_text(json.dumps(layout))
    tmpf.replace(cache)
    return layout


class Nccl:
    """ctypes bindings of one libnccl.so.2. All calls raise NcclError on failure."""

    def __init__(self, path: str | None = None):
        self.path = path or nccl_library_path() or "libnccl.so.2"
        try:
            self.lib = ctypes.CDLL(self.path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise NcclError(f"cannot load {self.path}: {e}; install nvidia-nccl-cu12/cu13 "
                            "(>= 2.28) or set NCCL_LIBRARY") from e
        L, vp, c_int, c_size = self.lib, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        L.ncclGetErrorString.restype = ctypes.c_char_p
        L.ncclGetErrorString.argtypes = [c_int]
        L.ncclGetLastError.restype = ctypes.c_char_p
        L.ncclGetLastError.argtypes = [vp]
        L.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
        L.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]
        L.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), c_int, NcclUniqueId, c_int]
        L.ncclCommFinalize.argtypes = [vp]
        L.ncclCommDestroy.argtypes = [vp]
        L.ncclCommCount.argtypes = [vp, ctypes.POINTER(c_int)]
        L.ncclCommUserRank.argtypes = [vp, ctypes.POINTER(c_int)]
        L.ncclMemAlloc.argtypes = [ctypes.POINTER(vp), c_size]
        L.ncclMemFree.argtypes = [vp]
        L.ncclCommWindowRegister.argtypes = [vp, vp, c_size, ctypes.POINTER(vp), c_int]
        L.ncclCommWindowDeregister.argtypes = [vp, vp]
        L.ncclDevCommCreate.argtypes = [vp, vp, vp]
        L.ncclDevCommDestroy.argtypes = [vp, vp]
        L.ncclTeamLsa.restype = NcclTeam
        L.ncclTeamLsa.argtypes = [vp]
        L.ncclAllReduce.argtypes = [vp, vp, c_size, c_int, c_int, vp, vp]
        for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommFinalize",
                     "ncclCommDestroy", "ncclCommCount", "ncclCommUserRank", "ncclMemAlloc",
                     "ncclMemFree", "ncclCommWindowRegister", "ncclCommWindowDeregister",
                     "ncclDevCommCreate", "ncclDevCommDestroy", "ncclAllReduce"):
            getattr(L, name).restype = c_int

    def _check(self, name: str, res: int, comm=None) -> None:
        if res != 0:
            msg = self.lib.ncclGetErrorString(res).decode(errors="replace")
            last = self.lib.ncclGetLastError(comm).decode(errors="replace") if comm is not None else ""
            raise NcclError(f"{name} failed: NCCL error {res} ({msg}){': ' + last if last else ''}")

    def version(self) -> int:
        """Library version code, e.g. 22809 for 2.28.9."""
        v = ctypes.c_int()
        self._check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(v)))
        return v.value

    def get_unique_id(self) -> bytes:
        """128 bytes to broadcast (e.g. over MPI) to every rank of the new communicator."""
        uid = NcclUniqueId()
        self._check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return ctypes.string_at(ctypes.addressof(uid), 128)

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int) -> int:
        """ncclComm_t (as int) on the current CUDA device. Collective over the nranks ranks."""
        uid = NcclUniqueId()
        ctypes.memmove(ctypes.byref(uid), bytes(unique_id), 128)
        comm = ctypes.c_void_p()
        self._check("ncclCommInitRank", self.lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank))
        return comm.value

    def comm_destroy(self, comm: int) -> None:
        self._check("ncclCommFinalize", self.lib.ncclCommFinalize(comm), comm)
        self._check("ncclCommDestroy", self.lib.ncclCommDestroy(comm))

    def comm_count(self, comm: int) -> int:
        n = ctypes.c_int()
        self._check("ncclCommCount", self.lib.ncclCommCount(comm, ctypes.byref(n)), comm)
        return n.value

    def comm_rank(self, comm: int) -> int:
        r = ctypes.c_int()
        self._check("ncclCommUserRank", self.lib.ncclCommUserRank(comm, ctypes.byref(r)), comm)
        return r.value

    def team_lsa(self, comm: int) -> tuple[int, int, int]:
        """(nRanks, rank, stride) of this rank's load/store-accessible team (its NVLink domain)."""
        t = self.lib.ncclTeamLsa(comm)
        return t.nRanks, t.rank, t.stride

    def mem_alloc(self, nbytes: int) -> int:
        """Device memory usable for symmetric windows (cuMem-backed); free with mem_free."""
        p = ctypes.c_void_p()
        self._check("ncclMemAlloc", self.lib.ncclMemAlloc(ctypes.byref(p), nbytes))
        return p.value

    def mem_free(self, ptr: int) -> None:
        self._check("ncclMemFree", self.lib.ncclMemFree(ptr))

    def window_register(self, comm: int, ptr: int, nbytes: int, flags: int = NCCL_WIN_COLL_SYMMETRIC) -> int:
        """ncclWindow_t (a device pointer, as int). Collective: same size on every rank."""
        win = ctypes.c_void_p()
        self._check("ncclCommWindowRegister",
                    self.lib.ncclCommWindowRegister(comm, ptr, nbytes, ctypes.byref(win), flags), comm)
        return win.value

    def window_deregister(self, comm: int, win: int) -> None:
        self._check("ncclCommWindowDeregister", self.lib.ncclCommWindowDeregister(comm, win), comm)

    def dev_comm_create(self, comm: int, lsa_barrier_count: int, layout: dict) -> ctypes.Array:
        """ncclDevComm (host bytes, layout['devcomm_size'] long) with lsa_barrier_count LSA
        barriers. Collective. `layout` comes from probe_layout() on this library's headers."""
        req = (ctypes.c_ubyte * layout["req_size"]).from_buffer_copy(bytes.fromhex(layout["req_bytes"]))
        ctypes.c_int.from_buffer(req, layout["lsa_barrier_count_offset"]).value = lsa_barrier_count
        out = (ctypes.c_ubyte * max(layout["devcomm_size"], 8))()
        self._check("ncclDevCommCreate", self.lib.ncclDevCommCreate(comm, ctypes.byref(req), ctypes.byref(out)), comm)
        return out

    def dev_comm_destroy(self, comm: int, dev_comm: ctypes.Array) -> None:
        self._check("ncclDevCommDestroy", self.lib.ncclDevCommDestroy(comm, ctypes.byref(dev_comm)), comm)

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int,
                   op: int = NCCL_SUM) -> None:
        """Plain ncclAllReduce on `stream` (used as the baseline the fused kernel is timed against)."""
        self._check("ncclAllReduce", self.lib.ncclAllReduce(send, recv, count, dtype, op, comm, stream), comm)


def loaded_nccl_libraries() -> list[str]:
    """Distinct libnccl files mapped into this process (Linux /proc/self/maps; [] elsewhere).
    Two different ones mean a communicator made by one (e.g. CuPy's) must not be handed to the
    other (this shim): set NCCL_LIBRARY to the file CuPy / torch use."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libnccl.so" in line}
    except OSError:
        return []
    return sorted({os.path.realpath(p) for p in paths if p.startswith("/")})


_NCCL: Nccl | None = None


def get_nccl() -> Nccl:
    """The process-wide Nccl (loaded once); checks the version is >= 2.28."""
    global _NCCL
    if _NCCL is None:
        n = Nccl()
        v = n.version()
        if v < _MIN_VERSION:
            raise NcclError(f"NCCL {v} is too old for the device API; install nvidia-nccl-cu12/cu13 >= 2.28")
        _NCCL = n
    return _NCCL


class DeviceAllReduce:
    """Everything the fused GEMM + all-reduce kernel needs on one rank, created collectively:

    - a symmetric window of `2 * max_n * 16 * 4` bytes (fp32 partials, double-buffered),
      allocated with ncclMemAlloc and registered with NCCL_WIN_COLL_SYMMETRIC;
    - an ncclDevComm with `n_ctas` LSA barriers (one per CTA of the persistent grid), and a
      device copy of it (`dev_comm`, a uint8 CUDA tensor) that the kernel reads;
    - `seq`: int32 [n_ctas] per-CTA call counters on the device (buffer parity).

    `comm` is an ncclComm_t as int: from Nccl.comm_init_rank, or CuPy's
    `NcclCommunicator.comm` when CuPy loaded the same libnccl (checked). Every rank of `comm`
    must create it with the same max_n / n_ctas, and launch the fused kernel the same number
    of times (the grid is always n_ctas). All ranks must be in one LSA team
    (one NVLink domain); n_ctas must not exceed what the GPU keeps resident at once (the
    kernel's blocks wait for each other across ranks). Call close() (collective) to free.

    With connect=False the constructor does only this rank's part (checks, header probe, window
    allocation: anything that can fail on one rank alone) and no collective call; connect()
    (collective) then registers the window and creates the device communicator. A group agrees
    between the two steps that every rank succeeded (nccl_comm.NcclGroupComm
    .enable_fused_allreduce), so that no rank enters a collective that another will never join.
    """

    def __init__(self, comm: int, *, max_n: int, n_ctas: int, device=None, nccl: Nccl | None = None,
                 connect: bool = True):
        import torch

        self.nccl = nccl or get_nccl()
        libs = loaded_nccl_libraries()
        if len(libs) > 1:
            raise NcclError(f"two different NCCL libraries are loaded ({', '.join(libs)}); set "
                            "NCCL_LIBRARY to the one that made the communicator")
        self.comm = comm
        self.nranks = self.nccl.comm_count(comm)
        self.rank = self.nccl.comm_rank(comm)
        lsa_n, _, _ = self.nccl.team_lsa(comm)
        if lsa_n != self.nranks:
            raise NcclError(f"the fused all-reduce needs all {self.nranks} ranks in one NVLink (LSA) "
                            f"team, but this rank's team has {lsa_n}; use the plain NCCL all-reduce")
        inc = nccl_include_dir()
        if inc is None:
            raise NcclError("nccl_device.h not found: install nvidia-nccl-cu12/cu13 >= 2.28 or set NCCL_INCLUDE")
        self.layout = probe_layout(inc)
        lib_v, hdr_v = self.nccl.version(), self.layout["version"]
        if lib_v // 100 != hdr_v // 100:
            raise NcclError(f"libnccl {lib_v} and headers {hdr_v} ({inc}) differ; point NCCL_LIBRARY "
                            "and NCCL_INCLUDE at the same NCCL")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.max_n = max_n
        self.n_ctas = n_ctas
        self.window_bytes = 2 * max_n * 16 * 4
        self.window = None
        self._ptr = self.nccl.mem_alloc(self.window_bytes)
        self.seq = torch.zeros(n_ctas, dtype=torch.int32, device=self.device)
        if connect:
            self.connect()

    def connect(self) -> None:
        """Collective: register the window (symmetric) and create the device communicator."""
        import torch

        self.window = self.nccl.window_register(self.comm, self._ptr, self.window_bytes)
        self._host_dev_comm = self.nccl.dev_comm_create(self.comm, self.n_ctas, self.layout)
        host = torch.frombuffer(bytearray(bytes(self._host_dev_comm)), dtype=torch.uint8)
        self.dev_comm = host.to(self.device)
        torch.cuda.synchronize(self.device)

    def free_local(self) -> None:
        """Free what the constructor allocated, for a DeviceAllReduce never connected (not
        collective)."""
        if self.window is None and self._ptr:
            self.nccl.mem_free(self._ptr)
            self._ptr = 0

    def close(self) -> None:
        """Collective: destroy the device communicator and free the window."""
        if self.window is None:
            self.free_local()
            return
        import torch

        torch.cuda.synchronize(self.device)
        self.nccl.dev_comm_destroy(self.comm, self._host_dev_comm)
        self.nccl.window_deregister(self.comm, self.window)
        self.nccl.mem_free(self._ptr)
        self._ptr = 0
        self.window = None
