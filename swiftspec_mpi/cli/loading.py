"""Loading, profiling and warm-up of one rank of a `swiftspec run` job: choose the device, load
this rank's model(s) (checkpoint or dummy, CUDA-graphed on a GPU), time the forwards to fix the
tree's sizes and the draft's expansions per verify, capture every graph the loops will replay,
and describe the environment for the trace.
"""
from __future__ import annotations

import os
import platform
import sys
import time

import mpi4py
import torch
from mpi4py import MPI

from swiftspec_mpi.checkpoints import load as checkpoint
from swiftspec_mpi.checkpoints.load import dummy_model
from swiftspec_mpi.cli.validate import interactive_room, kv_element_bytes
from swiftspec_mpi.core import config as C
from swiftspec_mpi.core import switches
from swiftspec_mpi.core.comm import MpiGroupComm, SingleComm
from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.engine.async_loop import exchange_profile
from swiftspec_mpi.engine.decoding import draft_topk, prompt_bucket, prompt_buckets, verify_forward
from swiftspec_mpi.gpu.graphs import PROMPT_GRAPH_MAX, GraphedModel, graphs_supported
from swiftspec_mpi.network.transformer import chain_mask
from swiftspec_mpi.trace.record import ROLE_DRAFT


def choose_device(cfg, topo) -> str:
    """This rank's device: "cpu", or "cuda:I" for GPU I = local rank % GPUs (made current)."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise UserError("--device cuda but no GPU is visible; use --device cpu")
    local = int(os.environ.get("SLURM_LOCALID", topo.local_rank))
    idx = local % torch.cuda.device_count()
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def torch_dtype(name: str):
    """--dtype name -> torch dtype."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def make_comm(group, device: str, peers: str = "a rank of this group"):
    """The tensor-parallel communicator of an MPI group: none for one rank, NCCL on GPUs, MPI on
    CPUs (`peers` names the group's other ranks in the message when one is lost)."""
    if group.Get_size() == 1:
        return SingleComm()
    if device.startswith("cuda"):
        from swiftspec_mpi.gpu.nccl_comm import NcclGroupComm   # CUDA-only dependencies
        return NcclGroupComm(group)
    return MpiGroupComm(group, peers)


def load_models(cfg, topo, device, chain_reason: str | None = None):
    """-> (target or None, draft or None, target tokenizer or None) for this rank's group."""
    dtype = torch_dtype(cfg.dtype)
    comm = make_comm(topo.group, device, topo.describe_group_peers())
    target = draft = tokenizer = None
    wants_target = cfg.mode != "async" or topo.role != ROLE_DRAFT
    wants_draft = cfg.mode == "sync" or (cfg.mode == "async" and topo.role == ROLE_DRAFT)
    if wants_target:
        target, tokenizer = load_one(cfg, cfg.target, comm, dtype, device, None, chain_reason)
    if wants_draft:
        draft, dtok = load_one(cfg, cfg.draft, comm, dtype, device, cfg.draft_layers, chain_reason)
        tokenizer = tokenizer or dtok
    if hasattr(comm, "enable_fused_allreduce") and switches.flag("SWIFTSPEC_FUSED_ALLREDUCE"):
        max_n = max(m.cfg.hidden_size for m in (target, draft) if m is not None)
        if not comm.enable_fused_allreduce(max_n) and comm.rank == 0:   # collective over the group
            print(f"swiftspec run: SWIFTSPEC_FUSED_ALLREDUCE=1 but the fused all-reduce is unavailable "
                  f"({comm.fused_allreduce_error}); using NCCL's all-reduce", file=sys.stderr, flush=True)
    return target, draft, tokenizer


def load_one(cfg, path, comm, dtype, device, num_layers, chain_reason: str | None = None):
    """-> (model, tokenizer), the LM head packed 4-bit with --head-bits 4 (4-bit models on the
    GPU); on a GPU with bf16 and the fused kernels, the model replays CUDA
    graphs for its decode-sized forwards (gpu.graphs.GraphedModel, same interface) unless
    SWIFTSPEC_NO_GRAPHS=1; with --step-kernel persistent each graph is one launch of the
    persistent step kernel, unless the kernel cannot run the model (`chain_reason`, or
    gpu.step_kernel.unsupported_reason: one line on the group's rank 0 says so).
    `model.step_kernel_ran` says which: "persistent" or "chain"."""
    if cfg.load_format == "dummy":
        model, tok = dummy_model(path, comm, cfg.max_context, dtype, device, num_layers, quant=cfg.quant)
    else:
        model, tok = checkpoint.load_model(path, comm=comm, max_slots=cfg.max_context, dtype=dtype,
                                           device=device, num_layers=num_layers, quant=cfg.quant)
    if cfg.head_bits == 4 and model.quant4:
        model.quantize_head()
    model.step_kernel_ran = "chain"
    if device.startswith("cuda") and not switches.flag("SWIFTSPEC_NO_GRAPHS"):
        if graphs_supported(model):
            from swiftspec_mpi.gpu import step_kernel
            ran, why = step_kernel.attach(model, cfg.step_kernel, chain_reason)
            model.step_kernel_ran = ran
            if why is not None and cfg.step_kernel != "chain" and comm.rank == 0:
                print(f"swiftspec run: step kernel: {why}; running the chain of kernels", file=sys.stderr,
                      flush=True)
            model = GraphedModel(model)
    return model, tok


def kv_bytes_estimate(cfg, topo) -> int:
    """Bytes of the target's KV cache on this rank (for the out-of-memory message); 0 if unknown."""
    try:
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
    tokens = None
    if cfg.accept_model is not None:      # replay: the model's best n-node tree, not the prior
        from swiftspec_mpi.trace.acceptance import model_mean_tokens
        tokens = {n: model_mean_tokens(cfg.accept_model, n) for n in t_target}
    bs = cfg.verify_size or C.choose_tree_size(t_target, tokens)
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
    bucket up to the room for a turn) gets a prompt graph up to graphs.PROMPT_GRAPH_MAX
    tokens, one eager forward above. Records the captures and the
    time in ctx.scratch["graphs"]."""
    cfg = ctx.cfg
    models = [(m, sizes) for m, sizes in
              ((ctx.target, range(1, cfg.verify_size + 1)),
               (ctx.draft, sorted(set(range(1, cfg.tree_width + 1)) | {2})))
              if m is not None and hasattr(m, "freeze")]
    if not models:
        return
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
    ctx.scratch["graphs"] = {"step_kernel": {role: getattr(m, "step_kernel_ran", "chain") for role, m in
                                             (("target", ctx.target), ("draft", ctx.draft)) if m is not None},
                             "captured": sum(len(m.static) for m, _ in models), "prompt_buckets": buckets,
                             "prompt_graphs": sum(len(m.prompt_graphs) for m, _ in models),
                             "warm_s": round(time.perf_counter() - t0, 3)}


def environment(cfg, topo, device, threads, expansions) -> dict:
    """The run's environment for the trace's env_json: layout, versions, host, Slurm job."""
    return {
        "world_size": topo.world.Get_size(), "verify_ranks": topo.verify_size,
        "draft_ranks": topo.draft_size, "mode": cfg.mode, "threads_per_rank": threads,
        "device": device, "expansions_per_verify": expansions,
        "python": platform.python_version(), "torch": torch.__version__,
        "mpi4py": mpi4py.__version__, "mpi_library": MPI.Get_library_version().strip()[:200],
        "host": platform.node(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
