"""`GGUFSource`: the TensorSource of a llama.cpp GGUF file (its header parser, config and tensors;
the tokenizer the file embeds is rebuilt by checkpoints/gguf_tokenizer.py).

    GGUFSource(path, dtype=None)  config: ModelConfig (from the GGUF metadata); names() -> HF
                              names; get(name, dim=None, start=0, stop=None) -> float32 (or
                              `dtype`) tensor or slice; get_into(dst, name, dim, start, stop)
                              (dequantize straight into dst); shape(name); close()
    read_header(path) -> Header (metadata + tensor table; cached for the most recent file)

Names. llama.cpp -> HF: token_embd -> model.embed_tokens, output_norm -> model.norm,
output -> lm_head, blk.N.attn_{q,k,v} -> model.layers.N.self_attn.{q,k,v}_proj,
attn_output -> o_proj, ffn_{gate,up,down} -> mlp.{gate,up,down}_proj, attn_norm ->
input_layernorm, ffn_norm -> post_attention_layernorm. No output.weight means a tied head.

Layout. GGUF lists dims fastest-first, so a [out, in] torch weight is stored as ne = (in, out):
one quantized row per output feature, whole blocks per row. For `llama`-arch files llama.cpp's
converter permuted the rows of Q and K inside each head (HF's rotate-half layout [2, hd/2] ->
interleaved [hd/2, 2]); `get` undoes it (as transformers' GGUF loader does). `qwen2` files are
not permuted.

Memory. Tensor bytes are read with plain file reads (never through a memory map, so nothing
file-backed stays in RSS), only the rows a slice needs are read, and they are dequantized
(gguf.quants, numpy float32) 16 MiB at a time straight into the output tensor; freed heap goes
back to the OS after each tensor (malloc_trim). Peak extra memory while loading: one tensor
(slice) in float32 for `get`, in `dtype` with the dtype hint, nothing but a chunk for
`get_into` (see benchmarks/bench_model_cpu.py --load-rss).

The header (metadata + tensor table) is read by a small struct/numpy parser of the GGUF spec
(gguf.GGUFReader needs 15-60 s for a 150k-token vocabulary on a 2-core CPU, this well under a
second; tests cross-check the two). gguf supplies the type tables and the dequantization. The
parse is cached for the most recent file, so GGUFSource and gguf_tokenizer share it.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from swiftspec_mpi.checkpoints.gguf_config import FIX, config_from_header
from swiftspec_mpi.core.errors import CheckpointError


# ggml types we dequantize (all through gguf.quants); anything else is refused by name
_SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_CHUNK_FLOATS = 4 << 20          # dequantize about this many float32 values at a time (16 MiB)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")



def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name for a llama.cpp tensor name (None when there is none)."""
    m = _BLK.match(gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    part = _GLOBAL_NAMES.get(base)
    return None if part is None else f"{part}.{kind}"


# ------------------------------------------------------------------------------ header parsing

@dataclass(frozen=True)
class _TensorInfo:
    gguf_name: str
    qtype: object            # gguf.GGMLQuantizationType
    shape: tuple             # torch order, e.g. (out, in)
    offset: int              # absolute byte offset of the data in the file
    nbytes: int
    row_bytes: int           # bytes of one row along the last (fastest) dim


@dataclass(frozen=True)
class Header:
    path: str
    meta: dict               # key -> python value (lists for arrays)
    tensors: dict            # gguf name -> _TensorInfo
    file_size: int


_HEADER_CACHE: dict = {}

# GGUF metadata value types -> (struct code, numpy dtype); 8 = string, 9 = array
_SCALAR = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
           4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
           10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8")}


class _Truncated(Exception):
    pass


class _Cursor:
    """Little-endian reads from a buffer (an mmap of the file); every read is bounds-checked."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos, self.end = buf, pos, len(buf)

    def take(self, n: int) -> int:
        p = self.pos
        if n < 0 or p + n > self.end:
            raise _Truncated(f"needs byte {p + n}, file has {self.end}")
        self.pos = p + n
        return p

    def scalar(self, code: str):
        return struct.unpack_from(code, self.buf, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        p = self.take(n)
        return bytes(self.buf[p:p + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype][0])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALAR:                       # numeric array: one numpy read
                dt = np.dtype(_SCALAR[itype][1])
                p = self.take(count * dt.itemsize)
                return np.frombuffer(self.buf, dt, count, p).tolist()
            if count > self.end - self.pos:            # every item takes at least one byte
                raise _Truncated(f"array of {count} items cannot fit")
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


def _parse(buf, path: str):
    """(metadata dict, tensor table) of a GGUF v2/v3 file held in `buf` (spec:
    github.com/ggml-org/ggml/blob/master/docs/gguf.md). A direct struct/numpy reader: gguf's
    GGUFReader makes numpy views per string and needs ~15-60 s for a 150k-token vocabulary on a
    small CPU, this needs well under a second."""
    import gguf

    c = _Cursor(buf)
    if c.scalar("<I") != gguf.GGUF_MAGIC:
        raise ValueError("no GGUF magic at the start (not a GGUF file)")
    version = c.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian or too old/new; 2 and 3 are read)")
    n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("<I")
        if n_dims > 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dims")
        dims = [c.scalar("<Q") for _ in range(n_dims)]
        table.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    align = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment={align} is not a power of two")
    data_start = (c.pos + align - 1) // align * align
    return meta, table, data_start


def read_header(path: str) -> Header:
    """Parse metadata + tensor table (cached for the most recent file), with extent checks."""
    import gguf

    path = os.fspath(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; give an existing .gguf file") from None
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    hit = _HEADER_CACHE.get(key)
    if hit is not None:
        return hit
    if st.st_size < 24:
        raise CheckpointError(f"{path}: {st.st_size} bytes is too short for a GGUF file; {FIX}")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta, table, data_start = _parse(mm, path)
        tensors = {}
        for name, dims, raw_type, offset in table:
            try:
                qtype = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"tensor {name!r} has unknown ggml type id {raw_type}") from None
            block, tsize = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))
            n = 1
            for d in shape:
                n *= d
            if shape and shape[-1] % block:
                raise ValueError(f"tensor {name!r} rows of {shape[-1]} are not whole "
                                 f"{qtype.name} blocks of {block}")
            row_bytes = shape[-1] // block * tsize if shape else tsize
            tensors[name] = _TensorInfo(name, qtype, shape, data_start + int(offset),
                                        n // block * tsize, int(row_bytes))
    except (_Truncated, struct.error) as exc:
        raise CheckpointError(f"{path}: truncated GGUF file (header: {exc}); {FIX}") from None
    except (ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise CheckpointError(f"{path}: corrupt GGUF file ({exc}); {FIX}") from None
    for info in tensors.values():
        if info.offset + info.nbytes > st.st_size:
            raise CheckpointError(f"{path}: truncated GGUF file: tensor {info.gguf_name!r} ends at "
                                  f"byte {info.offset + info.nbytes} but the file has "
                                  f"{st.st_size}; {FIX}")
    header = Header(path, meta, tensors, st.st_size)
    _HEADER_CACHE.clear()
    _HEADER_CACHE[key] = header
    return header


# ------------------------------------------------------------------------------ tensors

def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc malloc_trim). gguf.quants dequantizes through
    many mid-sized numpy temporaries that glibc otherwise keeps: measured on the Qwen2.5 1.5B
    GGUF loaded into bf16, ~0.8 GiB of retained heap and a peak RSS 1.53x the weights without
    this, 1.29x with it."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):       # not glibc (macOS, musl): nothing to do
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def _unpermute_rows(rows: np.ndarray, n_head: int, n_rows: int) -> np.ndarray:
    """GGUF row index holding each HF row of a llama.cpp-permuted Q/K weight.

    HF row r = h*hd + i*(hd/2) + j (i in {0,1}) is stored at GGUF row h*hd + 2*j + i."""
    hd = n_rows // n_head
    half = hd // 2
    head, within = np.divmod(rows, hd)
    i, j = np.divmod(within, half)
    return head * hd + 2 * j + i


class GGUFSource:
    """HF-named tensors of a GGUF file; see the module doc for the protocol and memory use."""

    def __init__(self, path, dtype=None):
        """`dtype`: torch dtype of the tensors `get` returns (default float32). A loader that
        knows the model's dtype passes it, so no float32 copy of a large tensor is ever held."""
        self.path = os.fspath(path)
        self.dtype = dtype
        self._header = h = read_header(self.path)
        try:
            self.config = config_from_header(h)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - corrupt values: head_count 0, a string count...
            raise CheckpointError(f"{self.path}: corrupt GGUF metadata ({type(exc).__name__}: "
                                  f"{exc}); {FIX}") from None
        import gguf

        self._names: dict[str, _TensorInfo] = {}
        unknown = []
        for gname, info in h.tensors.items():
            name = hf_name(gname)
            if name is None:
                unknown.append(gname)
                continue
            if info.qtype.name not in _SUPPORTED_QTYPES:
                raise CheckpointError(f"{self.path}: tensor {gname!r} has ggml type "
                                      f"{info.qtype.name}, which is not supported (supported: "
                                      f"{', '.join(_SUPPORTED_QTYPES)}); re-quantize the model, "
                                      "e.g. to Q4_K_M or Q8_0")
            self._names[name] = info
        if unknown:
            raise CheckpointError(f"{self.path}: unexpected tensor(s) {', '.join(unknown[:4])} for "
                                  f"a {self.config.arch} model; this GGUF is not a plain "
                                  "Llama/Qwen2 decoder")
        # llama.cpp permuted Q/K rows of llama-arch files: name -> number of heads in it
        self._permuted: dict[str, int] = {}
        if self.config.arch == "llama":
            for i in range(self.config.num_layers):
                for proj, n in (("q_proj", self.config.num_heads),
                                ("k_proj", self.config.num_kv_heads)):
                    for kind in ("weight", "bias"):
                        self._permuted[f"model.layers.{i}.self_attn.{proj}.{kind}"] = n
        self._dequantize = gguf.quants.dequantize
        self._file = open(self.path, "rb")

    # ------------------------------------------------------------------ protocol
    def names(self) -> list[str]:
        """Every tensor's HF name."""
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` (torch order: [out, in] for a weight)."""
        return self._info(name).shape

    def ggml_type(self, name: str) -> str:
        return self._info(name).qtype.name

    def _info(self, name: str) -> _TensorInfo:
        try:
            return self._names[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: has no tensor {name!r} (GGUF lacks its llama.cpp "
                                  f"counterpart); {FIX}") from None

    def _read(self, offset: int, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, dtype=np.uint8)
        if self._file is None:
            raise ValueError(f"{self.path}: GGUFSource is closed")
        self._file.seek(offset)
        got = self._file.readinto(memoryview(buf))
        if got != nbytes:
            raise CheckpointError(f"{self.path}: truncated GGUF file (short read at byte "
                                  f"{offset}); {FIX}")
        return buf

    def get(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        """Tensor `name` (float32 or self.dtype), or its slice [start:stop) along `dim` (fresh).

        Only the rows the slice needs are read and dequantized (dim 0 of a 2-D weight is its
        output features = GGUF rows)."""
        import torch

        shape, _, _ = self._plan(name, dim, start, stop)
        out = torch.empty(shape, dtype=self.dtype or torch.float32)
        self.get_into(out, name, dim, start, stop)
        return out

    def get_into(self, dst, name: str, dim: int | None = None, start: int = 0,
                 stop: int | None = None) -> None:
        """Like `get`, but dequantize straight into `dst` (any dtype, any strides, the slice's
        shape), a few MiB at a time: loading then needs no full-size temporary at all."""
        import torch

        info = self._info(name)
        shape, rows, cols = self._plan(name, dim, start, stop)
        if tuple(dst.shape) != shape:
            raise CheckpointError(f"{self.path}: tensor {name!r} slice has shape {list(shape)}, "
                                  f"the destination {list(dst.shape)}; the checkpoint and its "
                                  "config disagree")
        if len(info.shape) == 1:                   # norms, biases: small, read whole
            flat = self._dequantize(self._read(info.offset, info.nbytes), info.qtype)
            dst.copy_(torch.from_numpy(np.ascontiguousarray(flat.reshape(-1)[rows], np.float32)))
            return
        if dst.numel() == 0:
            return
        lo, hi = int(rows.min()), int(rows.max()) + 1
        raw = self._read(info.offset + lo * info.row_bytes, (hi - lo) * info.row_bytes)
        raw = raw.reshape(hi - lo, info.row_bytes)
        local = rows - lo
        contiguous = name not in self._permuted                # rows == arange(lo, hi)
        step = max(1, _CHUNK_FLOATS // info.shape[1])
        for c0 in range(0, len(rows), step):
            c1 = min(c0 + step, len(rows))
            block = raw[c0:c1] if contiguous else raw[local[c0:c1]]
            deq = self._dequantize(block, info.qtype)              # [c1-c0, n_cols] float32
            dst[c0:c1].copy_(torch.from_numpy(np.ascontiguousarray(deq[:, cols])))
            del block, deq
        del raw
        _trim_heap()

    def is_packed(self, name: str) -> bool:
        """True when tensor `name` has a packed 4-/8-bit form (gguf_packed.packed_group)."""
        from swiftspec_mpi.checkpoints import gguf_packed
        return gguf_packed.packed_group(self.ggml_type(name)) is not None

    def packed_chunks(self, name: str, dim: int | None = None, start: int = 0,
                      stop: int | None = None):
        """(row offset, rows) covering the slice of matrix `name` in row order, packed where
        its type has a packed kind, else float32 (gguf_packed.read_chunks)."""
        from swiftspec_mpi.checkpoints import gguf_packed
        yield from gguf_packed.read_chunks(self, name, dim, start, stop)
        _trim_heap()

    def _plan(self, name, dim, start, stop) -> tuple[tuple, np.ndarray, slice]:
        """(slice shape, GGUF rows to read in output order, column slice)."""
        info = self._info(name)
        shape = info.shape
        if len(shape) not in (1, 2):
            raise CheckpointError(f"{self.path}: tensor {name!r} has {len(shape)} dims; only "
                                  "1-D and 2-D tensors are expected")
        if dim is not None:
            if not 0 <= dim < len(shape):
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(shape)}; "
                                      f"no dim {dim}")
            stop = shape[dim] if stop is None else stop
            if not 0 <= start <= stop <= shape[dim]:
                raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(shape)}; "
                                      f"cannot take [{start}:{stop}) along dim {dim}")
        rows = np.arange(start, stop) if dim == 0 else np.arange(shape[0])
        cols = slice(start, stop) if dim == 1 else slice(None)
        n_head = self._permuted.get(name)
        if n_head is not None:
            rows = _unpermute_rows(rows, n_head, shape[0])
        out_shape = (len(rows),) if len(shape) == 1 else \
            (len(rows), len(range(*cols.indices(shape[1]))))
        return out_shape, rows, cols

    def close(self) -> None:
        """Close the GGUF file."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
