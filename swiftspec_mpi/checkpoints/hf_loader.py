"""`SafetensorsSource`: the TensorSource of a Hugging Face folder (config.json + *.safetensors,
single file or sharded with model.safetensors.index.json).

The TensorSource protocol (GGUFSource implements the same):
    config: ModelConfig
    names() -> list[str]                      # HF tensor names ("model.layers.0.self_attn.q_proj.weight")
    get(name, dim=None, start=0, stop=None)   # the tensor, or its slice [start:stop) along `dim`
    close()
  and, for sources that hold 4-bit layers:
    quant                                     # what they are (hf_quant.HFQuant here), None if dense
    is_packed(name) -> bool                   # `name` ("...q_proj.weight") is stored 4-bit
    get_packed(name, dim=None, start=0, stop=None) -> int4.PackedInt4
                                              # its [N, K] or the slice of outputs (dim 0) or of
                                              # inputs (dim 1, on group boundaries)
    packed_chunks(name, dim=None, start=0, stop=None)
                                              # (row offset, rows) covering the slice in row
                                              # order: PackedInt4 rows of a 4-bit layer, float32
                                              # rows of any other matrix, a few MiB each
  `get` of a 4-bit layer gives its exact float32 dequantization (slices at any offset).

AWQ and GPTQ folders (config.json's `quantization_config`; layouts in hf_quant.py) name a
4-bit layer by its `P.weight` while the files hold P.qweight / P.qzeros / P.scales (/ P.g_idx);
a slice reads only the words, zeros and scales that cover it.

Slices are read lazily through `safe_open(...).get_slice`, so a tensor-parallel rank reads only
its shard. The file is opened per `get` and closed right after: the mmap'd pages of what was
read stop counting in the process's RSS at once, which keeps the loading peak near the final
weight bytes. Never unpickles anything (no *.bin / *.pt support on purpose).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from swiftspec_mpi.core.errors import CheckpointError, UserError
from swiftspec_mpi.network.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from swiftspec_mpi.checkpoints.hf_quant import HFQuant
    from swiftspec_mpi.packed.int4 import PackedInt4

_FIX = "re-download or re-convert the checkpoint"
_CHUNK_BYTES = 8 << 20       # packed_chunks: bytes of packed (or float32) rows per block


def read_config_json(folder: str) -> dict:
    """config.json of an HF folder as a dict; CheckpointError naming the fix when missing or bad."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; a Hugging Face model folder needs config.json "
                              f"next to its *.safetensors ({_FIX})")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); {_FIX}") from None


def read_quantization(folder: str, raw: dict | None = None) -> HFQuant | None:
    """The checkpoint's 4-bit layout from config.json's `quantization_config` (None: dense);
    CheckpointError for a method, bit width or group size that does not load."""
    from swiftspec_mpi.checkpoints import hf_quant
    raw = read_config_json(folder) if raw is None else raw
    try:
        return hf_quant.parse_config(raw.get("quantization_config"),
                                     os.path.join(folder, "config.json"))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def logical_shapes(folder: str, shapes: dict) -> dict:
    """Tensor name -> shape of a folder's files, with each AWQ/GPTQ layer's stored tensors
    (checked against each other) folded into its `P.weight`: [N, K]. CheckpointError naming the
    tensor for a truncated one or a group size that does not divide the input."""
    from swiftspec_mpi.checkpoints import hf_quant
    quant = read_quantization(folder)
    if quant is None:
        return shapes
    out = {k: v for k, v in shapes.items() if not k.endswith(_PACKED_PARTS)}
    for name in shapes:
        if name.endswith(".qweight"):
            prefix = name[:-len(".qweight")]
            parts = {p: shapes[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")
                     if f"{prefix}.{p}" in shapes}
            try:
                out[prefix + ".weight"] = hf_quant.check_shapes(prefix, parts, quant)
            except ValueError as exc:
                raise CheckpointError(f"{folder}: {exc}; {_FIX}") from None
    return out


_PACKED_PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")


def _safe_open(path: str, framework: str = "pt"):
    from safetensors import safe_open
    try:
        return safe_open(path, framework=framework, device="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {_FIX}") from None
    except Exception as exc:  # SafetensorError (truncated / corrupt header), OSError
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc}); "
                              f"{_FIX}") from None


class SafetensorsSource:
    """Tensors of a HF folder by name; see the module doc for the protocol. `framework` "numpy"
    reads headers without importing torch (rank 0's checks: `shapes()`); `get` needs "pt"."""

    def __init__(self, folder: str, framework: str = "pt"):
        self.folder = os.fspath(folder)
        self._framework = framework
        if not os.path.isdir(self.folder):
            raise CheckpointError(f"{self.folder}: not a directory; pass a Hugging Face model "
                                  "folder or a .gguf file")
        raw = read_config_json(self.folder)
        self.config = ModelConfig.from_hf_dict(raw)
        self.quant = read_quantization(self.folder, raw)
        self._where: dict[str, str] = {}     # tensor name -> file path
        index = os.path.join(self.folder, "model.safetensors.index.json")
        single = os.path.join(self.folder, "model.safetensors")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc!r}); "
                                      f"{_FIX}") from None
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
            weight_map = None
        else:
            found = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors"))
            if not found:
                extra = ""
                if any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(self.folder)):
                    extra = " (pickled *.bin/*.pt weights are never loaded: convert them to " \
                            "safetensors)"
                raise CheckpointError(f"{self.folder}: no model.safetensors or "
                                      f"model.safetensors.index.json{extra}; {_FIX}")
            files, weight_map = found, None
        for fname in files:
            path = os.path.join(self.folder, fname)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing (listed in model.safetensors.index.json); "
                                      f"{_FIX}")
            with _safe_open(path, framework) as h:  # validates the header against the file size
                for name in h.keys():
                    self._where[name] = path
        if weight_map is not None:
            for name, fname in weight_map.items():
                if self._where.get(name) != os.path.join(self.folder, fname):
                    raise CheckpointError(f"{os.path.join(self.folder, fname)}: lacks tensor "
                                          f"{name!r} that the index lists; {_FIX}")

    def names(self) -> list[str]:
        """Stored tensor names, and `P.weight` for each 4-bit layer."""
        names = list(self._where)
        return names + [n[:-len("qweight")] + "weight" for n in names if n.endswith(".qweight")]

    def is_packed(self, name: str) -> bool:
        return (self.quant is not None and name.endswith(".weight")
                and name[:-len("weight")] + "qweight" in self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` (torch order: [out, in] for a weight; [N, K] for a 4-bit
        layer's `P.weight`)."""
        if self.is_packed(name):
            return self._layer_shape(name[:-len(".weight")])[:2]
        path = self._path(name)
        with _safe_open(path, self._framework) as h:
            return tuple(h.get_slice(name).get_shape())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape from the headers (each file opened once), no data read."""
        out = {}
        for path in sorted(set(self._where.values())):
            with _safe_open(path, self._framework) as h:
                for name in h.keys():
                    out[name] = tuple(h.get_slice(name).get_shape())
        return out
    def _layer_shape(self, prefix: str) -> tuple[int, int, dict]:
        """(N, K, suffix -> shape) of a 4-bit layer, its stored tensors checked together."""
        from swiftspec_mpi.checkpoints import hf_quant
        shapes = {}
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            if f"{prefix}.{part}" in self._where:
                with _safe_open(self._where[f"{prefix}.{part}"], self._framework) as h:
                    shapes[part] = tuple(h.get_slice(f"{prefix}.{part}").get_shape())
        try:
            n, k = hf_quant.check_shapes(prefix, shapes, self.quant)
        except ValueError as exc:
            raise CheckpointError(f"{self.folder}: {exc}; {_FIX}") from None
        return n, k, shapes

    def _read_layer(self, prefix: str, dim: int | None, start: int, stop: int | None):
        """-> (PackedInt4 covering the slice or None for a GPTQ layer in act order, the slice's
        offset and length in it along `dim`, the stored tensors read). Reads the words, zeros
        and scales of whole groups (dim 1) or of whole 8-column words (dim 0) around
        [start, stop); an act-order layer is read whole."""
        import torch

        from swiftspec_mpi.checkpoints import hf_quant
        quant = self.quant
        n, k, shapes = self._layer_shape(prefix)
        g, awq = quant.group, quant.method == "awq"
        if dim is not None:
            size = (n, k)[dim]
            stop = size if stop is None else stop
            if dim not in (0, 1) or not 0 <= start <= stop <= size:
                raise CheckpointError(f"{self.folder}: 4-bit layer {prefix} is [{n}, {k}]; cannot "
                                      f"take [{start}:{stop}) along dim {dim}")
        part = {}
        act_order = False
        if "g_idx" in shapes:
            part["g_idx"] = self.get(f"{prefix}.g_idx")
            act_order = not torch.equal(part["g_idx"].long(), torch.arange(k) // g)
        if dim is None or act_order:
            for p in ("qweight", "qzeros", "scales"):
                part[p] = self.get(f"{prefix}.{p}")
            off, length = (0, None) if dim is None else (start, stop - start)
        elif dim == 0:                               # outputs: whole words of 8 columns
            c0, c1 = start // 8, -(-stop // 8)
            a, b = 8 * c0, min(n, 8 * c1)
            part["qweight"] = self.get(f"{prefix}.qweight", 1, *((c0, c1) if awq else (a, b)))
            part["qzeros"] = self.get(f"{prefix}.qzeros", 1, c0, c1)
            part["scales"] = self.get(f"{prefix}.scales", 1, a, b)
            off, length = start - a, stop - start
        else:                                        # inputs: whole groups
            i0, i1 = start // g, -(-stop // g)
            rows = (i0 * g, i1 * g) if awq else (i0 * g // 8, i1 * g // 8)
            part["qweight"] = self.get(f"{prefix}.qweight", 0, *rows)
            part["qzeros"] = self.get(f"{prefix}.qzeros", 0, i0, i1)
            part["scales"] = self.get(f"{prefix}.scales", 0, i0, i1)
            off, length = start - i0 * g, stop - start
        if act_order:
            return None, off, length, part
        try:
            w = hf_quant.to_packed(quant, part["qweight"], part["qzeros"], part["scales"])
        except ValueError as exc:
            raise CheckpointError(f"{self.folder}: 4-bit layer {prefix}: {exc}; {_FIX}") from None
        return w, off, length, part

    def get_packed(self, name: str, dim: int | None = None, start: int = 0,
                   stop: int | None = None) -> PackedInt4:
        """A 4-bit layer `P.weight` (or its slice along dim 0 = outputs, dim 1 = inputs) as
        PackedInt4 [rows, cols]. An input slice must fall on group boundaries (UserError)."""
        from swiftspec_mpi.packed import int4
        if not self.is_packed(name):
            raise CheckpointError(f"{self.folder}: tensor {name!r} is not a 4-bit layer")
        prefix = name[:-len(".weight")]
        g = self.quant.group
        if dim == 1 and (start % g or (stop is not None and stop % g)):
            raise UserError(f"{self.folder}: inputs [{start}:{stop}) of {prefix} cut its 4-bit "
                            f"groups of {g}; choose a tensor-parallel degree whose shards are "
                            "whole groups")
        w, off, length, _ = self._read_layer(prefix, dim, start, stop)
        if w is None:
            raise CheckpointError(f"{self.folder}: 4-bit layer {prefix} is in GPTQ act order "
                                  "(desc_act=True, g_idx not k // group_size), which the packed "
                                  "4-bit form cannot hold; run it with --quant none")
        if dim is None:
            return w
        if dim == 0:
            return int4.take_rows(w, off, off + length)
        return int4.take_cols(w, off, off + length)

    def packed_chunks(self, name: str, dim: int | None = None, start: int = 0,
                      stop: int | None = None):
        """Yield (row offset, rows) covering the slice of matrix `name` in row order: rows of
        its PackedInt4 form (a 4-bit layer) or float32 rows (any other matrix), in blocks of a
        multiple of 16 rows of about _CHUNK_BYTES, so a loader never holds a whole layer's
        temporaries."""
        if dim == 1:                              # a row-parallel shard: its rows, one block
            yield 0, (self.get_packed(name, 1, start, stop) if self.is_packed(name)
                      else self.get(name, 1, start, stop).float())
            return
        n, k = self.shape(name)[:2]
        a = start if dim == 0 else 0
        b = (stop if stop is not None else n) if dim == 0 else n
        packed = self.is_packed(name)
        step = max(16, (_CHUNK_BYTES // (k // 2 if packed else 4 * k)) // 16 * 16)
        for r in range(a, b, step):
            e = min(b, r + step)
            yield r - a, (self.get_packed(name, 0, r, e) if packed else
                          self.get(name, 0, r, e).float())

    def _dequantized(self, name: str, dim, start: int, stop) -> torch.Tensor:
        """float32 [N, K] (or its slice) of a 4-bit layer: exactly its reference
        dequantization."""
        from swiftspec_mpi.checkpoints import hf_quant
        from swiftspec_mpi.packed import int4
        w, off, length, part = self._read_layer(name[:-len(".weight")], dim, start, stop)
        if w is None:
            dense = hf_quant.dequantize_gptq(part["qweight"], part["qzeros"], part["scales"],
                                             part["g_idx"], self.quant.zero_plus_one)
        else:
            dense = int4.dequantize(w)
        return dense if dim is None else dense.narrow(dim, off, length).contiguous()

    def _path(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the "
                                  f"safetensors files; {_FIX}") from None

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """The whole tensor (dim=None) or its slice [start:stop) along `dim` (a new tensor in the
        file's dtype; only the slice's bytes are read). A 4-bit layer's `P.weight` comes
        dequantized, in float32."""
        if self.is_packed(name):
            return self._dequantized(name, dim, start, stop)
        path = self._path(name)
        try:
            with _safe_open(path) as h:
                sl = h.get_slice(name)
                if dim is None:
                    return sl[:]
                shape = sl.get_shape()
                stop = shape[dim] if stop is None else stop
                if not 0 <= start <= stop <= shape[dim]:
                    raise CheckpointError(f"{path}: tensor {name!r} has shape {list(shape)}; "
                                          f"cannot take [{start}:{stop}) along dim {dim}")
                index = (slice(None),) * dim + (slice(start, stop),)
                return sl[index]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc}); {_FIX}") from None

    def close(self) -> None:
        """Forget the tensor table (files are opened per read; nothing stays open)."""
        self._where = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
