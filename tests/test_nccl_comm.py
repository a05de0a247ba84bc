"""NcclGroupComm.enable_fused_allreduce: the group-wide agreement before NCCL's collective setup
(no GPU needed: the device communicator is a stand-in; the real one runs in
tests/test_fused_ops_gpu.py::test_model_with_fused_allreduce_equals_plain).

A rank that cannot set up the fused all-reduce must make every rank of its group fall back
to NCCL's all-reduce, never leave the others waiting in a collective it will not join."""
from __future__ import annotations

import pytest

import torch

from swiftspec_mpi.core import switches  # noqa: E402
from swiftspec_mpi.core.errors import UserError  # noqa: E402
from swiftspec_mpi.gpu import kernels, nccl_comm, nccl_shim  # noqa: E402


class _FakeMpi:
    """The group's MPI communicator as seen by one rank: allgather returns this rank's value
    with the other ranks' values (given) around it."""

    def __init__(self, rank, others):
        self.rank, self.others = rank, others

    def allgather(self, value):
        out = list(self.others)
        out.insert(self.rank, value)
        return out


class _FakeDeviceAllReduce:
    made: list = []

    def __init__(self, comm, *, max_n, n_ctas, connect=True):
        assert connect is False, "the collective part must wait for the agreement"
        self.max_n, self.n_ctas, self.connected, self.freed = max_n, n_ctas, False, False
        _FakeDeviceAllReduce.made.append(self)

    def connect(self):
        self.connected = True

    def free_local(self):
        self.freed = True


class _FailingDeviceAllReduce(_FakeDeviceAllReduce):
    def __init__(self, comm, **kw):
        raise nccl_shim.NcclError("nccl_device.h not found")


def _group_comm(rank, others):
    c = nccl_comm.NcclGroupComm.__new__(nccl_comm.NcclGroupComm)
    c.mpi, c.rank, c.size = _FakeMpi(rank, others), rank, len(others) + 1
    c.comm = type("CupyComm", (), {"comm": 1234})()
    c.fused_allreduce, c.fused_allreduce_error = None, None
    return c


@pytest.fixture
def gpu_standin(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"multi_processor_count": 132})())
    _FakeDeviceAllReduce.made = []


def test_all_ranks_ready_connects(gpu_standin, monkeypatch):
    monkeypatch.setattr(nccl_shim, "DeviceAllReduce", _FakeDeviceAllReduce)
    c = _group_comm(1, [None, None, None])
    assert c.enable_fused_allreduce(4096)
    ar = c.fused_allreduce
    assert ar.connected and not ar.freed and (ar.max_n, ar.n_ctas) == (4096, 264)
    assert c.fused_allreduce_error is None


def test_another_rank_failing_makes_this_one_fall_back(gpu_standin, monkeypatch):
    monkeypatch.setattr(nccl_shim, "DeviceAllReduce", _FakeDeviceAllReduce)
    c = _group_comm(0, ["rank 1: NcclError: not one NVLink domain"])
    assert not c.enable_fused_allreduce(4096)
    (ar,) = _FakeDeviceAllReduce.made
    assert not ar.connected and ar.freed, "no collective setup, the local window freed"
    assert c.fused_allreduce is None
    assert c.fused_allreduce_error == "rank 1: NcclError: not one NVLink domain"


def test_this_rank_failing_reports_why(gpu_standin, monkeypatch):
    monkeypatch.setattr(nccl_shim, "DeviceAllReduce", _FailingDeviceAllReduce)
    c = _group_comm(1, [None])
    assert not c.enable_fused_allreduce(2048)
    assert c.fused_allreduce is None
    assert c.fused_allreduce_error == "rank 1: NcclError: nccl_device.h not found"


def test_no_kernels_falls_back(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    c = _group_comm(0, [None])
    assert not c.enable_fused_allreduce(2048)
    assert "fused CUDA kernels are unavailable" in c.fused_allreduce_error


def test_switch(monkeypatch):
    monkeypatch.delenv("SWIFTSPEC_FUSED_ALLREDUCE", raising=False)
    assert not switches.flag("SWIFTSPEC_FUSED_ALLREDUCE")
    monkeypatch.setenv("SWIFTSPEC_FUSED_ALLREDUCE", "1")
    assert switches.flag("SWIFTSPEC_FUSED_ALLREDUCE")
    switches.check_all()
    monkeypatch.setenv("SWIFTSPEC_FUSED_ALLREDUCE", "fast")
    with pytest.raises(UserError, match="SWIFTSPEC_FUSED_ALLREDUCE"):
        switches.check_all()
