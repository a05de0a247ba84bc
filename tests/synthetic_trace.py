"""Synthetic swiftspec traces for tests, written with h5py straight from docs/trace-format.md.

Independent of swiftspec_mpi.trace.record (the engine's writer) and of the reader: tests build a run
with `make_run`, write it with `write`, and recompute expected numbers from the raw arrays that
`make_run` returns.
"""
from __future__ import annotations

import json

import h5py
import numpy as np

EVENT_KINDS = ["prefill", "expand", "verify", "reroot", "send", "wait", "decode"]
K = {name: i for i, name in enumerate(EVENT_KINDS)}
STEP_DTYPE = np.dtype([("step", "<i4"), ("tree_size", "<i4"), ("accepted", "<i4"),
                       ("t_start", "<f8"), ("t_end", "<f8")])
EVENT_DTYPE = np.dtype([("rank", "<i4"), ("role", "i1"), ("request", "<i4"), ("step", "<i4"),
                        ("kind", "i1"), ("t_start", "<f8"), ("t_end", "<f8"), ("n_tokens", "<i4"),
                        ("accepted", "<i4"), ("comm_s", "<f8")])
RANK_DTYPE = np.dtype([("rank", "<i4"), ("role", "i1"), ("group_rank", "<i4"), ("group_size", "<i4"),
                       ("host", "S64"), ("device", "S32"), ("events_dropped", "<i8")])


def make_run(mode: str = "async", n_requests: int = 3, steps: int = 25, categories=("writing", "coding"),
             verify_ranks=(0, 1), draft_ranks=(2, 3), seed: int = 0, t_offset: float = 0.0) -> dict:
    """A plausible run: per request a prefill, then `steps` verify steps (decode steps in ar).

    async: the draft ranks expand continuously, send a subtree before each verify, reroot after;
    the verify ranks wait for the subtree, verify, send. Every rank of a group logs the same
    events (tensor parallelism) with its own comm_s. Returns plain numpy/dict data."""
    rng = np.random.default_rng(seed)
    if mode != "async":
        draft_ranks = ()
    events = []
    requests = []
    t = t_offset + 0.01

    def add(ranks, role, req, step, kind, t0, t1, n_tokens=0, accepted=0):
        for r in ranks:
            events.append((r, role, req, step, K[kind], t0, t1, n_tokens, accepted,
                           float(rng.uniform(0, 0.3)) * (t1 - t0)))

    for i in range(n_requests):
        p_len = int(rng.integers(5, 20))
        prompt_ids = rng.integers(0, 1000, size=p_len).astype(np.int64)
        t_req = t
        pre = float(rng.uniform(0.02, 0.05))
        add(verify_ranks, 0, i, 0, "prefill", t, t + pre, n_tokens=p_len)
        if draft_ranks:
            add(draft_ranks, 1, i, 0, "prefill", t, t + pre * 0.4, n_tokens=p_len)
        t += pre
        t_first = t
        rows = []
        expansion = 0
        for s in range(steps):
            if mode == "ar":
                d = float(rng.uniform(0.004, 0.006))
                add(verify_ranks, 0, i, s, "decode", t, t + d, n_tokens=1, accepted=1)
                rows.append((s, 1, 1, t, t + d))
                t += d
                continue
            tree = 8
            acc = int(rng.integers(1, 6))
            wait = float(rng.uniform(0.0, 0.002))
            if draft_ranks:
                # draft: expansions while the verify group waits, then sends the subtree
                for _ in range(2):
                    e = wait / 3
                    add(draft_ranks, 1, i, expansion, "expand", t, t + e, n_tokens=8)
                    expansion += 1
                    t_e = t + e
                add(draft_ranks, 1, i, expansion, "send", t_e, t + wait, n_tokens=tree)
                add(verify_ranks, 0, i, s, "wait", t, t + wait)
            vt0 = t + wait
            dv = float(rng.uniform(0.008, 0.012))
            if mode == "sync":
                # serial tree speculation on one group: expansions first, then verify
                ex = float(rng.uniform(0.002, 0.003))
                add(verify_ranks, 0, i, s, "expand", vt0, vt0 + ex, n_tokens=8)
                vt0 += ex
            add(verify_ranks, 0, i, s, "verify", vt0, vt0 + dv, n_tokens=tree, accepted=acc)
            add(verify_ranks, 0, i, s, "send", vt0 + dv, vt0 + dv + 0.0001)
            if draft_ranks:
                add(draft_ranks, 1, i, expansion, "expand", vt0, vt0 + dv * 0.5, n_tokens=8)
                expansion += 1
                add(draft_ranks, 1, i, expansion, "wait", vt0 + dv * 0.5, vt0 + dv + 0.0001)
                add(draft_ranks, 1, i, expansion, "reroot", vt0 + dv + 0.0001, vt0 + dv + 0.0003,
                    accepted=acc)
            rows.append((s, tree if mode != "ar" else 1, acc, vt0, vt0 + dv))
            t = vt0 + dv + 0.0003
        step_arr = np.array(rows, dtype=STEP_DTYPE)
        new_tokens = 1 + int(step_arr["accepted"].sum())
        seconds = t - t_req
        requests.append({
            "index": i, "category": categories[i % len(categories)] if categories else "",
            "prompt_text": f"prompt number {i}", "text": f"generated text {i} \u00e9",
            "new_tokens": new_tokens, "seconds": seconds, "ttft_s": t_first - t_req,
            "tokens_per_s": new_tokens / seconds, "stop_reason": "max_new_tokens",
            "prompt_ids": prompt_ids,
            "output_ids": rng.integers(0, 1000, size=new_tokens).astype(np.int64),
            "steps": step_arr})
        t += 0.005
    ev = np.array(events, dtype=EVENT_DTYPE)
    ranks = [(r, 0, j, len(verify_ranks), b"node1", b"cpu", 0) for j, r in enumerate(verify_ranks)]
    ranks += [(r, 1, j, len(draft_ranks), b"node1", b"cpu", 0) for j, r in enumerate(draft_ranks)]
    world = len(verify_ranks) + len(draft_ranks)
    return {"mode": mode, "complete": True, "exit_status": "ok",
            "config": {"mode": mode, "max_new_tokens": 128, "temperature": 0.0},
            "env": {"world_size": world, "verify_size": len(verify_ranks), "draft_size": len(draft_ranks)},
            "requests": requests, "events": ev, "ranks": np.array(ranks, dtype=RANK_DTYPE)}


def write(path, run: dict, omit=()) -> None:
    """Write `run` to PATH. `omit` names parts to leave out, to fake a partial file:
    "events", "ranks", "requests", "steps:<i>", "output_ids:<i>", "attr:<name>" (root),
    "reqattr:<i>:<name>", "request:<i>" (the whole group)."""
    omit = set(omit)
    with h5py.File(path, "w") as f:
        root = {"format": "swiftspec-trace", "format_version": 1, "mode": run["mode"],
                "complete": bool(run["complete"]), "exit_status": run["exit_status"],
                "config_json": json.dumps(run["config"]), "env_json": json.dumps(run["env"]),
                "created": "2026-11-29T10:00:00+0000", "event_kinds": json.dumps(EVENT_KINDS)}
        for k, v in root.items():
            if f"attr:{k}" not in omit:
                f.attrs[k] = v
        if "requests" not in omit:
            g = f.create_group("requests")
            for r in run["requests"]:
                i = r["index"]
                if f"request:{i}" in omit:
                    continue
                rg = g.create_group(f"{i:06d}")
                for k in ("index", "category", "prompt_text", "text", "new_tokens", "seconds", "ttft_s",
                          "tokens_per_s", "stop_reason"):
                    if f"reqattr:{i}:{k}" not in omit:
                        rg.attrs[k] = r[k]
                for k in ("prompt_ids", "output_ids", "steps"):
                    if f"{k}:{i}" not in omit:
                        rg.create_dataset(k, data=r[k])
        if "events" not in omit:
            f.create_dataset("events", data=run["events"])
        if "ranks" not in omit:
            f.create_dataset("ranks", data=run["ranks"])


TREE_STEP_DTYPE = np.dtype(STEP_DTYPE.descr + [("tree_source", "i1"), ("tree_depth", "<i4"),
                                               ("tree_nodes", "<i4"), ("drafted", "<i4"),
                                               ("fresh_wait_s", "<f8")])


def with_tree_columns(run: dict, seed: int = 0) -> dict:
    """`run` with the verified-tree columns added to every request's steps (source 0 fresh,
    1 rerooted, 2 remnant; some would-be waits unknown, NaN), as the engine writes them."""
    rng = np.random.default_rng(seed)
    for r in run["requests"]:
        old = r["steps"]
        new = np.zeros(len(old), dtype=TREE_STEP_DTYPE)
        for name in STEP_DTYPE.names:
            new[name] = old[name]
        new["tree_source"] = rng.integers(0, 3, size=len(old))
        new["tree_depth"] = np.maximum(old["accepted"] - 1, rng.integers(0, 7, size=len(old)))
        new["tree_nodes"] = old["tree_size"] + rng.integers(0, 20, size=len(old))
        new["drafted"] = rng.integers(0, 5, size=len(old))
        wait = rng.uniform(0.0, 0.2, size=len(old))
        wait[new["tree_source"] == 0] = 0.0
        wait[rng.random(len(old)) < 0.1] = np.nan
        new["fresh_wait_s"] = wait
        r["steps"] = new
    return run
