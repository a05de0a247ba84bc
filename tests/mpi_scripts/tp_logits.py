"""Run under mpiexec by tests/test_model_tp.py: load each model of a spec with tensor
parallelism over COMM_WORLD (MpiGroupComm), run `scenario` (prefill, tree verify, decode, KV
compaction, decode) and save rank 0's logits; every rank checks that its logits equal rank 0's.
The test imports `scenario` from this file to compute the TP=1 reference.

    mpiexec -n T python tests/mpi_scripts/tp_logits.py SPEC.json OUT_DIR

SPEC.json: {"models": [{"name": ..., "folder": ..., "dtype": "float32"|"bfloat16",
                        "rss": bool (measure the loading peak)}]}
OUT_DIR/<name>.pt: list of logits tensors (float32); OUT_DIR/report.json: per-rank checks.
"""
from __future__ import annotations

import json
import os
import sys


def scenario(model) -> list:
    """Deterministic sequence of forwards exercising every call shape; returns their logits."""
    import torch

    from swiftspec_mpi.network.transformer import chain_mask
    from tree_masks import tree_mask
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1234)
    out = []
    P = 11
    prefix = torch.randint(0, V, (P,), generator=g)
    out.append(model.forward(prefix, torch.arange(P), 0, chain_mask(0, P)))
    # a 6-node tree over the prefix
    positions, mask = tree_mask([-1, 0, 0, 1, 1, 2], P)
    tokens = torch.randint(0, V, (len(positions),), generator=g)
    out.append(model.forward(tokens, positions, P, mask))
    # accept the path 0 -> 2 -> 5: compact its KV to [P, P+3), then decode after it
    model.compact_kv(torch.tensor([P + 0, P + 2, P + 5]), torch.tensor([P, P + 1, P + 2]))
    pos = P + 3
    for _ in range(4):
        t = torch.randint(0, V, (1,), generator=g)
        out.append(model.forward(t, torch.tensor([pos]), pos, chain_mask(pos, 1)))
        pos += 1
    # a 3-token chain with only the last row's logits
    t = torch.randint(0, V, (3,), generator=g)
    out.append(model.forward(t, torch.arange(pos, pos + 3), pos, chain_mask(pos, 3),
                             logits_rows=torch.tensor([2])))
    return [o.clone() for o in out]


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def main() -> int:
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.dirname(tests), tests]       # the package and tests/tree_masks.py
    import numpy as np
    import torch
    from mpi4py import MPI

    from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource
    from swiftspec_mpi.core.comm import MpiGroupComm
    from swiftspec_mpi.network.transformer import Transformer

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = MpiGroupComm(world)
    rank, size = comm.rank, comm.size
    with open(spec_path) as f:
        spec = json.load(f)
    report: dict = {"size": size, "models": {}, "comm": {}}

    # --- the communicator itself -----------------------------------------------------------
    t = torch.full((5, 3), float(rank + 1), dtype=torch.bfloat16)
    comm.all_reduce_(t)
    want = float(size * (size + 1) // 2)
    bf16_ok = bool((t == want).all())
    ptr_before = comm._stage.data_ptr()
    comm.all_reduce_(torch.ones(7, dtype=torch.bfloat16))
    bf16_no_realloc = comm._stage.data_ptr() == ptr_before
    f = torch.arange(6, dtype=torch.float32) * (rank + 1)
    comm.all_reduce_(f)
    f32_ok = bool(torch.equal(f, torch.arange(6, dtype=torch.float32) * want))
    gathered_ok = True
    for R in (1, 4):
        loc = torch.arange(R * 3, dtype=torch.float32).view(R, 3) + 100 * rank
        full = comm.all_gather_lastdim(loc)
        exp = torch.cat([torch.arange(R * 3, dtype=torch.float32).view(R, 3) + 100 * r
                         for r in range(size)], dim=1)
        gathered_ok &= bool(torch.equal(full, exp))
    report["comm"] = {"bf16_allreduce": bf16_ok, "bf16_staging_reused": bf16_no_realloc,
                      "f32_allreduce": f32_ok, "all_gather_lastdim": gathered_ok,
                      "seconds_counted": comm.seconds > 0}

    # --- the models --------------------------------------------------------------------------
    for m in spec["models"]:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[m.get("dtype", "float32")]
        src = SafetensorsSource(m["folder"])
        rss = {}
        if m.get("rss"):
            with open("/proc/self/clear_refs", "w") as fh:   # reset VmHWM (peak RSS)
                fh.write("5")
            rss["before_kb"] = _status_kb("VmRSS")
        model = Transformer(src.config, comm=comm, max_slots=m.get("max_slots", 64), dtype=dtype)
        model.load_weights(src)
        src.close()
        if m.get("rss"):
            rss["peak_kb"] = _status_kb("VmHWM")
            rss["weight_bytes"] = model.weight_bytes()
            rss["kv_bytes"] = (model.k_cache.numel() + model.v_cache.numel()) * \
                model.k_cache.element_size()
        logits = scenario(model)
        flat = torch.cat([x.reshape(-1) for x in logits]).numpy()
        ref = flat.copy()
        world.Bcast(ref, root=0)
        same = bool(np.array_equal(flat, ref))
        all_same = world.allreduce(int(same), op=MPI.MIN) == 1
        report["models"][m["name"]] = {"ranks_identical": all_same, "rss": rss,
                                       "n_kv_local": model.n_kv_local, "group": model.shard.group}
        if rank == 0:
            torch.save(logits, os.path.join(out_dir, m["name"] + ".pt"))
    reports = world.gather(report, root=0)
    if rank == 0:
        with open(os.path.join(out_dir, "report.json"), "w") as fh:
            json.dump(reports, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
