"""One `swiftspec run` job on every rank: validate (rank 0) -> topology -> load models ->
profile -> decode every request -> gather the trace -> write HDF5. Failure handling lives here:

- bad input: rank 0 raises UserError before any heavy work; the verdict is broadcast and every
  rank exits with EXIT_USER_ERROR; the message is printed once.
- a rank failing while loading: all ranks agree on the first error (allgather) and exit together.
- a rank failing later: rank 0 writes what was generated and aborts the job; another rank tells
  rank 0 (abort notice), then aborts the job itself after a grace period.
- SIGTERM/SIGINT (Slurm time limit, scancel): every rank finishes its step, rank 0 writes the
  partial file (complete=False, exit_status "interrupted"), all exit EXIT_INTERRUPTED.
"""
from __future__ import annotations

import os
import platform
import signal
import sys
import time
import traceback

import numpy as np

from swiftspec_mpi.core import config as C
from swiftspec_mpi.core.errors import (EXIT_INTERRUPTED, EXIT_RUNTIME_ERROR, EXIT_USER_ERROR, PeerError,
                                  UserError)
from swiftspec_mpi.gpu.sharing import check_gpu_sharing

CHECKPOINT_EVERY_S = 5.0


# ---------------------------------------------------------------------------------------------
# rank 0: configuration and validation (cheap: no weights are read)

def _resolve(spec: str | None, role: str) -> str:
    from swiftspec_mpi.model import registry
    try:
        return os.fspath(registry.resolve_model(spec, log=lambda m: print(m, file=sys.stderr, flush=True)))
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"--{role} {spec}: no such file, folder or registry name; give an HF model "
                        "folder, a .gguf file, or a name from `swiftspec models list`") from None


def prepare_config(flags: dict, config_path: str | None, world_size: int,
                   ranks_on_node: int = 1) -> C.RunConfig:
    """Everything rank 0 checks before any rank reads weights; raises UserError with the fix.
    `ranks_on_node`: the ranks sharing rank 0's node (its memory)."""
    toml_values = C.load_toml(config_path) if config_path else {}
    cfg = C.merge(toml_values, flags)
    C.check_slurm_world(world_size)   # first: a PMI mismatch explains every other symptom
    C.validate_basic(cfg, world_size)
    C.check_environment()
    C.check_output_path_default(cfg)
    # cheap checks that need no model first (fail fast); then the models' configs and headers
    C.check_output_path(cfg)
    if C.requests_stream_in(cfg):
        cfg.requests = []            # they come from stdin or HTTP (interactive.py, server.py)
    elif cfg.prompts is not None:
        cfg.requests = C.read_prompts_file(cfg.prompts)
    else:
        cfg.requests = [C.Request(0, cfg.prompt if cfg.prompt is not None else DEFAULT_PROMPT)]
    tcfg, ttok, dcfg = resolve_models(cfg)
    for path, mcfg in {cfg.target: tcfg, cfg.draft: dcfg}.items():
        if path is not None and cfg.load_format != "dummy":   # dummy: shape names, no files
            check_weight_files(path, mcfg)
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
    # room for the longest prompt padded to its bucket as well (GPU prompt forwards, decoding._prefill)
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
        shapes = _safetensors_shapes(path)
    else:
        from swiftspec_mpi.model import gguf_loader
        src = gguf_loader.GGUFSource(path)       # the header read_model_config parsed (cached)
        try:
            shapes = {name: tuple(src.shape(name)) for name in src.names()}
        finally:
            src.close()
    if mcfg is not None:
        check_shapes(path, mcfg, shapes)


def _safetensors_shapes(path: str) -> dict:
    import json

    from safetensors import safe_open

    from swiftspec_mpi.core.errors import CheckpointError
    fix = "re-download or re-convert the checkpoint"
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, KeyError, TypeError, AttributeError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc!r}); {fix}") from None
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json "
                                  f"(pickled *.bin/*.pt weights are never loaded); {fix}")
    shapes = {}
    for name in files:
        file = os.path.join(path, str(name))
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing; {fix}")
        try:
            with safe_open(file, framework="numpy") as h:
                for key in h.keys():
                    shapes[key] = tuple(h.get_slice(key).get_shape())
        except Exception as exc:  # noqa: BLE001 - SafetensorError: bad header or size
            raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({exc}); "
                                  f"{fix}") from None
    return shapes


def check_shapes(path: str, m, shapes: dict) -> None:
    """CheckpointError unless `shapes` (HF tensor name -> shape) holds every tensor the
    Transformer of ModelConfig `m` reads, with the shape `m` implies (extra tensors are fine)."""
    import re

    from swiftspec_mpi.core.errors import CheckpointError
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
    H, hd, I, V = m.hidden_size, m.head_dim, m.intermediate_size, m.vocab_size
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    want = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not m.tie_word_embeddings:
        want["lm_head.weight"] = (V, H)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        want.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                     p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                     p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                     p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                     p + "mlp.down_proj.weight": (H, I)})
        if m.attention_bias:
            want.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                         p + "self_attn.v_proj.bias": (kv,)})
        if m.o_bias:
            want[p + "self_attn.o_proj.bias"] = (H,)
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
    import glob
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def kv_element_bytes(cfg: C.RunConfig) -> int:
    """Bytes per KV element: the CPU path keeps activations and KV in float32 whatever the
    weights' dtype (model.py, "packed" layout); on the GPU the KV is in the run's dtype."""
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not _gpu_visible())
    return 4 if cfg.dtype == "float32" or on_cpu else 2


def rank_memory_bytes(cfg: C.RunConfig, tcfg, dcfg, world_size: int) -> list[tuple[int, int]]:
    """(static buffers = KV cache + RoPE tables, weights) in bytes for each world rank: what
    its Transformer(s) allocate up front (model.py: K and V [layers, max_context, local KV
    heads, head_dim], float32 RoPE tables of max_context + 256 rows)."""
    elem = 4 if cfg.dtype == "float32" else 2
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


def resolve_models(cfg: C.RunConfig):
    """Fill cfg.target / cfg.draft with paths; -> (target ModelConfig, target tokenizer, draft
    ModelConfig or None). Reads configs and tokenizers only."""
    from swiftspec_mpi.model import load as checkpoint
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if cfg.load_format == "dummy":
        from swiftspec_mpi.model.dummy import dummy_tokenizer, shape_config
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
        from swiftspec_mpi.model import registry
        t, d = registry.default_pair(log=log)
        cfg.target, cfg.draft = os.fspath(t), (os.fspath(d) if cfg.mode != "ar" else None)
    else:
        if cfg.target is None:
            raise UserError("--draft given without --target; give both (or neither, for the "
                            "embedded default pair)")
        cfg.target = _resolve(cfg.target, "target")
        if cfg.mode != "ar":
            if cfg.draft is None and cfg.draft_layers is None:
                raise UserError(f"--mode {cfg.mode} needs a draft model: give --draft PATH, or "
                                "--draft-layers N to use the target's first N layers")
            cfg.draft = _resolve(cfg.draft, "draft") if cfg.draft is not None else cfg.target
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
    from swiftspec_mpi.core.errors import CheckpointError
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


DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def one_line(message) -> str:
    """The error contract is one line; a message quoting file content may hold newlines."""
    return " ".join(str(message).splitlines())


def check_port_free(spec: str) -> None:
    """--serve: rank 0 can bind the address (checked before any rank loads weights)."""
    import socket
    host, port = C.parse_serve_address(spec)
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise UserError(f"--serve {spec}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                        "choose another port (or 0 for any free one)") from None


def interactive_room(cfg: C.RunConfig) -> int:
    """Prompt tokens an --interactive turn may have: the KV slots less the new tokens and the
    tree's margin (with --chat, the oldest turns are left out to stay within it)."""
    return cfg.max_context - cfg.max_new_tokens - tree_margin(cfg)


def tree_margin(cfg: C.RunConfig) -> int:
    """KV slots beyond the committed tokens: the verify tree, or the draft's expanded nodes."""
    return C.max_verify_size(cfg) + 2 * C.max_tree_width(cfg) + \
        min(cfg.tree_capacity // max(1, cfg.tree_topk), 256)


# ---------------------------------------------------------------------------------------------
# every rank

def run_job(flags: dict, config_path: str | None) -> int:
    from mpi4py import MPI

    from swiftspec_mpi.engine.protocol import AbortWatch, StopFlag

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    stop_flag = StopFlag()
    signal.signal(signal.SIGTERM, stop_flag.set)
    signal.signal(signal.SIGINT, stop_flag.set)

    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    ranks_on_node = node.Get_size()
    node.Free()
    verdict = None
    if rank == 0:
        try:
            verdict = ("ok", prepare_config(flags, config_path, world.Get_size(), ranks_on_node))
        except UserError as exc:
            verdict = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug: still end every rank, not just this one
            traceback.print_exc()
            verdict = ("crash", f"{type(exc).__name__}: {exc}")
    status, payload = world.bcast(verdict, root=0)
    if status != "ok":
        # srun with a PMI mismatch starts N singletons (each a world of 1, each its own rank 0)
        # that all fail the same way: only Slurm's task 0 prints, so the message shows once
        twin = world.Get_size() == 1 and os.environ.get("SLURM_PROCID", "0") not in ("", "0")
        if rank == 0 and not twin:
            print(f"swiftspec run: error: {one_line(payload)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR if status == "error" else EXIT_RUNTIME_ERROR
    cfg: C.RunConfig = payload
    job = Job(cfg, world, stop_flag, AbortWatch(world))
    return job.run()


class Job:
    def __init__(self, cfg, world, stop_flag, watch):
        self.cfg, self.world, self.stop_flag, self.watch = cfg, world, stop_flag, watch
        self.rank = world.Get_rank()
        self.results = []
        self.ctx = None
        self.env = {}
        self.last_write = 0.0
        self.checkpoint_every = CHECKPOINT_EVERY_S

    # -- phases ----------------------------------------------------------------------------------
    def run(self) -> int:
        from swiftspec_mpi.engine.protocol import Interrupted
        try:
            failed = self.setup()
            if failed:
                return failed
            self.decode_all()
            self.finish(complete=True, status="ok")
            return 0
        except Interrupted:
            return self.interrupted()
        except Exception as exc:  # noqa: BLE001 - any failure ends the whole job, loudly
            return self.fail(exc)

    def setup(self) -> int:
        import torch

        from swiftspec_mpi.engine.context import EngineContext
        from swiftspec_mpi.core.topology import build_topology, pin_threads
        from swiftspec_mpi.trace.record import Clock, EventRecorder

        cfg = self.cfg
        self.topo = topo = build_topology(self.world, cfg.mode, cfg.draft_ranks)
        self.threads = pin_threads(topo, cfg.threads)
        self.device = choose_device(cfg, topo)
        gpu_sharing = check_gpu_sharing(self.world, topo.role_name, self.device)
        error = None      # (exit code, one-line message) of this rank's load failure
        target = draft = tokenizer = None
        try:
            target, draft, tokenizer = load_models(cfg, topo, self.device)
        except UserError as exc:
            error = (EXIT_USER_ERROR, str(exc))
        except (MemoryError, RuntimeError) as exc:
            if "memory" not in str(exc).lower() and not isinstance(exc, MemoryError):
                traceback.print_exc()
                error = (EXIT_RUNTIME_ERROR, f"rank {self.rank} ({topo.role_name}) failed while "
                                             f"loading: {type(exc).__name__}: {exc}")
            else:
                error = (EXIT_USER_ERROR,
                         f"out of memory while allocating the model and its KV cache of "
                         f"{cfg.max_context} slots ({kv_bytes_estimate(cfg, topo) / 2**30:.2f} GiB "
                         f"of KV per rank); lower --max-context / --max-new-tokens or use more ranks")
        except Exception as exc:  # noqa: BLE001 - a bug: every rank still leaves together
            traceback.print_exc()
            error = (EXIT_RUNTIME_ERROR, f"rank {self.rank} ({topo.role_name}) failed while "
                                         f"loading: {type(exc).__name__}: {exc}")
        errors = self.world.allgather(error)
        first = next((e for e in errors if e), None)
        if first:
            if self.rank == 0:
                print(f"swiftspec run: error: {one_line(first[1])}", file=sys.stderr, flush=True)
            return first[0]
        self.world.Barrier()
        clock = Clock()
        role = topo.role
        rec = EventRecorder(self.rank, role, clock)
        self.ctx = EngineContext(cfg, topo, clock, rec, self.stop_flag, self.watch, target, draft,
                                 tokenizer)
        profiled = profile_expansions(self.ctx)      # also fixes bs and w when they are auto
        self.ctx.expansions = cfg.expansions or profiled
        self.env = environment(cfg, topo, self.device, self.threads, self.ctx.expansions)
        self.env["profile"] = self.ctx.scratch.get("profile", {})
        self.env["graphs"] = self.ctx.scratch.get("graphs", {})
        self.env["gpu_sharing"] = gpu_sharing
        if self.rank == 0:
            self.ctx.on_progress = self.maybe_checkpoint
        # what the first request would otherwise import (numpy.random alone: ~7 ms of its TTFT)
        import numpy.random  # noqa: F401

        from swiftspec_mpi.engine import async_loop, single_group  # noqa: F401
        del torch
        return 0

    def decode_all(self) -> None:
        from swiftspec_mpi.engine.decoding import Acceptor, OutputTracker
        from swiftspec_mpi.engine.async_loop import draft_loop, verify_loop
        from swiftspec_mpi.engine.single_group import run_request_single
        from swiftspec_mpi.trace.record import ROLE_VERIFY, RequestResult

        cfg, ctx, topo = self.cfg, self.ctx, self.topo
        acceptor = Acceptor(cfg.temperature, cfg.sampling_rule, cfg.seed)
        # the file exists from here on (a run in progress shows up), written before any request
        # so that none pays the write; the next checkpoint comes after some decoding
        self.write(complete=False, status="running", events=None)
        leader_of_verify = topo.role == ROLE_VERIFY and topo.is_leader
        source = None
        if cfg.interactive:
            from swiftspec_mpi.serve.interactive import PromptSource
            source = PromptSource(self.world, cfg, ctx.tokenizer, self.stop_flag, self.watch,
                                  interactive_room(cfg))
        elif cfg.serve is not None:
            from swiftspec_mpi.serve.http_server import HttpSource
            source = HttpSource(self.world, cfg, ctx.tokenizer, self.stop_flag, self.watch,
                                interactive_room(cfg))
        if source is not None:
            source.banner()
        for req in (cfg.requests if source is None else iter(source.next, None)):
            ctx.check_stop_together()
            result = tracker = None
            if leader_of_verify:
                result = RequestResult(req.index, req.category, req.prompt, list(req.ids))
                result.t_start = ctx.clock.now()
                self.results.append(result)
                eos = (() if cfg.ignore_eos else tuple(ctx.tokenizer.eos_token_ids)) + \
                    tuple(cfg.stop_token_ids)
                sink = source.stream_sink() if source is not None else None
                tracker = OutputTracker(result, ctx.tokenizer, eos, req.max_new_tokens or cfg.max_new_tokens,
                                        list(cfg.stop) + list(req.stop), stream=not cfg.quiet, sink=sink,
                                        abandoned=source.abandoned() if source is not None else None)
                acceptor.start_request(req.index, cfg.max_new_tokens, cfg.verify_size)
                self.tracker = tracker
            if cfg.mode == "async":
                if topo.role == ROLE_VERIFY:
                    verify_loop(ctx, req.ids, req.index, result, tracker, acceptor)
                else:
                    draft_loop(ctx, req.ids, req.index)
            else:
                run_request_single(ctx, req.ids, req.index, result, tracker, acceptor)
            if leader_of_verify:
                result.t_end = ctx.clock.now()
                tracker.finish()
                self.tracker = None
                if source is None:
                    self.maybe_checkpoint()
            if source is not None:
                source.finished(result)
                if self.rank == 0:     # between turns the user reads: the write costs nothing
                    self.write(complete=False, status="running", events=None)

    # -- output ----------------------------------------------------------------------------------
    def maybe_checkpoint(self) -> None:
        """Rewrite the HDF5 file with what exists so far, at most every `checkpoint_every`
        seconds of decoding: CHECKPOINT_EVERY_S, or 100x the last write's time if that is longer
        (a write stalls rank 0's loop, ~30 ms for a small trace on the H200 machine; a long job's
        file grows, so this keeps checkpoints under 1 % of the time)."""
        now = time.perf_counter()
        if now - self.last_write >= self.checkpoint_every:
            self.write(complete=False, status="running", events=None)
            took = time.perf_counter() - now
            self.checkpoint_every = max(CHECKPOINT_EVERY_S, 100.0 * took)

    def close_open_requests(self, reason: str) -> None:
        """Before the last write of a failed or interrupted job: the request that was running
        gets its end time, its text so far and `reason` as stop_reason, unless its tokens were
        already complete (the signal came while the leaders closed it: keep its real reason)."""
        for r in self.results:
            if r.t_end is None:
                r.t_end = self.ctx.clock.now() if self.ctx else 0.0
                r.text = self.ctx.tokenizer.decode(r.output_ids) if self.ctx else ""
                if r.stop_reason not in ("eos", "stop_string", "max_new_tokens", "cancelled"):
                    r.stop_reason = reason

    def write(self, complete: bool, status: str, events, ranks=None) -> None:
        from swiftspec_mpi.trace.record import write_trace
        if self.rank != 0:
            return
        if events is None:
            events = self.ctx.recorder.snapshot() if self.ctx else np.zeros(0)
        if ranks is None:
            ranks = np.array([self.rank_row()], dtype=rank_dtype())
        for r in self.results:   # a request still running: keep what it produced so far
            if r.t_end is None:
                r.text = self.ctx.tokenizer.decode(r.output_ids) if self.ctx else ""
        write_trace(self.cfg.out, mode=self.cfg.mode, config_json=self.cfg.to_json(), env=self.env,
                    requests=self.results, events=events, ranks=ranks, complete=complete,
                    exit_status=status)
        self.last_write = time.perf_counter()

    def rank_row(self):
        topo, rec = self.topo, self.ctx.recorder if self.ctx else None
        models = (self.ctx.target, self.ctx.draft) if self.ctx else ()
        late = sum(getattr(m, "late_captures", 0) for m in models if m is not None)
        return (self.rank, topo.role, topo.group.Get_rank(), topo.group.Get_size(),
                platform.node()[:64].encode(), str(self.device)[:32].encode(),
                rec.dropped if rec else 0, late)

    def finish(self, complete: bool, status: str) -> None:
        from swiftspec_mpi.engine.protocol import wait_for
        # the gathers below block: first make sure every rank got here, so a rank that hangs
        # at the very end is reported by the deadline (and the file written) like anywhere else
        wait_for(self.world.Ibarrier(), self.cfg.peer_timeout, "ranks at the end of the job",
                 self.stop_flag, self.watch, collective=True)
        events = self.world.gather(self.ctx.recorder.snapshot(), root=0)
        rows = self.world.gather(self.rank_row(), root=0)
        if self.rank == 0:
            events = np.concatenate(events) if events else np.zeros(0)
            self.write(complete, status, events, np.array(rows, dtype=rank_dtype()))

    def interrupted(self) -> int:
        """SIGTERM: rank 0 writes the partial file; all ranks leave together, non-zero."""
        from swiftspec_mpi.engine.protocol import wait_for, StopFlag
        if self.rank == 0:
            print("\nswiftspec run: interrupted (signal); writing what was generated", file=sys.stderr,
                  flush=True)
            self.close_open_requests("interrupted")
            self.write(complete=False, status="interrupted", events=None)
        together = False
        try:   # let rank 0 finish writing before anyone leaves (a leaving rank may end the job)
            wait_for(self.world.Ibarrier(), 20.0, "ranks at shutdown", StopFlag(), collective=True)
            together = True
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush(), sys.stderr.flush()
        if together:   # finalize (frees MPICH's /dev/shm segment) unless it would hang
            import threading

            from mpi4py import MPI
            t = threading.Thread(target=MPI.Finalize, daemon=True)
            t.start()
            t.join(5.0)
        os._exit(EXIT_INTERRUPTED)

    def fail(self, exc: BaseException) -> int:
        from swiftspec_mpi.engine.protocol import notify_rank0_and_abort
        from swiftspec_mpi.engine.protocol import RemoteFailure
        role = self.topo.role_name if getattr(self, "topo", None) else "?"
        if isinstance(exc, (UserError, PeerError)):
            msg = str(exc)
        else:
            msg = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        line = f"swiftspec run: error on rank {self.rank} ({role}): {msg}"
        if isinstance(exc, RemoteFailure):   # relayed: name the rank that failed, not rank 0
            line = f"swiftspec run: error on rank {exc.rank} ({exc.role}): {exc.message}"
        if self.rank == 0:   # other ranks leave the one-line message to rank 0 (see below)
            print(line, file=sys.stderr, flush=True)
        if self.rank == 0:
            self.close_open_requests("error")
            try:
                self.write(complete=False, status=f"error: {msg}", events=None)
            except Exception as write_exc:  # noqa: BLE001
                print(f"swiftspec run: could not write {self.cfg.out}: {write_exc}", file=sys.stderr)
            sys.stdout.flush(), sys.stderr.flush()
            self.world.Abort(EXIT_RUNTIME_ERROR)
        notify_rank0_and_abort(self.world, f"{role}: {msg}", EXIT_RUNTIME_ERROR, fallback_line=line)
        return EXIT_RUNTIME_ERROR


def rank_dtype():
    from swiftspec_mpi.trace.record import RANK_DTYPE
    return RANK_DTYPE


# ---------------------------------------------------------------------------------------------
# helpers of the phases

def choose_device(cfg, topo) -> str:
    import torch
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise UserError("--device cuda but no GPU is visible; use --device cpu")
    local = int(os.environ.get("SLURM_LOCALID", topo.local_rank))
    idx = local % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def torch_dtype(name: str):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_comm(group, device: str):
    from swiftspec_mpi.core.comm import MpiGroupComm, SingleComm
    if group.Get_size() == 1:
        return SingleComm()
    if device.startswith("cuda"):
        from swiftspec_mpi.gpu.nccl_comm import NcclGroupComm
        return NcclGroupComm(group)
    return MpiGroupComm(group)


def load_models(cfg, topo, device):
    """-> (target or None, draft or None, target tokenizer or None) for this rank's group."""
    from swiftspec_mpi.trace.record import ROLE_DRAFT
    dtype = torch_dtype(cfg.dtype)
    comm = make_comm(topo.group, device)
    target = draft = tokenizer = None
    wants_target = cfg.mode != "async" or topo.role != ROLE_DRAFT
    wants_draft = cfg.mode == "sync" or (cfg.mode == "async" and topo.role == ROLE_DRAFT)
    if wants_target:
        target, tokenizer = load_one(cfg, cfg.target, comm, dtype, device, None)
    if wants_draft:
        draft, dtok = load_one(cfg, cfg.draft, comm, dtype, device, cfg.draft_layers)
        tokenizer = tokenizer or dtok
    if hasattr(comm, "enable_fused_allreduce") and C.fused_allreduce_requested():
        max_n = max(m.cfg.hidden_size for m in (target, draft) if m is not None)
        if not comm.enable_fused_allreduce(max_n) and comm.rank == 0:   # collective over the group
            print(f"swiftspec run: SWIFTSPEC_FUSED_ALLREDUCE=1 but the fused all-reduce is unavailable "
                  f"({comm.fused_allreduce_error}); using NCCL's all-reduce", file=sys.stderr, flush=True)
    return target, draft, tokenizer


def load_one(cfg, path, comm, dtype, device, num_layers):
    """-> (model, tokenizer); on a GPU with bf16 and the fused kernels, the model replays CUDA
    graphs for its decode-sized forwards (cuda_graphs.GraphedModel, same interface)."""
    from swiftspec_mpi.model import load as checkpoint
    if cfg.load_format == "dummy":
        from swiftspec_mpi.model.dummy import dummy_model
        model, tok = dummy_model(path, comm, cfg.max_context, dtype, device, num_layers)
    else:
        model, tok = checkpoint.load_model(path, comm=comm, max_slots=cfg.max_context, dtype=dtype,
                                           device=device, num_layers=num_layers)
    if device.startswith("cuda") and not os.environ.get("SWIFTSPEC_NO_GRAPHS"):
        from swiftspec_mpi.gpu.graphs import GraphedModel, graphs_supported
        if graphs_supported(model):
            model = GraphedModel(model)
    return model, tok


def kv_bytes_estimate(cfg, topo) -> int:
    try:
        from swiftspec_mpi.model import load as checkpoint
        m = checkpoint.read_model_config(cfg.target)
        kv_local = max(1, m.num_kv_heads // max(1, topo.group.Get_size()))
        return 2 * m.num_layers * cfg.max_context * kv_local * m.head_dim * kv_element_bytes(cfg)
    except Exception:  # noqa: BLE001
        return 0


def profile_expansions(ctx) -> int:
    """Warm every forward shape the loops use (`warm_graphs`: CUDA graphs captured, kernels
    compiled, caches touched), then d = floor(t_target / t_draft) from timed forwards at the
    verify and expansion shapes, each with the read-back its loop uses (the target's argmax when
    greedy, the draft's top-k). Writes only scratch KV slots; runs before the job clock starts
    counting requests, so no request pays for a cold start."""
    import torch

    from swiftspec_mpi.engine.decoding import draft_topk, verify_forward
    from swiftspec_mpi.model.transformer import chain_mask
    cfg = ctx.cfg
    greedy = cfg.temperature == 0.0

    def loop_forward(model, n):
        """One forward of n tokens as the loops run it (the same CUDA graph, if any)."""
        tokens, pos, mask = torch.zeros(n, dtype=torch.long), torch.arange(n, dtype=torch.long), chain_mask(0, n)
        if model is ctx.target:
            verify_forward(model, tokens, pos, 0, mask, greedy)
        else:
            draft_topk(model, cfg.tree_topk, tokens, pos, 0, mask)

    def step_time(model, n, reps=6):
        cuda = str(getattr(model, "device", "cpu")).startswith("cuda")
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            loop_forward(model, n)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return float(min(times[1:]))   # the least disturbed of the timed runs

    sizes = (cfg.verify_size,) if cfg.verify_size else C.TREE_SIZES
    if cfg.mode == "ar":
        step_time(ctx.target, 1, reps=3)
        cfg.verify_size, cfg.tree_width = 1, cfg.tree_width or 1
        warm_graphs(ctx, loop_forward)
        return 1
    dsizes = tuple(sorted(set(sizes) | ({cfg.tree_width} if cfg.tree_width else set())))
    t_target = t_draft = None
    if ctx.target is not None:
        t_target = {n: step_time(ctx.target, n) for n in sizes}
    if ctx.draft is not None:
        t_draft = {n: step_time(ctx.draft, n) for n in dsizes}
    if cfg.mode == "async":   # each group measured its own model: swap the tables
        from swiftspec_mpi.engine.async_loop import exchange_profile
        if t_target is None:
            t_target = exchange_profile(ctx, t_draft, sizes)
        else:
            t_draft = exchange_profile(ctx, t_target, dsizes)
    if ctx.topo.group.Get_size() > 1:
        # Every rank of a group must take the same decisions below (bs, w, d: they shape its
        # tensor-parallel collectives), but each rank timed its own forwards and the timings
        # differ a little, so the decisions could too, and the ranks would deadlock in
        # mismatched collectives (seen in sync on 2 ranks). The group leader's tables decide;
        # in async both leaders hold the same pair (their own + the swapped one).
        t_target, t_draft = ctx.topo.group.bcast((t_target, t_draft), root=0)
    bs = cfg.verify_size or C.choose_tree_size(t_target)
    w = cfg.tree_width or bs
    cfg.verify_size, cfg.tree_width = bs, w
    ctx.scratch["profile"] = {"t_target_s": {str(k): v for k, v in t_target.items()},
                              "t_draft_s": {str(k): v for k, v in t_draft.items()},
                              "verify_size": bs, "tree_width": w}
    warm_graphs(ctx, loop_forward)
    return max(1, min(cfg.max_depth, int(t_target[bs] // max(t_draft[w], 1e-9))))


def warm_graphs(ctx, loop_forward) -> None:
    """GPU only: capture the CUDA graph of every forward shape the decode loops can ask for,
    then freeze the graphed models (a later capture is counted as late, see GraphedModel).

    The loops' shapes: the target verifies 1..bs nodes (fewer while the draft tree is small;
    1 in `ar`), the draft expands 1..w leaves, and 2 when it fills a KV hole (the last accepted
    token + the new root). Every rank of a group runs the same list (bs and w are the group's
    decision), so their collectives pair up. The padded length of each of the job's prompts
    (decoding.prompt_bucket; every rank has the same requests; in an --interactive session every
    bucket up to the room for a turn) gets a prompt graph up to cuda_graphs.PROMPT_GRAPH_MAX
    tokens, one eager forward above. Records the captures and the
    time in ctx.scratch["graphs"]."""
    cfg = ctx.cfg
    models = [(m, sizes) for m, sizes in
              ((ctx.target, range(1, cfg.verify_size + 1)),
               (ctx.draft, sorted(set(range(1, cfg.tree_width + 1)) | {2})))
              if m is not None and hasattr(m, "freeze")]
    if not models:
        return
    import torch

    from swiftspec_mpi.gpu.graphs import PROMPT_GRAPH_MAX
    from swiftspec_mpi.engine.decoding import prompt_bucket, prompt_buckets
    t0 = time.perf_counter()
    lengths = {len(r.ids) - 1 for r in cfg.requests if len(r.ids) > 1}   # what _prefill forwards
    buckets = 0
    for model, sizes in models:
        for n in sizes:
            if n <= model.max_slots:
                loop_forward(model, n)
        if C.requests_stream_in(cfg):     # prompts unknown: every length a turn may have
            padded = prompt_buckets(model.max_slots, prompt_bucket(max(1, interactive_room(cfg) - 1),
                                                                   model.max_slots))
        else:
            padded = sorted({prompt_bucket(n, model.max_slots) for n in lengths})
        buckets += len(padded)
        for n in padded:
            if n <= PROMPT_GRAPH_MAX:
                model.capture_prompt(n)
            else:
                model.forward_prompt([0] * n, n - 1)      # eager: its first call paid here
        model.freeze()
    torch.cuda.synchronize()
    ctx.scratch["graphs"] = {"captured": sum(len(m.static) for m, _ in models), "prompt_buckets": buckets,
                             "prompt_graphs": sum(len(m.prompt_graphs) for m, _ in models),
                             "warm_s": round(time.perf_counter() - t0, 3)}


def environment(cfg, topo, device, threads, expansions) -> dict:
    import mpi4py
    import torch
    from mpi4py import MPI
    return {
        "world_size": topo.world.Get_size(), "verify_ranks": topo.verify_size,
        "draft_ranks": topo.draft_size, "mode": cfg.mode, "threads_per_rank": threads,
        "device": device, "expansions_per_verify": expansions,
        "python": platform.python_version(), "torch": torch.__version__,
        "mpi4py": mpi4py.__version__, "mpi_library": MPI.Get_library_version().strip()[:200],
        "host": platform.node(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
