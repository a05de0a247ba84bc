"""Tensor-parallel communicators injected into `Transformer` (one per TP group).

The model only ever calls `all_reduce_(t)` (sum, in place) and `all_gather_lastdim(t)`, and reads
`rank` / `size`. `seconds` accumulates the wall time spent inside collectives; callers (the trace)
read and reset it. A NCCL communicator with the same methods lives with the GPU code.
"""
from __future__ import annotations

import time

import torch


class SingleComm:
    """TP degree 1: every collective is the identity."""
    rank = 0
    size = 1

    def __init__(self):
        self.seconds = 0.0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather_lastdim(self, t: torch.Tensor) -> torch.Tensor:
        return t


# dtypes MPI reduces natively through a numpy view (float16/bfloat16 go through float32)
_TORCH_TO_NP_OK = {torch.float32, torch.float64, torch.int32, torch.int64}


class MpiGroupComm:
    """CPU tensor parallelism over an mpi4py intra-communicator (the TP group).

    all_reduce_: zero-copy, in place (numpy view of the tensor + MPI.IN_PLACE). bfloat16 has no
    MPI type, so it goes through a float32 staging buffer that is grown once and then reused
    (no allocation per call after warm-up; the sum is exact-ish: float32 accumulation).
    all_gather_lastdim: [R, n_local] -> [R, n_local * size] (rank r's block at columns
    [r*n_local, (r+1)*n_local)); the result is a fresh tensor, the receive buffer is cached
    per shape.
    """

    def __init__(self, mpi_comm, peers: str = "a rank of this group"):
        from mpi4py import MPI
        self._MPI = MPI
        self.comm = mpi_comm
        self.peers = peers            # who the others are, for the message when one is lost
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.seconds = 0.0
        self._stage = torch.empty(0, dtype=torch.float32)
        self._gather_bufs: dict = {}

    def _staging(self, n: int) -> torch.Tensor:
        if self._stage.numel() < n:
            self._stage = torch.empty(max(n, 2 * self._stage.numel()), dtype=torch.float32)
        return self._stage[:n]

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` (contiguous, CPU) over the group, in place; returns `t`."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        try:
            if t.dtype in _TORCH_TO_NP_OK:
                self.comm.Allreduce(self._MPI.IN_PLACE, t.numpy())
            else:  # bfloat16 / float16 (no portable MPI type): float32 staging
                s = self._staging(t.numel())
                s.copy_(t.reshape(-1))
                self.comm.Allreduce(self._MPI.IN_PLACE, s.numpy())
                t.view(-1).copy_(s)
        except self._MPI.Exception as exc:
            raise self.lost(exc) from None
        self.seconds += time.perf_counter() - t0
        return t

    def all_gather_lastdim(self, t: torch.Tensor) -> torch.Tensor:
        """[R, n_local] -> [R, n_local * size]: the ranks' blocks side by side (rank order)."""
        if self.size == 1:
            return t
        t0 = time.perf_counter()
        R, n = t.shape
        send = t.contiguous()
        if send.dtype not in _TORCH_TO_NP_OK:
            send = send.float()
        out = torch.empty((R, self.size * n), dtype=send.dtype)  # fresh: callers may keep it
        try:
            self._gather(send, out, R, n)
        except self._MPI.Exception as exc:
            raise self.lost(exc) from None
        self.seconds += time.perf_counter() - t0
        return out

    def lost(self, exc) -> Exception:
        """A collective failed (a member's process died, its connection reset): the PeerError
        that names the group's other ranks."""
        from swiftspec_mpi.core.errors import PeerError
        detail = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return PeerError(f"a tensor-parallel collective with {self.peers} failed, so that rank died "
                         f"or its node cannot be reached (MPI: {detail[-1] if detail else exc})")

    def _gather(self, send: torch.Tensor, out: torch.Tensor, R: int, n: int) -> None:
        if R == 1:  # [size, 1, n] is already [1, size*n]
            self.comm.Allgather(send.numpy(), out.numpy())
        else:
            key = (R, n, send.dtype)
            recv = self._gather_bufs.get(key)
            if recv is None:
                if len(self._gather_bufs) >= 64:  # tree sizes vary; keep the cache bounded
                    self._gather_bufs.pop(next(iter(self._gather_bufs)))
                recv = self._gather_bufs[key] = torch.empty((self.size, R, n), dtype=send.dtype)
            self.comm.Allgather(send.numpy(), recv.numpy())
            out.view(R, self.size, n).copy_(recv.transpose(0, 1))
