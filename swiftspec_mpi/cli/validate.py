"""Rank 0's validation of a `swiftspec run` job, before any rank reads weights: flags and TOML,
environment switches, models (paths, configs, tokenizers, weight-file headers against the
configs), prompts against the context, tensor-parallel layouts, node memory, the --serve port.
Every problem raises one UserError that names the fix; nothing here imports torch before the
cheap checks passed.
"""
from __future__ import annotations

import glob
import os
import re
import socket
import sys

from swiftspec_mpi.checkpoints import gguf_loader, registry
from swiftspec_mpi.checkpoints import load as checkpoint
from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource, logical_shapes
from swiftspec_mpi.checkpoints.load import dummy_tokenizer, shape_config
from swiftspec_mpi.core import config as C
from swiftspec_mpi.core import switches
from swiftspec_mpi.core.errors import CheckpointError, UserError


def prepare_config(flags: dict, config_path: str | None, world_size: int,
                   ranks_on_node: int = 1) -> C.RunConfig:
    """Everything rank 0 checks before any rank reads weights; raises UserError with the fix.
    `ranks_on_node`: the ranks sharing rank 0's node (its memory)."""
    toml_values = C.load_toml(config_path) if config_path else {}
    cfg = C.merge(toml_values, flags)
    C.check_slurm_world(world_size)   # first: a PMI mismatch explains every other symptom
    C.validate_basic(cfg, world_size)
    switches.check_all()
    C.check_output_path_default(cfg)
    # cheap checks that need no model first (fail fast); then the models' configs and headers
    C.check_output_path(cfg)
    if cfg.accept_from is not None:
        from swiftspec_mpi.trace import acceptance
        cfg.accept_model, cfg.accept_sha256 = acceptance.load(cfg.accept_from)
        cfg.accept_from = os.path.abspath(cfg.accept_from)
    if C.requests_stream_in(cfg):
        cfg.requests = []            # they come from stdin or HTTP (interactive.py, http_server.py)
    elif cfg.prompts is not None:
        cfg.requests = C.read_prompts_file(cfg.prompts)
    else:
        cfg.requests = [C.Request(0, cfg.prompt if cfg.prompt is not None else C.DEFAULT_PROMPT)]
    tcfg, ttok, dcfg = resolve_models(cfg)
    for path, mcfg in {cfg.target: tcfg, cfg.draft: dcfg}.items():
        if path is not None and cfg.load_format != "dummy":   # dummy: shape names, no files
            check_weight_files(path, mcfg)
    resolve_quant(cfg)
    check_head_bits(cfg)
    if cfg.accept_model is not None:   # the replay's token ids (engine/replay.py child_tokens)
        cfg.accept_model["replay_vocab"] = min(tcfg.vocab_size, dcfg.vocab_size)
        cfg.ignore_eos = True          # its tokens mean nothing: every request runs to the end
    # tensor-parallel degrees must divide the heads
    if cfg.mode == "async":
        groups = [("target", tcfg, world_size - cfg.draft_ranks), ("draft", dcfg, cfg.draft_ranks)]
    else:
        groups = [("target", tcfg, world_size)] + ([("draft", dcfg, world_size)] if cfg.draft else [])
    for name, mcfg, tp in groups:
        if mcfg.num_heads % tp != 0:
            raise UserError(f"the {name} has {mcfg.num_heads} attention heads, not divisible by its "
                            f"group of {tp} ranks; choose a group size (--draft-ranks / -n) that "
                            "divides it")
        check_packed(cfg, cfg.target if name == "target" else cfg.draft, mcfg, tp, name)
    # requests
    limit = min(tcfg.max_position_embeddings,
                dcfg.max_position_embeddings if cfg.draft is not None else 1 << 30)
    margin = tree_margin(cfg)
    longest = 0
    for req in cfg.requests:
        text = ttok.apply_chat_template(req.prompt) if cfg.chat else req.prompt
        req.ids = ttok.encode(text)
        if not req.ids:
            raise UserError(f"prompt {req.index} tokenizes to nothing; give some text")
        need = len(req.ids) + cfg.max_new_tokens + C.max_verify_size(cfg)
        if need > limit:
            raise UserError(f"prompt {req.index} has {len(req.ids)} tokens; with --max-new-tokens "
                            f"{cfg.max_new_tokens} it needs {need} positions but the models' context "
                            f"is {limit}; shorten the prompt or lower --max-new-tokens")
        longest = max(longest, len(req.ids))
    # room for the longest prompt padded to its bucket as well (GPU prompt forwards, decoding._prefill);
    # imported here: the engine pulls in torch, which the cheap checks above do without
    from swiftspec_mpi.engine.decoding import prompt_bucket
    need_slots = max(longest + cfg.max_new_tokens + margin, prompt_bucket(longest - 1, limit))
    if cfg.max_context is not None and cfg.max_context < longest + cfg.max_new_tokens + C.max_verify_size(cfg):
        raise UserError(f"--max-context {cfg.max_context} cannot hold the longest prompt ({longest} "
                        f"tokens) plus --max-new-tokens {cfg.max_new_tokens}; raise it to at least "
                        f"{longest + cfg.max_new_tokens + C.max_verify_size(cfg)}")
    if C.requests_stream_in(cfg):
        if cfg.max_context is None:
            cfg.max_context = min(limit, max(C.INTERACTIVE_CONTEXT, cfg.max_new_tokens + margin + 256))
        if interactive_room(cfg) < 16:
            raise UserError(f"--max-context {cfg.max_context} leaves {max(0, interactive_room(cfg))} tokens "
                            f"for a prompt after --max-new-tokens {cfg.max_new_tokens} and the tree's "
                            f"{margin} slots; raise --max-context (the models allow {limit}) or lower "
                            "--max-new-tokens")
        if cfg.serve is not None:
            check_port_free(cfg.serve)
    elif cfg.max_context is None:
        cfg.max_context = need_slots
    check_memory(cfg, tcfg, dcfg, world_size, ranks_on_node)
    return cfg


def check_packed(cfg: C.RunConfig, path: str, mcfg, tp: int, role: str) -> None:
    """UserError when --quant does not fit the checkpoint (or the dummy shape's layers do not
    take whole groups of random packed weights), or when a tensor-parallel group of `tp` ranks
    would cut its 4-bit groups (packed.int4.check_tp_groups)."""
    from swiftspec_mpi.packed.int4 import check_tp_groups
    group = checkpoint.packed_group(path, cfg.quant, cfg.load_format)
    if group is None:
        return
    if cfg.load_format == "dummy":
        inputs = {"hidden size": mcfg.hidden_size, "attention width": mcfg.num_heads * mcfg.head_dim,
                  "MLP size": mcfg.intermediate_size}
        bad = [f"{k} {v}" for k, v in inputs.items() if v % group]
        if bad:
            raise UserError(f"--quant int4 --load-format dummy: random packed weights come in "
                            f"groups of {group} inputs, which the {role}'s {', '.join(bad)} do not "
                            "fill; use --quant none or a shape whose layers take whole groups")
    check_tp_groups(mcfg, group, tp, f"the {role}")


def check_weight_files(path: str, mcfg=None) -> None:
    """Rank 0's cheap check of a checkpoint's weight files (headers only, no torch, no weights
    read), so a broken file fails here instead of after every rank loaded its other model:

    - HF folder: every safetensors header parses and matches its file size;
    - both formats, given the checkpoint's ModelConfig `mcfg`: the tensor table agrees with it
      (each tensor the model reads is there with the shape the config implies). A config that
      disagrees with its tensors (a corrupt GGUF metadata value, an edited config.json) would
      otherwise make every rank allocate what the config says: a giant allocation, an hour in
      a loop, or the OOM killer, instead of this one line.
    Raises CheckpointError (a UserError)."""
    if os.path.isdir(path):
        with SafetensorsSource(path, framework="numpy") as src:
            shapes = logical_shapes(path, src.shapes())      # AWQ/GPTQ layers: [N, K]
    else:
        src = gguf_loader.GGUFSource(path)       # the header read_model_config parsed (cached)
        try:
            shapes = {name: tuple(src.shape(name)) for name in src.names()}
        finally:
            src.close()
    if mcfg is not None:
        check_shapes(path, mcfg, shapes)


def check_shapes(path: str, m, shapes: dict) -> None:
    """CheckpointError unless `shapes` (HF tensor name -> shape) holds every tensor the
    Transformer of ModelConfig `m` reads, with the shape `m` implies (extra tensors are fine)."""
    where = "config.json" if os.path.isdir(path) else "GGUF metadata"
    fix = "the config does not belong to these weights (or the file is corrupt); re-download " \
          "or re-convert the checkpoint"
    layers = {int(g.group(1)) for g in map(re.compile(r"model\.layers\.(\d+)\.").match, shapes) if g}
    n_file = max(layers) + 1 if layers else 0
    keys = (("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_size", "intermediate_size", "vocab_size") if os.path.isdir(path) else
            ("block_count", "attention.head_count", "attention.head_count_kv", "key_length",
             "embedding_length", "feed_forward_length", "vocabulary (token_embd rows)"))
    values = (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size,
              m.intermediate_size, m.vocab_size)
    bad = [f"{k}={v}" for k, v in zip(keys, values) if not 0 < v < 1 << 31]
    if bad:
        raise CheckpointError(f"{path}: {where} has {', '.join(bad)}; {fix}")
    if m.num_layers > n_file:
        raise CheckpointError(f"{path}: {where} says {m.num_layers} layers but the weights hold "
                              f"{n_file}; {fix}")
    want = m.hf_shapes()
    for name, shape in want.items():
        got = shapes.get(name)
        if got is None:
            raise CheckpointError(f"{path}: lacks tensor {name!r}; {fix}")
        if tuple(got) != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(got)} but the "
                                  f"{where} implies {list(shape)}; {fix}")


def _host_memory_available() -> int | None:
    """Bytes this node can still give (MemAvailable, capped by a cgroup v2 limit); None if
    unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def _gpu_visible() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def kv_element_bytes(cfg: C.RunConfig) -> int:
    """Bytes per KV element: the CPU path keeps activations and KV in float32 whatever the
    weights' dtype (model.py, "packed" layout); on the GPU the KV is in the run's dtype."""
    return 4 if cfg.dtype == "float32" or _on_cpu(cfg) else 2


def rank_memory_bytes(cfg: C.RunConfig, tcfg, dcfg, world_size: int) -> list[tuple[int, int]]:
    """(static buffers = KV cache + RoPE tables, weights) in bytes for each world rank: what
    its Transformer(s) allocate up front (model.py: K and V [layers, max_context, local KV
    heads, head_dim], float32 RoPE tables of max_context + 256 rows). Packed weights (--quant
    int4): about a byte a parameter (4-bit records with float32 scales, 8-bit Q6_K/Q8_0)."""
    elem = 1 if cfg.quant == "int4" else 4 if cfg.dtype == "float32" else 2
    kv_elem = kv_element_bytes(cfg)

    def one(m, tp):
        if m is None:
            return 0, 0
        kv_local = max(1, -(-m.num_kv_heads // tp))
        kv = 2 * m.num_layers * cfg.max_context * kv_local * m.head_dim * kv_elem
        rope = 4 * (cfg.max_context + 256) * m.head_dim * 4
        return kv + rope, m.param_count() * elem // tp

    if dcfg is not None and cfg.draft_layers is not None:
        dcfg = dcfg.with_layers(min(cfg.draft_layers, dcfg.num_layers))
    if cfg.mode == "async":
        v = world_size - cfg.draft_ranks
        return [one(tcfg, v)] * v + [one(dcfg, cfg.draft_ranks)] * cfg.draft_ranks
    t, d = one(tcfg, world_size), one(dcfg if cfg.mode == "sync" else None, world_size)
    return [(t[0] + d[0], t[1] + d[1])] * world_size


def check_memory(cfg: C.RunConfig, tcfg, dcfg, world_size: int, ranks_on_node: int) -> None:
    """Refuse a CPU run whose up-front allocations cannot fit in rank 0's node: a too large
    --max-context would otherwise get the ranks killed by the OOM killer (no message, after
    minutes of loading) instead of this one line. GPU runs are checked when they allocate."""
    if cfg.device == "cuda" or (cfg.device == "auto" and _gpu_visible()):
        return
    avail = _host_memory_available()
    if avail is None:
        return
    per_rank = rank_memory_bytes(cfg, tcfg, dcfg, world_size)
    mine = per_rank[:max(1, min(ranks_on_node, world_size))]   # block placement: 0..L-1
    buffers, weights = sum(b for b, _ in mine), sum(w for _, w in mine)
    if buffers + weights > 0.9 * avail:
        gib = 2 ** 30
        raise UserError(f"not enough memory: the KV cache (and RoPE tables) of --max-context "
                        f"{cfg.max_context} slots needs {max(b for b, _ in mine) / gib:.2f} GiB per "
                        f"rank, {(buffers + weights) / gib:.2f} GiB with the weights for the "
                        f"{len(mine)} rank(s) on this node, but only {avail / gib:.2f} GiB is "
                        "available; lower --max-context or --max-new-tokens, use --dtype "
                        "bfloat16, or spread the ranks over more nodes")


def _on_cpu(cfg: C.RunConfig) -> bool:
    return cfg.device == "cpu" or (cfg.device == "auto" and not _gpu_visible())


def check_quant(cfg: C.RunConfig) -> None:
    """--quant int4 on the GPU runs packed 4-bit projections through the W4A16 kernels: it needs
    --dtype bfloat16 (AWQ/GPTQ checkpoints or random packed weights: checkpoints.load.gpu_packed, which
    refuses GGUF files there). On the CPU, resolve_quant."""
    if cfg.quant != "int4" or _on_cpu(cfg):
        return
    if cfg.dtype != "bfloat16":
        raise UserError("--quant int4 runs bf16 activations on the GPU; add --dtype bfloat16")


def resolve_quant(cfg: C.RunConfig) -> None:
    """Resolve --quant auto to what runs ("int4" when every model keeps packed weights, "none"
    when none does; auto stays for a mix), so the trace's config says which was used. On the CPU
    quantized checkpoints (GGUF Q4/Q5/Q6/Q8 kinds, AWQ, GPTQ) run packed on CPUs with AVX2 + FMA
    (model.cpu_quant); on the GPU AWQ/GPTQ checkpoints run packed with --dtype bfloat16
    (checkpoints.load.gpu_packed), other checkpoints dequantized. int4 on a dense checkpoint is
    refused (checkpoints.load.packed_group)."""
    if cfg.quant == "none":
        return
    models = [p for p in (cfg.target, cfg.draft) if p is not None]
    if not _on_cpu(cfg):
        packed = {cfg.dtype == "bfloat16" and checkpoint.gpu_packed(p, cfg.quant, cfg.load_format)
                  for p in models}
        if cfg.quant == "int4" and packed != {True}:
            raise UserError("--quant int4: a model has no 4-bit weights the GPU can run packed; "
                            "use --quant auto")
    else:
        from swiftspec_mpi.packed import cpu_linear          # imports torch: after the cheap checks
        if not cpu_linear.has_avx2():
            if cfg.quant == "int4":
                raise UserError("--quant int4: packed weights run on CPUs with AVX2 + FMA, which "
                                "this one lacks; use --quant none (dequantized to --dtype)")
            cfg.quant = "none"
            return
        packed = {checkpoint.packed_group(p, cfg.quant, cfg.load_format) is not None for p in models}
    if cfg.quant == "auto" and len(packed) == 1:
        cfg.quant = "int4" if packed.pop() else "none"


def check_head_bits(cfg: C.RunConfig) -> None:
    """--head-bits 4 packs the LM head for the GPU's 4-bit kernels: only where they run."""
    if cfg.head_bits == 4 and (_on_cpu(cfg) or cfg.quant == "none"):
        raise UserError("--head-bits 4 packs the LM head for the GPU's 4-bit kernels; it needs a GPU "
                        "(--device cuda) and 4-bit models (--quant int4 or auto with AWQ/GPTQ "
                        "checkpoints); drop --head-bits")


def resolve_models(cfg: C.RunConfig):
    """Fill cfg.target / cfg.draft with paths; -> (target ModelConfig, target tokenizer, draft
    ModelConfig or None). Reads configs and tokenizers only."""
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    check_quant(cfg)
    # registry names: the GGUF file where it runs packed (CPU), else the prepared bf16 folder
    reg_quant = cfg.quant if _on_cpu(cfg) else "none"
    if cfg.load_format == "dummy":
        if cfg.target is None:
            raise UserError("--load-format dummy needs --target SHAPE (e.g. llama-3-8b) or a checkpoint")
        if cfg.mode != "ar" and cfg.draft is None and cfg.draft_layers is None:
            raise UserError(f"--mode {cfg.mode} needs --draft SHAPE or --draft-layers N")
        if cfg.mode == "ar":
            cfg.draft = None
        elif cfg.draft is None:
            cfg.draft = cfg.target
        tcfg = shape_config(cfg.target)
        dcfg = shape_config(cfg.draft) if cfg.draft else None
        return tcfg, dummy_tokenizer(cfg.target), dcfg
    if cfg.target is None and cfg.draft is None and cfg.draft_layers is None:
        t, d = registry.default_pair(log=log, quant=reg_quant)
        cfg.target, cfg.draft = os.fspath(t), (os.fspath(d) if cfg.mode != "ar" else None)
    else:
        if cfg.target is None:
            raise UserError("--draft given without --target; give both (or neither, for the "
                            "embedded default pair)")
        cfg.target = registry.resolve_flag(cfg.target, "--target", log, reg_quant)
        if cfg.mode != "ar":
            if cfg.draft is None and cfg.draft_layers is None:
                raise UserError(f"--mode {cfg.mode} needs a draft model: give --draft PATH, or "
                                "--draft-layers N to use the target's first N layers")
            cfg.draft = registry.resolve_flag(cfg.draft, "--draft", log, reg_quant) if cfg.draft is not None else cfg.target
        else:
            cfg.draft = None
    tcfg = _checked(checkpoint.read_model_config, cfg.target, "target")
    ttok = _checked(checkpoint.load_tokenizer, cfg.target, "target")
    if ttok.vocab_size > tcfg.vocab_size:
        raise UserError(f"--target {cfg.target}: the tokenizer has {ttok.vocab_size} tokens but the "
                        f"model only {tcfg.vocab_size} embeddings; the tokenizer does not belong "
                        "to this model")
    dcfg = None
    if cfg.draft is not None:
        dcfg = _checked(checkpoint.read_model_config, cfg.draft, "draft")
        if cfg.draft_layers is not None and cfg.draft_layers > dcfg.num_layers:
            raise UserError(f"--draft-layers {cfg.draft_layers} exceeds the draft's "
                            f"{dcfg.num_layers} layers")
        dtok = _checked(checkpoint.load_tokenizer, cfg.draft, "draft") \
            if cfg.draft != cfg.target else ttok
        if dtok.fingerprint() != ttok.fingerprint():
            raise UserError(f"draft {cfg.draft} and target {cfg.target} use different tokenizers; "
                            "speculative decoding needs the same vocabulary: pick a draft of the "
                            "target's family")
        if dtok.vocab_size > dcfg.vocab_size:
            raise UserError(f"--draft {cfg.draft}: the tokenizer has {dtok.vocab_size} tokens but "
                            f"the model only {dcfg.vocab_size} embeddings; pick a draft of the "
                            "target's family")
    return tcfg, ttok, dcfg


def _checked(read, path: str, role: str):
    """read(path), its errors naming the model: a CheckpointError that does not say which file
    gets "--ROLE PATH: " in front; any other exception (a config value that breaks the parser,
    e.g. num_attention_heads 0) becomes a CheckpointError too, instead of a traceback."""
    try:
        return read(path)
    except CheckpointError as exc:
        msg = str(exc)
        if path in msg:
            raise
        raise CheckpointError(f"--{role} {path}: {msg}") from None
    except (ValueError, TypeError, KeyError, ZeroDivisionError, OverflowError, AttributeError) as exc:
        raise CheckpointError(f"--{role} {path}: its config cannot be read ({type(exc).__name__}: "
                              f"{exc}); re-download or re-convert the checkpoint") from None


def check_port_free(spec: str) -> None:
    """--serve: rank 0 can bind the address (checked before any rank loads weights)."""
    host, port = C.parse_serve_address(spec)
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise UserError(f"--serve {spec}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                        "choose another port (or 0 for any free one)") from None


def interactive_room(cfg: C.RunConfig) -> int:
    """Prompt tokens an --interactive turn or a --serve request may have: the KV slots less the
    new tokens and the tree's margin (with --chat, the oldest turns are left out to stay within
    it). Job.__init__ takes it before the startup profile fixes bs and w (the margin then counts
    their largest choice), so it depends on the flags and models alone."""
    return cfg.max_context - cfg.max_new_tokens - tree_margin(cfg)


def tree_margin(cfg: C.RunConfig) -> int:
    """KV slots beyond the committed tokens: the verify tree, or the draft's expanded nodes."""
    return C.max_verify_size(cfg) + 2 * C.max_tree_width(cfg) + \
        min(cfg.tree_capacity // max(1, cfg.tree_topk), 256)
