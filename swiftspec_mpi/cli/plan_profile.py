"""The step times `swiftspec plan` weighs: for each tensor-parallel group size g the job can
form, its first g ranks load the target and the draft at size g and time their forwards the way
the decode loops run them (cli/loading.py's profile: the target's verify forward with the greedy
argmax read-back, the draft's forward with its top-k), the leaders' message round trip, and the
host time a step adds to its forwards (engine/host_time.py: the sync loop run for a few steps)."""
from __future__ import annotations

import dataclasses
import gc
import os
import time

import numpy as np
import torch
from mpi4py import MPI

from swiftspec_mpi.cli.loading import load_one, make_comm, torch_dtype
from swiftspec_mpi.engine.decoding import draft_topk, verify_forward
from swiftspec_mpi.engine.protocol import TREE_HEADER
from swiftspec_mpi.network.transformer import chain_mask


def rank_device(cfg, world) -> str:
    """This rank's device: cuda:(node-local rank % GPUs) or cpu, as `swiftspec run` picks it."""
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    idx = node.Get_rank() % torch.cuda.device_count()
    node.Free()
    torch.cuda.set_device(idx)
    return f"cuda:{idx}"


def device_id(device: str) -> str:
    """A name equal on ranks that drive the same device: the GPU's UUID, or cpu:<host>:<rank>
    (CPU ranks are pinned to their own cores: distinct)."""
    import platform
    if device.startswith("cuda"):
        uuid = getattr(torch.cuda.get_device_properties(torch.device(device)), "uuid", None)
        return f"gpu:{uuid}" if uuid is not None else f"gpu:{platform.node()}:{device}"
    return f"cpu:{platform.node()}:{MPI.COMM_WORLD.Get_rank()}"


def _time(fn, device: str, reps: int = 6) -> float:
    cuda = device.startswith("cuda")
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(min(times[1:]))


def _forward_times(model, cfg, device, sizes, target: bool, start: int) -> dict[int, float]:
    """{n: seconds} of a forward of n tokens at KV positions [start, start + n)."""
    out = {}
    for n in sizes:
        tokens, mask = torch.zeros(n, dtype=torch.long), chain_mask(start, n)
        pos = torch.arange(start, start + n, dtype=torch.long)
        if target:
            out[n] = _time(lambda: verify_forward(model, tokens, pos, start, mask, True), device)
        else:
            out[n] = _time(lambda: draft_topk(model, cfg.tree_topk, tokens, pos, start, mask), device)
    return out


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def prompt(context: int) -> list[int]:
    """Token ids of a prompt that leaves the loops' first step at KV position `context`."""
    return [1 + i % 97 for i in range(max(2, context + 1))]


def quiet_barrier(world, poll_s: float = 0.002) -> None:
    """world.Barrier without spinning a core (MPI's barrier busy-waits on some builds, which
    would take a CPU rank's core from the rank being timed)."""
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def round_trip(world, reps: int = 30) -> float:
    """Seconds of one tree message (64 nodes) from the last rank to rank 0 and one result back:
    what an async step adds between the groups' leaders (median of `reps`)."""
    n = world.Get_size()
    if n < 2:
        return 0.0
    buf = np.zeros(TREE_HEADER + 3 * 64, dtype=np.int64)
    times = []
    rank = world.Get_rank()
    for _ in range(reps):
        world.Barrier()
        t = time.perf_counter()
        if rank == 0:
            world.Recv(buf, source=n - 1, tag=7)
            world.Send(buf[:70], dest=n - 1, tag=8)
        elif rank == n - 1:
            world.Send(buf, dest=0, tag=7)
            world.Recv(buf[:70], source=0, tag=8)
        times.append(time.perf_counter() - t)
    return float(world.bcast(np.median(times) if rank == n - 1 else None, root=n - 1))


def profile_groups(world, cfg, sizes: list[int], threads: int | None, heads: tuple[int, int],
                   model: dict | None = None, context: int = 128, host_steps: int = 40) -> dict:
    """Every rank: -> (on rank 0, None elsewhere) {"t_target_s": {g: {n: s}}, "t_draft_s": {g:
    {w: s}}, "t_x_s", "host_s" ({n: {"step_s", "expansion_s", "measured"}}) and "host_ar_s"
    (engine/host_time.py, on rank 0 alone with both models loaded, when an acceptance `model` is
    given; else {} and 0),
    "devices" (per rank), "shared" (a draft and a verify rank would share a device),
    "sync_ranks" (the most leading ranks on distinct devices)}; n includes 1 (`ar`).
    A model is timed only at the group sizes that divide its heads (target, draft); forwards at
    KV position `context` (a job's prompt and half its new tokens), the loops after a prompt of
    `context` tokens."""
    rank, size = world.Get_rank(), world.Get_size()
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // size))
    device = rank_device(cfg, world)
    ids = world.allgather(device_id(device))
    distinct = 1
    while distinct < size and ids[distinct] not in ids[:distinct]:
        distinct += 1
    shared = len(set(ids)) < size
    # group sizes: async verify / draft groups of size 1..size-1; sync on `distinct` ranks; on
    # shared devices NCCL cannot join two ranks of one GPU: only groups of distinct devices
    groups = sorted({g for g in range(1, size + 1) if g <= distinct})
    t_target, t_draft, host, host_ar = {}, {}, {}, 0.0
    target_sizes = sorted(set(sizes) | {1})
    dtype = torch_dtype(cfg.dtype)
    for g in groups:
        sub = world.Split(0 if rank < g else MPI.UNDEFINED, rank)
        if sub != MPI.COMM_NULL:
            comm = make_comm(sub, device, "a rank of the plan's group")
            keep = g == 1 and model is not None      # rank 0: both models for the host terms
            tm = dm = tok = None
            if heads[0] % g == 0:
                tm, tok = load_one(cfg, cfg.target, comm, dtype, device, None)
                tt = _forward_times(tm, cfg, device, target_sizes, True, context)
                if rank == 0:
                    t_target[g] = tt
                if not keep:
                    tm = None
                    _free(device)
            if heads[1] % g == 0:
                dm, _tok = load_one(cfg, cfg.draft, comm, dtype, device, cfg.draft_layers)
                td = _forward_times(dm, cfg, device, sizes, False, context)
                if rank == 0:
                    t_draft[g] = td
            if keep and tm is not None and dm is not None:
                from swiftspec_mpi.engine.host_time import host_terms
                host, host_ar = host_terms(cfg, tm, dm, tok, model, sizes, t_target[1], t_draft[1], host_steps,
                                           prompt(context))
            tm = dm = None
            _free(device)
            sub.Free()
        quiet_barrier(world)         # (rank 0 may be timing the host loops: no busy wait)
    t_x = round_trip(world)
    host_async = {}
    if model is not None:
        host_async = async_host(world, cfg, device, model, sizes, shared, heads, t_target, t_draft, t_x,
                                host_steps, prompt(context))
    if rank != 0:
        return None
    return {"t_target_s": t_target, "t_draft_s": t_draft, "t_x_s": t_x, "host_s": host, "host_ar_s": host_ar,
            "host_async_s": host_async,
            "devices": [i.split(":")[0] if i.startswith("cpu") else i for i in ids],
            "shared": shared, "sync_ranks": distinct}


def async_host(world, cfg, device: str, model: dict, sizes: list[int], shared: bool, heads: tuple[int, int],
               t_target: dict, t_draft: dict, t_x: float, steps: int, prompt_ids: list[int]) -> dict | None:
    """Every rank: the async loops run for a few steps on each split of the job's ranks (D draft,
    R - D verify ranks; the models loaded as `swiftspec run` would) at each verify size n, unpaced
    on devices of their own, at host_time.EXPANSIONS paces on a shared device (the mean of
    host_time.ROUNDS runs). -> on rank 0
    {D: {n: {"step_s", "expansion_s", "measured": {pace: [seconds a step, tokens a step]}}}}:
    step_s = the step's seconds - t_target(n) - t_x on own devices (everything the async step
    waits for beyond the verify forward and the messages); on a shared device the fit of
    seconds - t_target(n) - t_x - pace * t_draft(n) = step_s + pace * expansion_s; None elsewhere."""
    from swiftspec_mpi.core.config import DEFAULT_ASYNC_POLICY, DEFAULT_FLOOR_DEPTH
    from swiftspec_mpi.core.roles import ROLE_VERIFY
    from swiftspec_mpi.core.topology import build_topology
    from swiftspec_mpi.engine.context import EngineContext
    from swiftspec_mpi.engine.host_time import EXPANSIONS, ROUNDS, async_loop_step, warm_shapes
    from swiftspec_mpi.engine.protocol import AbortWatch, StopFlag
    from swiftspec_mpi.trace.record import Clock, EventRecorder
    rank, size = world.Get_rank(), world.Get_size()
    policy = cfg.async_policy or DEFAULT_ASYNC_POLICY
    acfg = dataclasses.replace(cfg, mode="async", async_policy=policy,
                               floor_depth=cfg.floor_depth or (DEFAULT_FLOOR_DEPTH if policy == "rate" else None))
    out = {}
    dtype = torch_dtype(cfg.dtype)
    for D in range(1, size):
        V = size - D
        ok = heads[0] % V == 0 and heads[1] % D == 0 and (rank != 0 or (V in t_target and D in t_draft))
        if not world.allreduce(int(ok), op=MPI.MIN):
            continue
        topo = build_topology(world, "async", D)
        comm = make_comm(topo.group, device, "a rank of the plan's group")
        verify = topo.role == ROLE_VERIFY
        m, tok = load_one(cfg, cfg.target if verify else cfg.draft, comm, dtype, device,
                          None if verify else cfg.draft_layers)
        vocab = world.allreduce(m.cfg.vocab_size, op=MPI.MIN)
        warm_shapes(m if verify else None, None if verify else m, cfg.tree_topk, max(sizes))
        clock = Clock()
        ctx = EngineContext(acfg, topo, clock, EventRecorder(rank, topo.role, clock), StopFlag(), AbortWatch(world),
                            m if verify else None, None if verify else m, tok)
        rows = {}
        for n in sizes:
            meas = {}
            for pace in (EXPANSIONS if shared else (0,)):
                runs = []
                for _ in range(ROUNDS):
                    runs.append(async_loop_step(ctx, model, n, pace, steps, prompt_ids, vocab))
                    world.Barrier()
                meas[pace] = np.mean(runs, axis=0).tolist() if rank == 0 else None
            if rank == 0:
                base = t_target[V][n] + t_x
                if shared:
                    (p1, p2) = EXPANSIONS
                    h1, h2 = (meas[p][0] - base - p * t_draft[D][n] for p in (p1, p2))
                    per_x = max(0.0, (h2 - h1) / (p2 - p1))
                    rows[n] = {"step_s": max(0.0, h1 - p1 * per_x), "expansion_s": per_x}
                else:
                    rows[n] = {"step_s": max(0.0, meas[0][0] - base), "expansion_s": 0.0}
                rows[n]["measured"] = {p: list(v) for p, v in meas.items()}
        out[D] = rows
        m = ctx = None
        _free(device)
        topo.group.Free()
        topo.inter.Free()
        world.Barrier()
    return out if rank == 0 else None
