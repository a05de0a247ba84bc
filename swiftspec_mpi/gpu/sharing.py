"""Which ranks drive the same physical GPU, and whether a CUDA MPS daemon lets them overlap.

Two processes on one GPU time-slice it: each gets the whole GPU in turn, so the draft's
expansions and the target's verification never run at the same time, which is what `async`
is for. The CUDA Multi-Process Service (MPS) runs the kernels of several processes concurrently.
So ranks that share a GPU should run under MPS (docs/benchmarks.md, "GPU engine", has the
figures); `jobs/mps.sh` starts a per-job daemon.

    entries = [(rank, role_name, host, gpu_uuid or None), ...]      # one per rank
    groups = sharing_groups(entries)         # [[0, 1]]: ranks 0 and 1 share a GPU
    note = sharing_note(entries, groups, mps_daemon_running())

`check_gpu_sharing(world, role_name, device)` does the same over MPI (collective) and returns
what the trace records. The engine only reports; the job scripts (jobs/, MPS=auto) start and
stop a per-job daemon.
"""
from __future__ import annotations

import os
import platform
import sys

MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"     # nvidia-cuda-mps-control's pipe directory by default


def gpu_uuid(device: str) -> str | None:
    """The UUID of the physical GPU behind a torch device string ("cuda:0"), None for the CPU.
    Two ranks that each see their GPU as cuda:0 (CUDA_VISIBLE_DEVICES) still differ here."""
    if not device.startswith("cuda"):
        return None
    import torch
    idx = int(device.split(":", 1)[1]) if ":" in device else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(idx), "uuid", None)
    return str(uuid) if uuid is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}#{idx}"


def mps_pipe_dir(env=None) -> str:
    env = os.environ if env is None else env
    return env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT


def mps_daemon_running(env=None) -> bool:
    """Whether an MPS control daemon listens where this process's CUDA clients would look for it
    (its `control` pipe in CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps): then the CUDA
    contexts created here are served by MPS."""
    return os.path.exists(os.path.join(mps_pipe_dir(env), "control"))


def sharing_groups(entries) -> list[list[int]]:
    """entries: (rank, role_name, host, gpu_uuid or None) per rank -> the sorted rank lists of every
    (host, GPU) that more than one rank drives (CPU ranks never share)."""
    by_gpu: dict = {}
    for rank, _role, host, uuid in entries:
        if uuid is not None:
            by_gpu.setdefault((host, uuid), []).append(rank)
    return sorted(sorted(r) for r in by_gpu.values() if len(r) > 1)


def sharing_note(entries, groups, mps: bool) -> str | None:
    """The one-line note for ranks that share a GPU without MPS, None when there is nothing to say."""
    if not groups or mps:
        return None
    roles = {rank: role for rank, role, _host, _uuid in entries}
    hosts = {rank: host for rank, _role, host, _uuid in entries}
    parts = [", ".join(f"{r} ({roles[r]})" for r in g) + f" on {hosts[g[0]]}" for g in groups]
    return ("ranks " + "; ".join(parts) + " share a GPU and no CUDA MPS daemon is running, so their "
            "kernels take turns instead of overlapping (async, 8B verify + 1B draft on one H200: "
            "80 tok/s without MPS, 111 with); start one before the run: nvidia-cuda-mps-control -d "
            "(the jobs/ scripts do it with MPS=auto)")


def check_gpu_sharing(world, role_name: str, device: str) -> dict:
    """Collective over `world`: every rank's (host, GPU); rank 0 prints the note when ranks share a
    GPU without MPS. Returns the trace's record: {"gpu_uuids": [per rank, None on a CPU],
    "shared_gpu_ranks": [[ranks], ...], "mps_daemon": [per rank: a daemon was listening]}."""
    mine = (world.Get_rank(), role_name, platform.node(), gpu_uuid(device), mps_daemon_running())
    everyone = world.allgather(mine)
    entries = [e[:4] for e in everyone]
    groups = sharing_groups(entries)
    sharing = {r for g in groups for r in g}
    note = sharing_note(entries, groups, all(e[4] for e in everyone if e[0] in sharing))
    if note and world.Get_rank() == 0:
        print(f"swiftspec run: note: {note}", file=sys.stderr, flush=True)
    return {"gpu_uuids": [e[3] for e in entries], "shared_gpu_ranks": groups,
            "mps_daemon": [bool(e[4]) for e in everyone]}


def time_sliced(record: dict | None) -> bool:
    """Whether a trace's `gpu_sharing` record shows ranks that shared a GPU without an MPS daemon."""
    groups = (record or {}).get("shared_gpu_ranks") or []
    mps = (record or {}).get("mps_daemon") or []
    return bool(groups) and not all(mps[r] for g in groups for r in g if r < len(mps))


def describe(record: dict | None) -> str:
    """A trace's `gpu_sharing` record in a few words (swiftspec analyze, bench): "-" for traces
    written before it existed, "cpu", "no" (every GPU rank has its own GPU), or which ranks
    shared one and whether an MPS daemon served them."""
    if not record:
        return "-"
    if all(u is None for u in record.get("gpu_uuids") or [None]):
        return "cpu"
    groups = record.get("shared_gpu_ranks") or []
    if not groups:
        return "no"
    ranks = "; ".join(",".join(str(r) for r in g) for g in groups)
    return f"ranks {ranks} (MPS {'NO: time-sliced' if time_sliced(record) else 'yes'})"
