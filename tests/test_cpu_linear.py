"""The packed-weight AVX2 GEMM (swiftspec_mpi/csrc/gemm_avx2.h via cpu_linear): every row count
the decode path uses (1..16, and prefill-sized), ragged column counts (N % 16 != 0), K not a
multiple of the k-block, float32 and bfloat16 storage, bias, strided x, threads; checked against
a float64 reference on fresh random data, plus the packing helpers."""
from __future__ import annotations

import pytest
import torch

from conftest import skip_or_fail
from swiftspec_mpi.packed import cpu_linear


@pytest.fixture(autouse=True)
def _cpu_runs_the_kernel():
    """A machine condition: the kernel needs AVX2 + FMA (the extension itself always imports)."""
    if not cpu_linear.has_avx2():
        skip_or_fail("this CPU lacks AVX2 + FMA, the packed CPU kernel's instructions")


def reference(x, w_dense, b):
    y = x.double() @ w_dense.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 13, 16, 67])
@pytest.mark.parametrize("N,K", [(16, 16), (37, 50), (96, 1030), (203, 517)])
def test_matches_float64(M, N, K, wdtype):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, generator=g)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if (M + N) % 2 else None
    pw = cpu_linear.PackedWeight.from_dense(w, wdtype)
    y = cpu_linear.linear(x, pw, b)
    assert y.shape == (M, N) and y.dtype == torch.float32
    ref = reference(x, w.to(wdtype).float(), b)   # the stored (rounded) weights, exact math
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-6 * K ** 0.5 * 4, err
    assert ref.abs().max().item() > 1.0


def test_strided_rows_and_threads():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(80, 300, generator=g)
    big = torch.randn(6, 400, generator=g)
    x = big[:, 50:350]                       # row stride 400, not contiguous as a whole
    pw = cpu_linear.PackedWeight.from_dense(w)
    ref = reference(x, w, None)
    for nt in (1, 2):
        y = cpu_linear.linear(x, pw, None, n_threads=nt)
        assert (y.double() - ref).abs().max().item() < 1e-4


def test_row_writes_in_pieces_equal_dense_pack():
    """Loading writes arbitrary row ranges (q, then KV runs...); any split packs the same."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(75, 33, generator=g)
    whole = cpu_linear.PackedWeight.from_dense(w)
    pieces = cpu_linear.PackedWeight(75, 33)
    rows = pieces.rows()
    for a, b in [(0, 5), (5, 21), (21, 22), (22, 64), (64, 75)]:
        rows[a:b].copy_(w[a:b])
    assert torch.equal(pieces.data, whole.data)
    assert torch.equal(pieces.to_dense(), w)
    assert pieces.data[4, :, 11:].abs().sum() == 0          # rows past N stay zero
    idx = torch.tensor([0, 15, 16, 74, 3])
    assert torch.equal(pieces.gather_rows(idx), w[idx])


def test_bad_shapes_are_refused():
    pw = cpu_linear.PackedWeight(20, 8)
    with pytest.raises(ValueError, match="do not fit"):
        pw.rows()[15:20].copy_(torch.zeros(5, 9))
    with pytest.raises(ValueError, match="columns"):
        cpu_linear.linear(torch.zeros(2, 7), pw)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_linear.PackedWeight(4, 4, torch.float16)
