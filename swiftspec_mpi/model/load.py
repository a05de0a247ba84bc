"""`load_model(path, ...)`: pick the loader for a checkpoint path (Hugging Face folder or *.gguf
file), build the sharded `Transformer` and the `TextTokenizer`.

    read_model_config(path) -> ModelConfig      cheap: reads config.json / GGUF metadata only
    load_tokenizer(path)    -> TextTokenizer
    load_model(path, comm=None, max_slots=4096, dtype=torch.float32, device="cpu",
               num_layers=None, quant="auto") -> (Transformer, TextTokenizer)
    is_quantized(path)      -> bool: the checkpoint's matrices have a packed 4-/8-bit form
    packed_run(path, quant) -> bool: whether --quant QUANT runs this checkpoint packed

Quantized GGUF checkpoints (Q4_0/Q4_1/Q4_K, with Q5_0/Q5_1/Q6_K/Q8_0 beside them) run packed by
default (quant "auto" or "int4"): each matrix stays in its packed kind, read tensor by tensor
(cpu_quant, gguf_quant). quant "none" dequantizes to `dtype` as before; "int4" on a dense
checkpoint is refused.

Every problem with the files raises CheckpointError naming the file and the fix.
"""
from __future__ import annotations

import os

from swiftspec_mpi.core.errors import CheckpointError, UserError
from swiftspec_mpi.model.config import ModelConfig


def _kind(path) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        return "hf"
    if path.lower().endswith(".gguf"):
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; give an existing .gguf file (or fetch the "
                                  "model first with `swiftspec models`)")
        return "gguf"
    if os.path.isfile(path):
        raise CheckpointError(f"{path}: not a model; give a Hugging Face folder (config.json + "
                              "*.safetensors + tokenizer.json) or a .gguf file")
    raise CheckpointError(f"{path}: no such file or folder; give a Hugging Face model folder or a "
                          ".gguf file")


def read_model_config(path) -> ModelConfig:
    """The ModelConfig of a checkpoint without reading any weights."""
    if _kind(path) == "gguf":
        from swiftspec_mpi.model import gguf_loader
        src = gguf_loader.GGUFSource(os.fspath(path))
        try:
            return src.config
        finally:
            src.close()
    from swiftspec_mpi.model.hf_loader import read_config_json
    return ModelConfig.from_hf_dict(read_config_json(os.fspath(path)))


def load_tokenizer(path):
    """The TextTokenizer of a checkpoint (HF folder's tokenizer files, or the GGUF's own)."""
    if _kind(path) == "gguf":
        from swiftspec_mpi.model.gguf_tokenizer import tokenizer_from_gguf
        return tokenizer_from_gguf(os.fspath(path))
    from swiftspec_mpi.model.tokenizer import TextTokenizer
    return TextTokenizer.from_hf_folder(path)


def open_source(path):
    """The TensorSource of a checkpoint (SafetensorsSource or GGUFSource); caller closes it."""
    if _kind(path) == "gguf":
        from swiftspec_mpi.model import gguf_loader
        return gguf_loader.GGUFSource(os.fspath(path))
    from swiftspec_mpi.model.hf_loader import SafetensorsSource
    return SafetensorsSource(path)


_MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def is_quantized(path) -> bool:
    """True when the checkpoint's layer matrices have a packed 4-/8-bit form (a quantized GGUF)."""
    if _kind(path) != "gguf":
        return False
    from swiftspec_mpi.model import gguf_loader
    src = gguf_loader.GGUFSource(os.fspath(path))
    try:
        names = [n for n in src.names() if n.endswith(".weight") and
                 any(f".{m}." in n for m in _MATRICES)]
        return bool(names) and any(src.is_packed(n) for n in names)
    finally:
        src.close()


def packed_run(path, quant: str) -> bool:
    """Whether `--quant quant` runs checkpoint `path` with packed weights; UserError for int4 on
    a dense checkpoint."""
    if quant == "none":
        return False
    quantized = is_quantized(path)
    if quant == "int4" and not quantized:
        raise UserError(f"--quant int4: {os.fspath(path)} is a dense checkpoint (no 4-bit "
                        "weights); give a quantized GGUF file (Q4_0, Q4_1, Q4_K_M, ...) or use "
                        "--quant auto")
    return quantized


def load_model(path, comm=None, max_slots: int = 4096, dtype=None, device="cpu",
               num_layers: int | None = None, quant: str = "auto"):
    """Build the Transformer for this rank (only its tensor-parallel shard is read) and the
    tokenizer. `num_layers` truncates the model (self-speculation drafts). dtype defaults to
    torch.float32. `quant` ("auto" | "int4" | "none"): see the module doc (packed runs keep
    activations, norms and KV in float32 whatever `dtype`)."""
    import torch

    from swiftspec_mpi.model.transformer import Transformer
    dtype = torch.float32 if dtype is None else dtype
    tokenizer = load_tokenizer(path)
    source = open_source(path)
    try:
        cfg = source.config
        if num_layers is not None:
            if not 1 <= num_layers <= cfg.num_layers:
                raise CheckpointError(f"{path}: has {cfg.num_layers} layers; cannot keep "
                                      f"{num_layers}")
            cfg = cfg.with_layers(num_layers)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but "
                                  f"the model only {cfg.vocab_size} embeddings; the tokenizer "
                                  "does not belong to this model")
        packed = packed_run(path, quant)
        if packed and torch.device(device).type != "cpu":
            raise UserError(f"{os.fspath(path)}: packed 4-bit weights run on the CPU in this "
                            "build; use --device cpu, or --quant none to dequantize")
        model = Transformer(cfg, comm=comm, max_slots=max_slots, dtype=dtype, device=device,
                            quant=packed)
        model.load_weights(source)
    finally:
        source.close()
    return model, tokenizer
