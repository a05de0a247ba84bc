"""`load_model(path, ...)`: pick the loader for a checkpoint path (Hugging Face folder or *.gguf
file), build the sharded `Transformer` and the `TextTokenizer`.

    read_model_config(path) -> ModelConfig      cheap: reads config.json / GGUF metadata only
    packed_group(path, quant, load_format) -> int | None
                                                cheap: the group size of the packed weights a
                                                run with `--quant quant` keeps (None: dense)
    load_tokenizer(path)    -> TextTokenizer
    load_model(path, comm=None, max_slots=4096, dtype=torch.float32, device="cpu",
               num_layers=None, quant="auto") -> (Transformer, TextTokenizer)

`--load-format dummy` (random weights, dummy.py) has the same three by shape name or path:
shape_config(spec), dummy_tokenizer(spec), dummy_model(spec, comm, max_slots, dtype, device).

Quantized checkpoints (GGUF Q4_0/Q4_1/Q4_K, with Q5_0/Q5_1/Q6_K/Q8_0 beside them; AWQ and GPTQ
folders) run packed on the CPU by default (quant "auto" or "int4"): each matrix stays in its
packed kind, read a few MiB at a time through the source's `packed_chunks` (cpu_quant,
gguf_packed, hf_quant). On the GPU, and with quant "none", they are dequantized to `dtype`;
"int4" on a dense checkpoint is refused. (The GPU's W4A16 path runs random packed weights:
dummy.py.)

Every problem with the files raises CheckpointError naming the file and the fix.
"""
from __future__ import annotations

import os

from swiftspec_mpi.checkpoints.dummy import SHAPES, RandomPackedSource, RandomSource
from swiftspec_mpi.core.errors import CheckpointError, UserError
from swiftspec_mpi.network.config import ModelConfig


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
        from swiftspec_mpi.checkpoints import gguf_loader
        src = gguf_loader.GGUFSource(os.fspath(path))
        try:
            return src.config
        finally:
            src.close()
    from swiftspec_mpi.checkpoints.hf_loader import read_config_json
    return ModelConfig.from_hf_dict(read_config_json(os.fspath(path)))


def packed_group(path, quant: str, load_format: str = "auto") -> int | None:
    """The group size of the packed weights a run with `--quant quant` keeps for this checkpoint
    (or --load-format dummy shape), None when its weights run dense: an AWQ/GPTQ folder's
    group_size, a quantized GGUF's largest packed group (gguf_packed.file_group). Reads
    config.json or the GGUF header only. UserError for --quant int4 on a dense checkpoint and
    for a GPTQ checkpoint in act order (desc_act=True) unless --quant none dequantizes it."""
    if quant == "none":
        return None
    if load_format == "dummy":
        return RandomPackedSource.GROUP if quant == "int4" else None
    if _kind(path) == "gguf":
        from swiftspec_mpi.checkpoints import gguf_loader, gguf_packed
        src = gguf_loader.GGUFSource(os.fspath(path))
        try:
            group = gguf_packed.file_group(src)
        finally:
            src.close()
        if group is None and quant == "int4":
            raise UserError(f"--quant int4: {os.fspath(path)} holds dense weights (no 4-bit "
                            "matrices); give a quantized GGUF file (Q4_0, Q4_1, Q4_K_M, ...) or "
                            "use --quant auto")
        return group
    from swiftspec_mpi.checkpoints.hf_loader import read_quantization
    q = read_quantization(os.fspath(path))
    if q is None:
        if quant == "int4":
            raise UserError(f"--quant int4: {path} holds dense weights (no quantization_config in "
                            "config.json); int4 runs 4-bit checkpoints (AWQ, GPTQ, GGUF Q4) or "
                            "random weights with --load-format dummy; use --quant auto")
        return None
    if q.desc_act:
        raise UserError(f"{path}: a GPTQ checkpoint in act order (desc_act=true) scatters each "
                        "4-bit group over the input, which the packed form cannot hold without "
                        "permuting every layer's activations; run it with --quant none "
                        "(dequantized to --dtype) or use one quantized with desc_act=false")
    return q.group


def load_tokenizer(path):
    """The TextTokenizer of a checkpoint (HF folder's tokenizer files, or the GGUF's own)."""
    if _kind(path) == "gguf":
        from swiftspec_mpi.checkpoints.gguf_tokenizer import tokenizer_from_gguf
        return tokenizer_from_gguf(os.fspath(path))
    from swiftspec_mpi.checkpoints.tokenizer import TextTokenizer
    return TextTokenizer.from_hf_folder(path)


def open_source(path):
    """The TensorSource of a checkpoint (SafetensorsSource or GGUFSource); caller closes it."""
    if _kind(path) == "gguf":
        from swiftspec_mpi.checkpoints import gguf_loader
        return gguf_loader.GGUFSource(os.fspath(path))
    from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
    return SafetensorsSource(path)


def gpu_packed(path, quant: str, load_format: str = "auto") -> bool:
    """Whether checkpoint `path` (or --load-format dummy shape) runs its projections packed 4-bit
    through the W4A16 kernels on the GPU under `--quant quant` (bf16 activations): random int4
    weights, and AWQ/GPTQ folders (group 32, 64 or 128) unless --quant none. GGUF files run
    dequantized there (their Q4_K_M mixes 4- and 6-bit projections); UserError for --quant int4
    on one, and for the cases packed_group refuses."""
    if quant == "none":
        return False
    if load_format == "dummy":
        return quant == "int4"
    if _kind(path) == "gguf":
        if quant == "int4":
            raise UserError(f"--quant int4: {os.fspath(path)} is a GGUF file, whose 4-bit blocks run "
                            "packed on the CPU (--device cpu); on the GPU use --quant auto or none "
                            "(dequantized to --dtype), or an AWQ/GPTQ checkpoint")
        return False
    group = packed_group(path, quant, load_format)
    if group is None:
        return False
    from swiftspec_mpi.gpu.w4a16 import CHUNK, TILE, supported   # the kernels' shape rule
    m = read_model_config(path)
    inputs = (m.hidden_size, m.num_heads * m.head_dim, m.intermediate_size)     # K of each kind
    rows = (m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size, m.hidden_size)
    why = (f"4-bit groups of {group} inputs, which the GPU kernels do not take"
           if not supported(TILE, CHUNK, group) else
           f"projection inputs that are not multiples of {CHUNK}" if any(k % CHUNK for k in inputs) else
           f"projection outputs that are not multiples of {TILE}" if any(n % TILE for n in rows) else None)
    if why is not None:
        if quant == "int4":
            raise UserError(f"--quant int4: {os.fspath(path)} has {why}; use --quant none "
                            "(dequantized to --dtype) or --device cpu")
        return False
    return True


def _runs_packed(path, quant: str, on_cpu: bool) -> bool:
    """Whether checkpoint `path` keeps its packed weights under `--quant quant`: on the CPU in
    cpu_quant's records (needs AVX2 + FMA), on the GPU as W4A16 weights (gpu_packed)."""
    from swiftspec_mpi.packed import cpu_linear
    if not on_cpu:
        return gpu_packed(path, quant)
    if packed_group(path, quant) is None:
        return False
    if quant == "int4" and not cpu_linear.has_avx2():
        raise UserError("--quant int4: packed weights run on CPUs with AVX2 + FMA, which this "
                        "one lacks; use --quant none (dequantized to --dtype)")
    return cpu_linear.has_avx2()


def load_model(path, comm=None, max_slots: int = 4096, dtype=None, device="cpu",
               num_layers: int | None = None, quant: str = "auto"):
    """Build the Transformer for this rank (only its tensor-parallel shard is read) and the
    tokenizer. `num_layers` truncates the model (self-speculation drafts). dtype defaults to
    torch.float32. `quant` ("auto" | "int4" | "none"): see the module doc (packed CPU runs keep
    activations, norms and KV in float32 whatever `dtype`). UserError for int4 where packed
    weights cannot run: a dense checkpoint, a GGUF file on the GPU, a CPU without AVX2 + FMA.
    On the GPU, packed AWQ/GPTQ weights need dtype bfloat16 (else they run dequantized)."""
    import torch

    from swiftspec_mpi.network.transformer import Transformer
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
        on_cpu = torch.device(device).type == "cpu"
        packed = _runs_packed(path, quant, on_cpu) and (on_cpu or dtype == torch.bfloat16)
        model = Transformer(cfg, comm=comm, max_slots=max_slots, dtype=dtype, device=device,
                            quant="int4" if packed else "none")
        model.load_weights(source)
    finally:
        source.close()
    return model, tokenizer


# ------------------------------------------------------------------ --load-format dummy
def shape_config(spec: str) -> ModelConfig:
    """A named shape, or the config.json/GGUF metadata of a checkpoint path."""
    if spec in SHAPES:
        return SHAPES[spec]
    try:
        return read_model_config(spec)
    except UserError:
        raise UserError(f"--load-format dummy: '{spec}' is neither a known shape "
                        f"({', '.join(SHAPES)}) nor a checkpoint path") from None


def dummy_model(spec: str, comm, max_slots: int, dtype, device, num_layers=None, quant: str = "none"):
    """-> (Transformer with random weights at the shape of `spec`, tokenizer of `spec` if it is a
    checkpoint, else the bundled tiny tokenizer: prompts then map to ids < 4k, valid for any
    vocabulary). quant "int4": the layers' projections packed 4-bit (RandomPackedSource), run by the
    W4A16 kernels on the GPU and by cpu_quant's packed layers on the CPU."""
    from swiftspec_mpi.network.transformer import Transformer
    cfg = shape_config(spec)
    if num_layers is not None:
        cfg = cfg.with_layers(num_layers)
    int4 = quant == "int4"
    model = Transformer(cfg, comm=comm, max_slots=max_slots, dtype=dtype, device=device,
                        quant="int4" if int4 else "none")
    model.load_weights((RandomPackedSource if int4 else RandomSource)(cfg, device=device, dtype=dtype))
    return model, dummy_tokenizer(spec)


def dummy_tokenizer(spec: str):
    """The tokenizer for --load-format dummy runs of `spec`: the checkpoint's own when `spec` is a
    checkpoint path, else the small tokenizer shipped in swiftspec_mpi/data (tiny_tokenizer.json)."""
    if spec not in SHAPES:
        try:
            return load_tokenizer(spec)
        except UserError:
            pass
    from tokenizers import Tokenizer

    from swiftspec_mpi.checkpoints.tokenizer import TextTokenizer
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tiny_tokenizer.json")
    tok = Tokenizer.from_file(path)
    return TextTokenizer(tok, (tok.token_to_id("<|endoftext|>"),))
