"""Write a small random target/draft pair as two Hugging Face folders, DIR/target and DIR/draft.

Each folder holds config.json, model.safetensors (float32), tokenizer.json (a real byte-level
BPE, 2048 tokens, trained on the Spec-Bench questions), tokenizer_config.json (ChatML chat
template, eos <|im_end|>) and generation_config.json, so every loader and transformers itself
can read them. The draft shares the target's embedding, final norm, head and first layers, so it
agrees with the target's greedy token most of the time (speculation gets accepted), while the
target's later layers make it differ sometimes. Fast enough for mpiexec tests of whole
generations on a laptop.

`--quantize awq|gptq|gptq-sym|gptq-v2` writes the pair as a 4-bit checkpoint instead: every
decoder layer's projections rounded to nearest in groups of `--group-size` inputs and stored in
that format's real layout (hf_quant.py) with its `quantization_config`; embeddings, norms, biases
and the head stay float32, as AutoAWQ and GPTQ leave them.
"""
from __future__ import annotations

import json
import os
import shutil

DEFAULTS = dict(arch="qwen2", layers=4, draft_layers=2, hidden=64, heads=4, kv_heads=2,
                intermediate=176)
QUANTIZED_INTERMEDIATE = 192     # the default MLP width of a 4-bit pair: a multiple of every group
# --quantize name -> (quant_method, symmetric, classic "z - 1" zero points)
QUANT_LAYOUTS = {"awq": ("awq", False, False), "gptq": ("gptq", False, True),
                 "gptq-sym": ("gptq", True, True), "gptq-v2": ("gptq", False, False)}


def add_arguments(parser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output folder (DIR/target and DIR/draft)")
    parser.add_argument("--arch", choices=("qwen2", "llama"), default=DEFAULTS["arch"],
                        help="model family (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    parser.add_argument("--layers", type=int, default=DEFAULTS["layers"],
                        help="target layers (default %(default)s)")
    parser.add_argument("--draft-layers", type=int, default=DEFAULTS["draft_layers"],
                        help="draft layers, shared with the target's first ones "
                             "(default %(default)s)")
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"],
                        help="hidden size (default %(default)s)")
    parser.add_argument("--heads", type=int, default=DEFAULTS["heads"],
                        help="attention heads (default %(default)s)")
    parser.add_argument("--kv-heads", type=int, default=DEFAULTS["kv_heads"],
                        help="key/value heads (default %(default)s)")
    parser.add_argument("--intermediate", type=int,
                        help=f"MLP width (default {DEFAULTS['intermediate']}, "
                             f"{QUANTIZED_INTERMEDIATE} with --quantize)")
    parser.add_argument("--quantize", choices=tuple(QUANT_LAYOUTS),
                        help="write a 4-bit checkpoint in this layout (AutoAWQ gemm; GPTQ "
                             "asymmetric, symmetric, or the v2 zero points)")
    parser.add_argument("--group-size", type=int, default=32,
                        help="inputs per 4-bit group with --quantize: 32, 64 or 128 "
                             "(default %(default)s)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite DIR/target and DIR/draft if they exist")


def main(args) -> int:
    from swiftspec_mpi.core.errors import UserError
    for sub in ("target", "draft"):
        p = os.path.join(args.dir, sub)
        if os.path.exists(p) and os.listdir(p) and not args.force:
            raise UserError(f"{p} exists and is not empty; pass --force to overwrite it")
    if not 1 <= args.draft_layers <= args.layers:
        raise UserError(f"--draft-layers {args.draft_layers} must be between 1 and --layers "
                        f"{args.layers}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise UserError("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    inter = args.intermediate or (QUANTIZED_INTERMEDIATE if args.quantize else
                                  DEFAULTS["intermediate"])
    if args.quantize:
        from swiftspec_mpi.packed.int4 import GROUP_SIZES
        g = args.group_size
        if g not in GROUP_SIZES or args.hidden % g or inter % g:
            raise UserError(f"--group-size {g} must be one of {GROUP_SIZES} and divide --hidden "
                            f"{args.hidden} and --intermediate {inter}")
    target, draft = write_tiny_pair(args.dir, seed=args.seed, arch=args.arch, layers=args.layers,
                                    draft_layers=args.draft_layers, hidden=args.hidden,
                                    heads=args.heads, kv_heads=args.kv_heads,
                                    intermediate=inter, quantize=args.quantize,
                                    group=args.group_size)
    print(f"target: {target}\ndraft:  {draft}")
    return 0


def _data_file(name: str) -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", name)


def tiny_config(arch="qwen2", layers=4, hidden=64, heads=4, kv_heads=2, intermediate=176):
    """The ModelConfig of a tiny model over the packaged tokenizer."""
    from tokenizers import Tokenizer

    from swiftspec_mpi.network.config import ModelConfig
    tok = Tokenizer.from_file(_data_file("tiny_tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    return ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
        attention_bias=(arch == "qwen2"), max_position_embeddings=4096, bos_token_id=None,
        eos_token_ids=eos)


def random_weights(cfg, seed: int = 0, late_scale: float = 0.15, first_late: int | None = None):
    """HF-named float32 tensors for `cfg`. Embedding rows have unit RMS; attention/MLP outputs of
    layers >= first_late are scaled by late_scale (how much the target's deeper layers move the
    argmax away from a draft made of the earlier ones)."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    H, hd, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    first_late = cfg.num_layers // 2 if first_late is None else first_late
    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out = 1.0 if i < first_late else late_scale
        w[p + "input_layernorm.weight"] = 1.0 + rnd(H, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rnd(H, std=0.1)
        w[p + "self_attn.q_proj.weight"] = rnd(nq, H, std=2.0 / H ** 0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv, H, std=2.0 / H ** 0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv, H, std=1.0 / H ** 0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(H, nq, std=out / nq ** 0.5)
        if cfg.attention_bias:
            w[p + "self_attn.q_proj.bias"] = rnd(nq, std=0.1)
            w[p + "self_attn.k_proj.bias"] = rnd(nkv, std=0.1)
            w[p + "self_attn.v_proj.bias"] = rnd(nkv, std=0.1)
        if cfg.o_bias:
            w[p + "self_attn.o_proj.bias"] = rnd(H, std=0.1)
        w[p + "mlp.gate_proj.weight"] = rnd(I, H, std=1.0 / H ** 0.5)
        w[p + "mlp.up_proj.weight"] = rnd(I, H, std=1.0 / H ** 0.5)
        w[p + "mlp.down_proj.weight"] = rnd(H, I, std=out / I ** 0.5)
    w["model.norm.weight"] = 1.0 + rnd(H, std=0.1)
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = rnd(cfg.vocab_size, H, std=4.0 / H ** 0.5)
    return w


def quantize_weights(tensors: dict, layout: str, group: int) -> tuple[dict, dict]:
    """HF-named float32 tensors -> (the same with every decoder projection `P.weight` replaced
    by its 4-bit tensors in `layout` (a QUANT_LAYOUTS name), round to nearest, and the
    `quantization_config` that describes them)."""
    from swiftspec_mpi.checkpoints import hf_quant
    from swiftspec_mpi.packed import int4
    method, sym, plus_one = QUANT_LAYOUTS[layout]
    out = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            codes, zeros, scales = int4.quantize_rtn(t, group, sym=sym)
            packed = (hf_quant.pack_awq(codes, zeros, scales) if method == "awq" else
                      hf_quant.pack_gptq(codes, zeros, scales, zero_plus_one=plus_one))
            prefix = name[:-len(".weight")]
            out.update({f"{prefix}.{part}": v for part, v in packed.items()})
        else:
            out[name] = t
    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
              "sym": sym, "checkpoint_format": "gptq" if plus_one else "gptq_v2"}
    return out, qc


def write_hf_folder(folder: str, cfg, tensors: dict, quantization_config: dict | None = None) -> str:
    """config.json (with `quantization_config` when given) + model.safetensors + the packaged
    tokenizer files into `folder`."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    hf = cfg.to_hf_dict()
    if quantization_config is not None:
        hf["quantization_config"] = quantization_config
        hf["torch_dtype"] = "float16"
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
        f.write("\n")
    gen = {"eos_token_id": list(cfg.eos_token_ids), "do_sample": False}
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "model.safetensors"))
    shutil.copyfile(_data_file("tiny_tokenizer.json"), os.path.join(folder, "tokenizer.json"))
    shutil.copyfile(_data_file("tiny_tokenizer_config.json"),
                    os.path.join(folder, "tokenizer_config.json"))
    return folder


def write_tiny_pair(out_dir, seed: int = 0, arch: str = "qwen2", layers: int = 4,
                    draft_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 176, late_scale: float = 0.15, quantize: str | None = None,
                    group: int = 32) -> tuple[str, str]:
    """Write out_dir/target and out_dir/draft; returns their paths. The draft is the target's
    first `draft_layers` layers with the same embedding, final norm and head. `quantize`: a
    QUANT_LAYOUTS name (4-bit pair, groups of `group` inputs) or None (float32)."""
    cfg = tiny_config(arch, layers, hidden, heads, kv_heads, intermediate)
    w = random_weights(cfg, seed=seed, late_scale=late_scale, first_late=draft_layers)
    qc = None
    if quantize is not None:
        w, qc = quantize_weights(w, quantize, group)
    target = write_hf_folder(os.path.join(out_dir, "target"), cfg, w, qc)
    dcfg = cfg.with_layers(draft_layers)
    keep = {k: v for k, v in w.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    draft = write_hf_folder(os.path.join(out_dir, "draft"), dcfg, keep, qc)
    return target, draft
