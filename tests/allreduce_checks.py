"""Checks of the fused GEMM + all-reduce kernels on a 1-rank NCCL communicator (GPU tests)."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from swiftspec_mpi.gpu import nccl_shim


@contextmanager
def single_rank_allreduce(max_n: int, n_ctas: int):
    """A DeviceAllReduce over a 1-rank NCCL communicator, closed (and the communicator destroyed)
    on exit; skips when NCCL >= 2.28 headers are absent or this NCCL gives no device
    communicator on one rank."""
    if nccl_shim.nccl_include_dir() is None:
        pytest.skip("no NCCL >= 2.28 headers")
    nccl = nccl_shim.get_nccl()
    comm = nccl.comm_init_rank(1, nccl.get_unique_id(), 0)
    try:
        ar = nccl_shim.DeviceAllReduce(comm, max_n=max_n, n_ctas=n_ctas)
    except nccl_shim.NcclError as e:
        nccl.comm_destroy(comm)
        pytest.skip(f"this NCCL gives no device communicator on 1 rank: {e}")
    try:
        yield ar
    finally:
        ar.close()
        nccl.comm_destroy(comm)


def assert_fused_equals_plain(launch, out: torch.Tensor, plain: torch.Tensor, what: str) -> None:
    """`launch()` writes `out` [M, N] bf16: three eager calls (both halves of the all-reduce's
    window) and three replays of a CUDA graph of it, each over a NaN-filled `out`, must give
    exactly `plain` [M, N] (the all-reduce of one partial is the identity)."""
    for _ in range(3):
        out.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        assert torch.equal(out, plain), what
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain), f"{what}, graph replay"
