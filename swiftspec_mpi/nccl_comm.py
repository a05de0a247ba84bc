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
    so this is launch time, not transfer time — read traces of GPU runs with that in mind)."""

    def __init__(self, mpi_comm):
        from cupy.cuda import nccl
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.seconds = 0.0

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
