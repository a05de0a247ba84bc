"""Packed weights and the AVX2 decode GEMM for the CPU path (csrc/gemm_avx2.h).

A `PackedWeight` holds one linear layer's W (nn.Linear's [out, in] = [N, K]) as 16-column
panels, float32 or bfloat16:

    data  [P = ceil(N / 16), K, 16]     data[p, k, j] = W[16 p + j, k]   (zero past N)

`linear(x [M, K] float32, w, b [N] | None) -> y [M, N] float32` computes x @ W^T + b with all
arithmetic in float32 (bf16 weights are widened exactly in registers), streaming each panel
once per step and reusing it for every row of x, so a tree of M <= 16 tokens costs little more
than one token while the bytes bound the time (see the header for the measured ratios).

Loading writes rows straight into the panels (`PackedWeight.rows(a, b)` is a write target with
`.shape` and `.copy_`), one checkpoint tensor at a time: no [N, K] temporary besides the tensor
the source hands over.
"""
from __future__ import annotations

import torch

# built by every `pip install` (setup.py): an import that fails is a broken install, not a
# machine without the kernel, so it is not caught
from swiftspec_mpi.packed import _cpu_gemm

NB = 16   # output columns per panel (the kernel's SSM_NB)
_AVX2 = _cpu_gemm.has_avx2()


def has_avx2() -> bool:
    """True when this CPU runs AVX2 + FMA, the packed kernel's instructions (checked by CPUID)."""
    return _AVX2


class RowRange:
    """Write target for rows [a, b) of a packed weight `w` (anything with `n_in`): what
    `Transformer.load_weights` fetches into. `shape` = (b - a, K); slicing gives the sub-range;
    the subclass says how rows are written."""

    def __init__(self, w, a: int, b: int):
        self.w, self.a, self.b = w, a, b
        self.shape = torch.Size((b - a, w.n_in))

    def __getitem__(self, s: slice) -> "RowRange":
        start, stop, step = s.indices(self.b - self.a)
        if step != 1:
            raise ValueError("packed rows take contiguous slices only")
        return type(self)(self.w, self.a + start, self.a + stop)


class _Rows(RowRange):
    """Rows of a PackedWeight: `copy_(t [b - a, K])` writes them into the panels."""

    def numel(self) -> int:
        return (self.b - self.a) * self.w.n_in

    def copy_(self, t: torch.Tensor) -> "_Rows":
        self.w.write_rows(self.a, t)
        return self


class PackedWeight:
    """One linear layer's weight in 16-column panels. `n_out` = N, `n_in` = K, `data` as above.
    Rows past N stay zero (the kernel never writes those outputs)."""

    def __init__(self, n_out: int, n_in: int, dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"packed weights are float32 or bfloat16, not {dtype}")
        self.n_out, self.n_in, self.dtype = int(n_out), int(n_in), dtype
        panels = (self.n_out + NB - 1) // NB
        self.data = torch.zeros(panels, self.n_in, NB, dtype=dtype)
        self.is_bf16 = dtype == torch.bfloat16

    @classmethod
    def from_dense(cls, w: torch.Tensor, dtype: torch.dtype | None = None) -> "PackedWeight":
        """Pack an nn.Linear weight w [N, K]."""
        pw = cls(w.shape[0], w.shape[1], w.dtype if dtype is None else dtype)
        pw.write_rows(0, w)
        return pw

    def rows(self, a: int = 0, b: int | None = None) -> _Rows:
        return _Rows(self, a, self.n_out if b is None else b)

    @property
    def shape(self) -> torch.Size:          # the [out, in] shape it stands for
        return torch.Size((self.n_out, self.n_in))

    def write_rows(self, a: int, t: torch.Tensor) -> None:
        """W[a : a + n] = t [n, K] (any float dtype; rounded to the stored dtype)."""
        n = t.shape[0]
        if t.dim() != 2 or t.shape[1] != self.n_in or a < 0 or a + n > self.n_out:
            raise ValueError(f"rows [{a}, {a + n}) x {list(t.shape[1:])} do not fit a packed "
                             f"[{self.n_out}, {self.n_in}] weight")
        t = t.to(self.dtype)
        d = self.data
        i = 0
        while i < n:                       # ragged head / tail: panel by panel
            r = a + i
            p, j = divmod(r, NB)
            if j == 0 and n - i >= NB:     # aligned middle: whole panels in one strided copy
                q = (n - i) // NB
                d[p:p + q].copy_(t[i:i + q * NB].view(q, NB, self.n_in).transpose(1, 2))
                i += q * NB
                continue
            m = min(NB - j, n - i)
            d[p, :, j:j + m].copy_(t[i:i + m].t())
            i += m

    def to_dense(self) -> torch.Tensor:
        """The [N, K] weight (a copy; for tests and the embedding of a tied head)."""
        return self.data.transpose(1, 2).reshape(-1, self.n_in)[:self.n_out]

    def gather_rows(self, idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """W[idx] -> [len(idx), K] in `dtype` (the embedding lookup of a tied head)."""
        p, j = idx // NB, idx % NB
        return self.data[p, :, j].to(dtype)

    def nbytes(self) -> int:
        return self.data.untyped_storage().nbytes()


def gemm_operands(x: torch.Tensor, n_in: int, n_out: int, b: torch.Tensor | None,
                  n_threads: int | None):
    """The operands every CPU GEMM call takes, checked and laid out for the kernels.

    x [M, K] (any float dtype) -> (x [M, K] float32 with contiguous rows, y [M, n_out] float32
    to write, b [n_out] float32 contiguous or None, the OpenMP thread count)."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.shape[1] != n_in:
        raise ValueError(f"x has {x.shape[1]} columns, the weight wants {n_in}")
    y = torch.empty(x.shape[0], n_out, dtype=torch.float32)
    if b is not None and (b.dtype != torch.float32 or not b.is_contiguous()):
        b = b.float().contiguous()
    nt = torch.get_num_threads() if n_threads is None else n_threads
    return x, y, b, nt


def linear(x: torch.Tensor, w: PackedWeight, b: torch.Tensor | None = None,
           n_threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous) -> x @ W^T (+ b [N] float32): [M, N] float32."""
    x, y, b, nt = gemm_operands(x, w.n_in, w.n_out, b, n_threads)
    M, K = x.shape
    _cpu_gemm.gemm_packed(w.data.data_ptr(), w.is_bf16, K, w.n_out, x.data_ptr(), x.stride(0), M,
                          y.data_ptr(), y.stride(0), 0 if b is None else b.data_ptr(), nt)
    return y
