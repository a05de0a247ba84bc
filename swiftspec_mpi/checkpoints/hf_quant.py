"""AWQ and GPTQ layers of Hugging Face checkpoints: their `quantization_config`, their tensor
layouts, and the exact conversion of each layer into the packed 4-bit kind (`packed.int4.PackedInt4`).

A linear layer `P.weight` (nn.Linear's [out, in] = [N, K]) of a quantized folder is stored as
int32 words (little-endian; nibble j = bits 4j..4j+3), with group g along the input:

  AWQ, AutoAWQ's "gemm" version (packed along the output):
    P.qweight  int32   [K, N / 8]    word [k, c]: nibble j holds q[k, 8c + AWQ_ORDER[j]]
    P.qzeros   int32   [K / g, N / 8] the zero points, packed the same way
    P.scales   float16 [K / g, N]
    W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]

  GPTQ, AutoGPTQ / GPTQModel (packed along the input):
    P.qweight  int32   [K / 8, N]    word [r, n]: nibble j holds q[8r + j, n]
    P.qzeros   int32   [K / g, N / 8] word [i, c]: nibble j holds the stored zero of column 8c + j
    P.scales   float16 [K / g, N]
    P.g_idx    int32   [K]           the group of input k (k // g, unless desc_act reorders them)
    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
    z = stored + 1 for checkpoint_format "gptq" (the classic format, which writes z - 1) and
    z = stored for "gptq_v2"; both are accepted.

The reference dequantization is that formula in float32: |q - z| <= 16 has 5 bits and s 11, so
(q - z) * s is exact, and so is the PackedInt4 form scale = s, offset = -(z * s), whose
q * scale + offset is the same value. (In float16, the formats' own kernels round it.)

The config and shape checks import no torch (rank 0 runs them before anything heavy).

desc_act=True GPTQ checkpoints whose g_idx is not k // g ("act order") are refused for the packed
form: their groups are scattered over the input, which PackedInt4's contiguous groups hold only
if every layer's activations were permuted at run time. `dequantize_gptq` reads them exactly
(`--quant none`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swiftspec_mpi.packed.int4 import GROUP_SIZES, PackedInt4

if TYPE_CHECKING:
    import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # AWQ: nibble j of a word holds output column 8c + AWQ_ORDER[j]
METHODS = ("awq", "gptq")
_BLOCK_BYTES = 4 << 20                 # bound on a conversion's temporaries (per block of inputs)


@dataclass(frozen=True)
class HFQuant:
    """The parts of a checkpoint's `quantization_config` that decide how its layers read."""
    method: str             # "awq" | "gptq"
    group: int              # inputs per scale/zero group
    zero_plus_one: bool     # GPTQ's classic format: stored zero points are z - 1
    desc_act: bool          # GPTQ act order (groups scattered over the input)

    def describe(self) -> str:
        fmt = ("AWQ" if self.method == "awq" else
               "GPTQ" + (" (act order)" if self.desc_act else "")
               + ("" if self.zero_plus_one else " v2"))
        return f"{fmt} 4-bit, group {self.group}"


def parse_config(qc, where: str) -> HFQuant | None:
    """config.json's `quantization_config` (a dict, or None for a dense checkpoint) -> HFQuant;
    ValueError naming `where` and the fix when it is not a 4-bit AWQ/GPTQ layout we read."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(f"{where}: quant_method {qc.get('quant_method')!r} is not supported; "
                         "supported: awq (AutoAWQ gemm) and gptq, 4 bits (or dequantize the "
                         "checkpoint to float16/bfloat16 safetensors first)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: {method} with bits={bits} is not supported; only 4-bit "
                         "checkpoints load")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in GROUP_SIZES:
        raise ValueError(f"{where}: {method} group_size={group} is not supported; use a "
                         f"checkpoint quantized with a group size of {', '.join(map(str, GROUP_SIZES))}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {qc.get('version')!r} is not supported; only "
                             "AutoAWQ's gemm layout loads (re-export with version='gemm')")
        if qc.get("zero_point") is False:
            raise ValueError(f"{where}: AWQ with zero_point=false is not supported; use a "
                             "checkpoint quantized with zero points (AutoAWQ's default)")
        return HFQuant("awq", int(group), zero_plus_one=False, desc_act=False)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; use the "
                         "gptq or gptq_v2 format")
    return HFQuant("gptq", int(group), zero_plus_one=fmt == "gptq",
                   desc_act=bool(qc.get("desc_act", False)))


def check_shapes(prefix: str, shapes: dict, quant: HFQuant) -> tuple[int, int]:
    """The [N, K] of layer `prefix` from its stored tensors' shapes (suffix -> shape: qweight,
    qzeros, scales, optional g_idx); ValueError naming the tensor when they do not fit together
    (a truncated tensor, a group that does not divide the input dimension)."""
    g = quant.group
    for part in ("qweight", "qzeros", "scales"):
        if part not in shapes:
            raise ValueError(f"lacks tensor {prefix}.{part}")
        if len(shapes[part]) != 2:
            raise ValueError(f"tensor {prefix}.{part} has shape {list(shapes[part])}, not 2-D")
    qw, sc = shapes["qweight"], shapes["scales"]
    n, rows = sc[1], sc[0]
    k = qw[0] if quant.method == "awq" else qw[0] * 8
    if k % g:
        if rows and k % rows == 0 and k // rows in GROUP_SIZES:   # the tensors agree on a group
            raise ValueError(f"group_size {g} does not divide the input dimension {k} of {prefix} "
                             f"(its tensors hold groups of {k // rows}: the config's group_size "
                             "does not belong to these weights)")
        k = rows * g                          # the words disagree with the scales: named below
    want = {"qweight": (k, n // 8) if quant.method == "awq" else (k // 8, n),
            "qzeros": (k // g, -(-n // 8)), "scales": (k // g, n)}
    if quant.method == "awq" and n % 8:
        raise ValueError(f"tensor {prefix}.scales has {n} output columns, not a multiple of 8")
    if "g_idx" in shapes:
        want["g_idx"] = (k,)
    for part, shape in want.items():
        if tuple(shapes[part]) != shape:
            raise ValueError(f"tensor {prefix}.{part} has shape {list(shapes[part])} but "
                             f"{prefix}.qweight and .scales imply {list(shape)} for a "
                             f"[{n}, {k}] layer in groups of {g}: the tensor is truncated or "
                             "the config's group_size is wrong")
    return n, k


# ------------------------------------------------------------------------------ reading
def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C, 8]: nibble j of each word at [..., j]."""
    import torch
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def unpack_zeros(qzeros: torch.Tensor, n: int, method: str, plus_one: bool = False) -> torch.Tensor:
    """qzeros int32 [G, ceil(n / 8)] -> float32 zero points [n, G] (AWQ order or sequential)."""
    import torch
    z = _nibbles(qzeros)
    if method == "awq":
        z = z[..., torch.tensor(AWQ_ORDER).argsort()]     # column order 0..7 within each word
    z = z.reshape(qzeros.shape[0], -1)[:, :n].t().float()
    return z + 1 if plus_one else z


def _awq_codes_into(dst: torch.Tensor, qweight: torch.Tensor) -> None:
    """AWQ qweight int32 [B, N / 8] (B even) -> dst uint8 [N, B / 2] in PackedInt4's layout.
    Words of inputs 2i and 2i + 1 are merged nibble-wise: byte m of `even` holds nibble 2m of
    both (input 2i low, 2i + 1 high), byte m of `odd` nibble 2m + 1: the output column
    AWQ_ORDER[2m] or AWQ_ORDER[2m + 1] of the word."""
    import torch
    lo, hi = qweight[0::2], qweight[1::2]                    # [B / 2, N / 8]
    m4 = 0x0F0F0F0F
    even = ((lo & m4) | ((hi & m4) << 4)).t().contiguous()   # [N / 8, B / 2]
    odd = (((lo >> 4) & m4) | (((hi >> 4) & m4) << 4)).t().contiguous()
    rows = dst.view(-1, 8, dst.shape[1])                     # output 8c + i at [c, i]
    for src, nibbles in ((even, AWQ_ORDER[0::2]), (odd, AWQ_ORDER[1::2])):
        b = src.view(torch.uint8).view(src.shape[0], src.shape[1], 4)
        for m, col in enumerate(nibbles):
            rows[:, col].copy_(b[:, :, m])


def _gptq_codes_into(dst: torch.Tensor, qweight: torch.Tensor) -> None:
    """GPTQ qweight int32 [B, N] -> dst uint8 [N, 4B]: byte m of word [r, n] holds inputs
    8r + 2m (low nibble) and 8r + 2m + 1 (high), exactly PackedInt4's byte [n, 4r + m], so
    each word moves whole (little-endian)."""
    import torch
    dst.view(torch.int32).copy_(qweight.t())


def to_packed(quant: HFQuant, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None = None) -> PackedInt4:
    """One layer's stored tensors (layouts in the module doc; N = scales' columns) ->
    PackedInt4 [N, K], exactly. The codes are converted a few MiB of inputs at a time.
    ValueError for dtypes that do not fit, or a GPTQ layer in act order."""
    import torch
    if sys.byteorder != "little":
        raise ValueError("AWQ/GPTQ words are read as little-endian bytes; this host is big-endian")
    for name, t, dt in (("qweight", qweight, torch.int32), ("qzeros", qzeros, torch.int32)):
        if t.dtype != dt:
            raise ValueError(f"{name} is {t.dtype}, expected {dt}")
    if not scales.dtype.is_floating_point:
        raise ValueError(f"scales is {scales.dtype}, expected float16")
    g = quant.group
    n = scales.shape[1]
    awq = quant.method == "awq"
    k = qweight.shape[0] if awq else qweight.shape[0] * 8
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k, dtype=torch.int64) // g):
        raise ValueError("its g_idx is not k // group_size (GPTQ act order, desc_act=True): its "
                         "groups are scattered over the input, which the packed 4-bit form cannot "
                         "hold; run it with --quant none (dequantized) or use a checkpoint "
                         "quantized with desc_act=False")
    q = torch.empty(n, k // 2, dtype=torch.uint8)
    row_bytes = n * 4                                   # bytes per stored word row
    if awq:
        step = max(g, (_BLOCK_BYTES // row_bytes) // g * g)    # inputs per block
        for k0 in range(0, k, step):
            k1 = min(k, k0 + step)
            _awq_codes_into(q[:, k0 // 2:k1 // 2], qweight[k0:k1])
    else:
        step = max(1, _BLOCK_BYTES // row_bytes)                # word rows (8 inputs) per block
        for r0 in range(0, qweight.shape[0], step):
            r1 = min(qweight.shape[0], r0 + step)
            _gptq_codes_into(q[:, 4 * r0:4 * r1], qweight[r0:r1])
    scale = scales.t().float().contiguous()                     # [N, K / g]
    zeros = unpack_zeros(qzeros, n, quant.method, quant.zero_plus_one)
    w = PackedInt4(q, scale, -(zeros * scale), g)
    w.check()
    return w


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, plus_one: bool) -> torch.Tensor:
    """The reference dequantization of a GPTQ layer with any g_idx (act order included):
    float32 [N, K]."""
    n = scales.shape[1]
    codes = _nibbles(qweight).permute(0, 2, 1).reshape(-1, n).float()   # [K, N]
    z = unpack_zeros(qzeros, n, "gptq", plus_one).t()                   # [K / g, N]
    gi = g_idx.long()
    return ((codes - z[gi]) * scales.float()[gi]).t().contiguous()


# ------------------------------------------------------------------------------ writing
# (the codes come from packed.int4.quantize_rtn)
def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C, 8] (0..15) -> int32 [R, C], nibble j at bits 4j (two's complement words)."""
    import torch
    acc = torch.zeros(nibbles.shape[:2], dtype=torch.int64)
    for j in range(8):
        acc |= nibbles[..., j].to(torch.int64) << (4 * j)
    return torch.where(acc >= 1 << 31, acc - (1 << 32), acc).to(torch.int32)


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict:
    """codes uint8 [N, K], zeros uint8 [N, K / g], scales float16 [N, K / g] -> AutoAWQ gemm
    tensors {"qweight", "qzeros", "scales"} (shapes in the module doc)."""
    def awq_words(t):                                        # [N, R] -> int32 [R, N / 8]
        cols = t.t().reshape(t.shape[1], -1, 8)              # [R, N / 8, 8], column 8c + i
        return _words(cols[..., list(AWQ_ORDER)])            # nibble j <- column AWQ_ORDER[j]
    return {"qweight": awq_words(codes), "qzeros": awq_words(zeros),
            "scales": scales.t().contiguous().half()}


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              zero_plus_one: bool = True) -> dict:
    """codes uint8 [N, K], zeros uint8 [N, K / g], scales float16 [N, K / g] -> GPTQ tensors
    {"qweight", "qzeros", "scales", "g_idx"}. zero_plus_one: the classic format (stores z - 1,
    four bits: a zero point of 0 reads back as 16, as in the format's own writer)."""
    import torch
    n, k = codes.shape
    g = k // zeros.shape[1]
    stored = ((zeros.to(torch.int16) - 1) & 0xF).to(torch.uint8) if zero_plus_one else zeros
    pad = -n % 8                                             # qzeros: columns padded to 8
    zcols = torch.cat((stored.t(), torch.zeros(stored.shape[1], pad, dtype=torch.uint8)), 1)
    return {"qweight": _words(codes.t().reshape(k // 8, 8, n).permute(0, 2, 1)),
            "qzeros": _words(zcols.reshape(zcols.shape[0], -1, 8)),
            "scales": scales.t().contiguous().half(),
            "g_idx": (torch.arange(k) // g).to(torch.int32)}
