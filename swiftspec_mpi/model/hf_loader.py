"""`SafetensorsSource`: the TensorSource of a Hugging Face folder (config.json + *.safetensors,
single file or sharded with model.safetensors.index.json).

The TensorSource protocol (GGUFSource implements the same):
    config: ModelConfig
    names() -> list[str]                      # HF tensor names ("model.layers.0.self_attn.q_proj.weight")
    get(name, dim=None, start=0, stop=None)   # the tensor, or its slice [start:stop) along `dim`
    close()

Slices are read lazily through `safe_open(...).get_slice`, so a tensor-parallel rank reads only
its shard. The file is opened per `get` and closed right after: the mmap'd pages of what was
read stop counting in the process's RSS at once, which keeps the loading peak near the final
weight bytes. Never unpickles anything (no *.bin / *.pt support on purpose).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from swiftspec_mpi.core.errors import CheckpointError
from swiftspec_mpi.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

_FIX = "re-download or re-convert the checkpoint"


def read_config_json(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; a Hugging Face model folder needs config.json "
                              f"next to its *.safetensors ({_FIX})")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); {_FIX}") from None


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
        self.config = ModelConfig.from_hf_dict(read_config_json(self.folder))
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
        """Every tensor's HF name."""
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` (torch order: [out, in] for a weight)."""
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

    def _path(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the "
                                  f"safetensors files; {_FIX}") from None

    def get(self, name: str, dim: int | None = None, start: int = 0,
            stop: int | None = None) -> torch.Tensor:
        """The whole tensor (dim=None) or its slice [start:stop) along `dim` (a new tensor in the
        file's dtype; only the slice's bytes are read)."""
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
