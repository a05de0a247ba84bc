"""NCCL communicator for a tensor-parallel group on GPUs (same methods as comm.MpiGroupComm).

The group leader creates the NCCL unique id and broadcasts it over the group's MPI
communicator; every rank then joins with its own GPU. Collectives run on torch's current
stream, so they are captured by CUDA graphs with the rest of the step. Works with whichever
CuPy (cupy-cuda12x or cupy-cuda13x) and NCCL wheel is installed.
"""
from __future__ import annotations

import time

import torch

# NCCL enums (nccl.h): ncclSum = 0; ncclFloat32 = 7, ncclFloat16 = 6, ncclBfloat16 = 9
_NCCL_SUM = 0
_NCCL_DTYPE = {torch.float32: 7, torch.float16: 6, torch.bfloat16: 9}


class NcclGroupComm:
    """rank, size, seconds (host-side time inside collective launches: NCCL is asynchronous,
    so this is launch time, not transfer time — read traces of GPU runs with that in mind);
    fused_allreduce: the nccl_shim.DeviceAllReduce that the model's fused GEMM + all-reduce
    kernel uses (kernels.gemm_allreduce), or None (after enable_fused_allreduce: the reason in
    fused_allreduce_error)."""

    def __init__(self, mpi_comm):
        from cupy.cuda import nccl
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.seconds = 0.0
        self.fused_allreduce = None
        self.fused_allreduce_error: str | None = None

    def enable_fused_allreduce(self, max_n: int) -> bool:
        """Collective over the group: set up the fused GEMM + all-reduce (row-parallel o_proj and
        down_proj with N <= max_n output features in one kernel, through NCCL's device API).
        Every rank first does its own part (checks, NCCL header probe, window allocation); the
        group then agrees that all succeeded, and only then enters NCCL's collective setup, so a
        rank that fails (no NCCL >= 2.28 headers, ranks outside one NVLink domain, ...) makes the
        whole group keep the plain NCCL all-reduce instead of hanging it. True if enabled; else
        fused_allreduce_error says why (the same on every rank)."""
        from swiftspec_mpi.gpu import kernels, nccl_shim

        ar, why = None, None
        try:
            if not kernels.available():
                raise nccl_shim.NcclError("the fused CUDA kernels are unavailable (CuPy, nvcc, sm_90)")
            dev = torch.cuda.current_device()
            n_ctas = 2 * torch.cuda.get_device_properties(dev).multi_processor_count   # 2 resident per SM
            ar = nccl_shim.DeviceAllReduce(self.comm.comm, max_n=max_n, n_ctas=n_ctas, connect=False)
        except Exception as e:  # noqa: BLE001 - any local failure falls back, group-wide
            why = f"rank {self.rank}: {type(e).__name__}: {e}"
        whys = [w for w in self.mpi.allgather(why) if w]
        if whys:
            if ar is not None:
                ar.free_local()
            self.fused_allreduce_error = whys[0]
            return False
        ar.connect()
        self.fused_allreduce = ar
        return True

    def _stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group of a contiguous CUDA tensor."""
        t0 = time.perf_counter()
        self.comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), _NCCL_DTYPE[t.dtype], _NCCL_SUM,
                            self._stream())
        self.seconds += time.perf_counter() - t0
        return t

    def all_gather_lastdim(self, t: torch.Tensor) -> torch.Tensor:
        """[R, n_local] -> [R, n_local * size] (rank-major along the last dim)."""
        t0 = time.perf_counter()
        t = t.contiguous()
        R, n = t.shape
        buf = torch.empty((self.size, R, n), dtype=t.dtype, device=t.device)
        self.comm.allGather(t.data_ptr(), buf.data_ptr(), t.numel(), _NCCL_DTYPE[t.dtype], self._stream())
        self.seconds += time.perf_counter() - t0
        return buf.permute(1, 0, 2).reshape(R, self.size * n)
