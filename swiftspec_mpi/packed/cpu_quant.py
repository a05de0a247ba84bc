"""Packed 4-/6-/8-bit linear layers on the CPU: kernel records (csrc/gemm_q.h), layers made of
row segments, and the quantized embedding table.

    QuantPanels(n_out, n_in, kind, group, has_offset)   one weight in the kernel's records:
        kind 'q4' | 'q8' (a record per (panel, group)), 'k4' | 'k6' (GGUF Q4_K / Q6_K in their
        two levels, a record per (panel, 256 inputs))
        blob uint8 [P = ceil(N / 16), records along K, S]   (layouts in csrc/gemm_q.h)
        write_rows(a, w)                                w: PackedInt4 | PackedInt8 rows [a, a+n)
    QuantLinear(n_out, n_in)        a linear layer's W [N, K] as row segments [a, b), each a
                                    QuantPanels or a float32 cpu_linear.PackedWeight (tensors of
                                    a fused QKV may differ in type: Q4_K q/k beside a Q6_K v)
    QuantTable(n_rows, n_cols)      row-major packed rows for lookups (the embedding):
                                    gather_rows(idx [T]) -> float32 [T, n_cols]
    linear(x [M, K] float32, w: QuantLinear, b [N] | None) -> y [M, N] float32

A packed chunk with its K-quant levels (`sup`) gets the two-level records: Q4_K 4.75 bits a
weight instead of 6, Q6_K 6.625 instead of 10, the same sums (every scale the same float32).
Loading fills these chunk by chunk (`load(chunks)` with chunks = iterator of (row offset,
PackedInt4 | PackedInt8 | float32 tensor)), so no [N, K] float temporary ever exists. The
kernel scales each group of activations to int16 (error <= max|x| / 2^31 per input) and sums
code x input products exactly in int32; see the header for the sum order and the bounds.
"""
from __future__ import annotations

import torch

from swiftspec_mpi.packed import cpu_linear
from swiftspec_mpi.packed.int4 import (SUPER_BLOCK, PackedInt4, dequantize as dequantize4,
                                       unpack_codes)
from swiftspec_mpi.packed.int8 import PackedInt8, dequantize as dequantize8

NB = 16   # outputs per panel (SSQ_NB)
# record kind: (SSQ_* code in csrc/gemm_q.h, bits a code, code bytes per input per panel, largest group)
RECORDS = {"q4": (0, 4, 8, 128), "q8": (1, 8, 16, 32), "k4": (2, 4, 8, 128), "k6": (3, 6, 12, 32)}


def _kind(w, n_in: int) -> tuple[str, int, bool]:
    """(record kind, group, has_offset) a packed chunk of n_in inputs is held in."""
    two_level = w.sup is not None and n_in % SUPER_BLOCK == 0 and SUPER_BLOCK % w.group == 0
    if isinstance(w, PackedInt4):
        return ("k4" if two_level and w.sup.dmin is not None else "q4"), w.group, True
    if two_level and w.offset is None and w.sup.dmin is None:
        return "k6", w.group, False
    return "q8", w.group, w.offset is not None


def _step_lanes(codes: torch.Tensor, q: int, n_rec: int, width: int) -> torch.Tensor:
    """uint8 codes [q * 16, n_rec * width] (0..15) -> the 4-bit steps of the kernel:
    uint8 [q, n_rec, width / 8 steps, 64] (lane (o, t) int16, nibble j = code of k + 2j + t)."""
    c = codes.view(q, NB, n_rec, width // 8, 4, 2)             # [panel, o, rec, step, j, t]
    lo = c[:, :, :, :, 0] | (c[:, :, :, :, 1] << 4)            # low byte: k + t, k + 2 + t
    hi = c[:, :, :, :, 2] | (c[:, :, :, :, 3] << 4)            # high byte: k + 4 + t, k + 6 + t
    return torch.stack((lo, hi), dim=-1).permute(0, 2, 3, 1, 4, 5).reshape(q, n_rec, width // 8, 64)


def _per_panel(t: torch.Tensor, q: int, n_rec: int, per_rec: int) -> torch.Tensor:
    """[q * 16, n_rec * per_rec] -> bytes [q, n_rec, per_rec * 16 * itemsize] ([per_rec][16])."""
    t = t.reshape(q, NB, n_rec, per_rec).permute(0, 2, 3, 1).contiguous()
    return t.view(torch.uint8).reshape(q, n_rec, -1)


class QuantPanels:
    """One weight [N, K] in the kernel's records; see the module doc."""

    def __init__(self, n_out: int, n_in: int, kind: str, group: int, has_offset: bool):
        two_level = kind in ("k4", "k6")
        if (kind not in RECORDS or n_in % group or group % 8 or group > RECORDS[kind][3]
                or two_level and (n_in % SUPER_BLOCK or SUPER_BLOCK % group)):
            raise ValueError(f"no {kind} records with group {group} for K = {n_in}")
        self.n_out, self.n_in = int(n_out), int(n_in)
        self.kind, self.group, self.has_offset = kind, group, bool(has_offset)
        self.code, self.bits, per_input, _ = RECORDS[kind]
        self.code_bytes = group * per_input
        if two_level:
            sbg = SUPER_BLOCK // group
            n_rec = n_in // SUPER_BLOCK
            rec = sbg * (self.code_bytes + 16 * (1 + self.has_offset)) + 64 * (1 + self.has_offset)
        else:
            n_rec = n_in // group
            rec = self.code_bytes + 64 * (1 + self.has_offset)
        self.blob = torch.zeros((self.n_out + NB - 1) // NB, n_rec, rec, dtype=torch.uint8)

    def kind_of(self) -> tuple[str, int, bool]:
        return self.kind, self.group, self.has_offset

    def label(self) -> str:
        """'int4/g32', 'int8/g16', 'int4/g32/sb256' (Q4_K in two levels), 'int6/g16/sb256'."""
        return f"int{self.bits}/g{self.group}" + ("/sb256" if self.kind in ("k4", "k6") else "")

    def write_rows(self, a: int, w: PackedInt4 | PackedInt8) -> None:
        """W[a : a + n] = w (n rows; a a multiple of 16; n too unless the rows end at N)."""
        n, k = w.shape
        if _kind(w, k) != self.kind_of() or k != self.n_in:
            raise ValueError(f"{_kind(w, k)} rows of {k} inputs do not fit {self.kind_of()} "
                             f"records of {self.n_in}")
        if a % NB or a + n > self.n_out or (n % NB and a + n != self.n_out):
            raise ValueError(f"rows [{a}, {a + n}) are not whole panels of a {self.n_out}-row "
                             "weight")
        q, g, kg = -(-n // NB), self.group, self.n_in // self.group
        if self.bits == 4:
            codes = unpack_codes(w.qweight)
        elif self.kind == "k6":
            codes = w.qweight.to(torch.int16) + 32                         # Q6_K's q, 0..63
            if codes.min() < 0 or codes.max() > 63:
                raise ValueError("6-bit records need codes in [-32, 31] (Q6_K's)")
            codes = codes.to(torch.uint8)
        else:
            codes = w.qweight.view(torch.uint8)
        parts = {"scale": w.scale, "offset": w.offset}
        if w.sup is not None:
            parts.update(d=w.sup.d, sc=w.sup.sc, dmin=w.sup.dmin, m=w.sup.m)
        if n % NB:                                    # zero rows up to a whole panel
            pad = q * NB - n
            codes = torch.cat((codes, codes.new_zeros(pad, k)))
            parts = {name: None if t is None else torch.cat((t, t.new_zeros(pad, t.shape[1])))
                     for name, t in parts.items()}
        p0 = a // NB
        dst = self.blob[p0:p0 + q]
        if self.kind == "q4":
            rec = [_step_lanes(codes, q, kg, g).reshape(q, kg, -1), _per_panel(parts["scale"], q, kg, 1)]
            if self.has_offset:
                rec.append(_per_panel(parts["offset"], q, kg, 1))
        elif self.kind == "q8":           # [panel, output, group, step, byte j, t] -> [.., o, t, j]
            c = codes.view(q, NB, kg, g // 4, 2, 2).permute(0, 2, 3, 1, 5, 4).reshape(q, kg, -1)
            rec = [c, _per_panel(parts["scale"], q, kg, 1)]
            if self.has_offset:
                rec.append(_per_panel(parts["offset"], q, kg, 1))
        else:
            nsb, sbg = self.n_in // SUPER_BLOCK, SUPER_BLOCK // g
            lanes = _step_lanes(codes & 0x0F, q, nsb, SUPER_BLOCK)       # [q, nsb, 32, 64]
            if self.kind == "k6":          # + a byte a lane: bits 2j, 2j+1 = the code's bits 4, 5
                h = (codes >> 4).view(q, NB, nsb, SUPER_BLOCK // 8, 4, 2)
                hb = h[:, :, :, :, 0] | (h[:, :, :, :, 1] << 2) | (h[:, :, :, :, 2] << 4) | \
                    (h[:, :, :, :, 3] << 6)                               # [q, o, nsb, step, t]
                lanes = torch.cat((lanes, hb.permute(0, 2, 3, 1, 4).reshape(q, nsb, -1, 32)), -1)
            rec = [lanes.reshape(q, nsb, -1), _per_panel(parts["sc"], q, nsb, sbg)]
            if self.kind == "k4":
                rec.append(_per_panel(parts["m"], q, nsb, sbg))
            rec.append(_per_panel(parts["d"], q, nsb, 1))
            if self.kind == "k4":
                rec.append(_per_panel(parts["dmin"], q, nsb, 1))
        dst.copy_(torch.cat(rec, dim=-1))

    def nbytes(self) -> int:
        return self.blob.numel()


def _check_chunk(w, k: int):
    if isinstance(w, (PackedInt4, PackedInt8)):
        w.check()
        got = w.shape[1]
    else:
        got = w.shape[1]
    if got != k:
        raise ValueError(f"rows of {got} inputs for a weight of {k}")


class QuantLinear:
    """A linear layer's W [N, K] as row segments (a, b, QuantPanels | PackedWeight)."""

    def __init__(self, n_out: int, n_in: int):
        self.n_out, self.n_in = int(n_out), int(n_in)
        self.segments: list[tuple[int, int, object]] = []

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n_out, self.n_in))

    def rows(self, a: int = 0, b: int | None = None) -> "QuantRows":
        return QuantRows(self, a, self.n_out if b is None else b)

    def load(self, a: int, b: int, chunks) -> None:
        """Rows [a, b) from `chunks`: (offset from a, PackedInt4 | PackedInt8 | float tensor
        [n, K]) in row order, covering [a, b) exactly; they become one segment."""
        if not 0 <= a < b <= self.n_out or any(s < b and a < e for s, e, _ in self.segments):
            raise ValueError(f"rows [{a}, {b}) overlap a loaded segment or leave [0, {self.n_out})")
        seg, done = None, 0
        for off, w in chunks:
            _check_chunk(w, self.n_in)
            n = w.shape[0]
            if off != done or done + n > b - a:
                raise ValueError(f"chunk rows [{off}, {off + n}) out of order for [0, {b - a})")
            if seg is None:
                if isinstance(w, torch.Tensor):
                    seg = cpu_linear.PackedWeight(b - a, self.n_in, torch.float32)
                else:
                    seg = QuantPanels(b - a, self.n_in, *_kind(w, self.n_in))
            if isinstance(seg, cpu_linear.PackedWeight) != isinstance(w, torch.Tensor):
                raise ValueError("one tensor's chunks mix packed and dense rows")
            seg.write_rows(off, w)
            done += n
        if done != b - a:
            raise ValueError(f"got {done} rows for [{a}, {b})")
        self.segments.append((a, b, seg))
        self.segments.sort(key=lambda s: s[0])

    def complete(self) -> bool:
        edge = 0
        for a, b, _ in self.segments:
            if a != edge:
                return False
            edge = b
        return edge == self.n_out

    def kinds(self) -> list[str]:
        """One label per segment: 'int4/g32', 'int8/g16', 'int4/g32/sb256', 'float32'."""
        return [s.label() if isinstance(s, QuantPanels) else "float32" for _, _, s in self.segments]

    def nbytes(self) -> int:
        return sum(s.nbytes() for _, _, s in self.segments)


class QuantRows(cpu_linear.RowRange):
    """Rows [a, b) of a QuantLinear: `load(chunks)` writes them (chunks as QuantLinear.load)."""

    def load(self, chunks) -> None:
        self.w.load(self.a, self.b, chunks)


class QuantTable:
    """Rows [V, K] kept row-major in their packed kind (or float32) for lookups."""

    def __init__(self, n_rows: int, n_cols: int):
        self.n_rows, self.n_cols = int(n_rows), int(n_cols)
        self.shape = torch.Size((self.n_rows, self.n_cols))
        self.parts: list[tuple[int, object]] = []      # (first row, chunk)
        self._starts = torch.zeros(0, dtype=torch.long)

    def load(self, chunks) -> None:
        done = 0
        for off, w in chunks:
            _check_chunk(w, self.n_cols)
            if off != done:
                raise ValueError("table chunks out of order")
            self.parts.append((off, w))
            done += w.shape[0]
        if done != self.n_rows:
            raise ValueError(f"got {done} rows for a table of {self.n_rows}")
        self._starts = torch.tensor([o for o, _ in self.parts], dtype=torch.long)

    def gather_rows(self, idx: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """rows idx [T] -> [T, n_cols] (dequantized exactly, then cast to dtype)."""
        idx = idx.to(torch.long).cpu()
        out = torch.empty(idx.shape[0], self.n_cols, dtype=torch.float32)
        part = torch.searchsorted(self._starts, idx, right=True) - 1
        for i, (t, p) in enumerate(zip(idx.tolist(), part.tolist())):
            off, w = self.parts[p]
            r = t - off
            if isinstance(w, PackedInt4):
                out[i] = dequantize4(PackedInt4(w.qweight[r:r + 1], w.scale[r:r + 1],
                                                w.offset[r:r + 1], w.group))[0]
            elif isinstance(w, PackedInt8):
                out[i] = dequantize8(PackedInt8(w.qweight[r:r + 1], w.scale[r:r + 1],
                                                None if w.offset is None else w.offset[r:r + 1],
                                                w.group))[0]
            else:
                out[i] = w[r]
        return out if dtype == torch.float32 else out.to(dtype)

    def nbytes(self) -> int:
        total = 0
        for _, w in self.parts:
            total += w.nbytes() if hasattr(w, "nbytes") and callable(w.nbytes) else \
                w.numel() * w.element_size()
        return total


def linear(x: torch.Tensor, w: QuantLinear, b: torch.Tensor | None = None,
           n_threads: int | None = None) -> torch.Tensor:
    """x [M, K] float32 -> x @ W^T (+ b [N] float32): [M, N] float32, segment by segment."""
    from swiftspec_mpi.packed import _cpu_gemm

    x, y, b, nt = cpu_linear.gemm_operands(x, w.n_in, w.n_out, b, n_threads)
    M, K = x.shape
    xp, yp, ldy = x.data_ptr(), y.data_ptr(), y.stride(0)
    for a, e, s in w.segments:
        bp = 0 if b is None else b.data_ptr() + 4 * a
        if isinstance(s, QuantPanels):
            _cpu_gemm.gemm_quant(s.blob.data_ptr(), s.code, s.has_offset, s.group, K, e - a, xp,
                                 x.stride(0), M, yp + 4 * a, ldy, bp, nt)
        else:
            _cpu_gemm.gemm_packed(s.data.data_ptr(), s.is_bf16, K, e - a, xp, x.stride(0), M,
                                  yp + 4 * a, ldy, bp, nt)
    return y


def dense_linear(x: torch.Tensor, w, b=None, n_threads=None) -> torch.Tensor:
    """The CPU linear of either weight kind: QuantLinear here, PackedWeight in cpu_linear."""
    if isinstance(w, QuantLinear):
        return linear(x, w, b, n_threads)
    return cpu_linear.linear(x, w, b, n_threads)
