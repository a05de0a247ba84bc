"""Perfetto / Chrome trace export of swiftspec traces (`swiftspec analyze --perfetto FILE`): one
process per rank (and per file), one slice per event; open it at https://ui.perfetto.dev."""
from __future__ import annotations

import json

import numpy as np

from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.trace.read import ROLE_NAMES

STEPS_PID = 9999


def perfetto_events(trace, pid_offset: int = 0, label: str = "") -> list[dict]:
    """Complete events (ph "X"): pid = world rank (+ offset for several files), tid = role."""
    out = []
    prefix = f"{label}: " if label else ""
    ev = trace.events
    if ev is not None and len(ev):
        ev = ev.select(np.isfinite(ev.t_start) & np.isfinite(ev.t_end))
        for r in sorted(np.unique(ev.rank).tolist()):
            out.append({"ph": "M", "name": "process_name", "pid": pid_offset + int(r),
                        "args": {"name": f"{prefix}rank {int(r)}"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid_offset + int(r),
                        "args": {"sort_index": int(r)}})
            for role in np.unique(ev.role[ev.rank == r]).tolist():
                out.append({"ph": "M", "name": "thread_name", "pid": pid_offset + int(r), "tid": int(role),
                            "args": {"name": ROLE_NAMES.get(int(role), f"role {role}")}})
        for i in range(len(ev)):
            out.append({"name": ev.kind_name(int(ev.kind[i])), "cat": ROLE_NAMES.get(int(ev.role[i]), "?"),
                        "ph": "X", "pid": pid_offset + int(ev.rank[i]), "tid": int(ev.role[i]),
                        "ts": float(ev.t_start[i]) * 1e6,
                        "dur": max(0.0, float(ev.t_end[i] - ev.t_start[i])) * 1e6,
                        "args": {"step": int(ev.step[i]), "n_tokens": int(ev.n_tokens[i]),
                                 "accepted": int(ev.accepted[i]), "request": int(ev.request[i]),
                                 "comm_ms": float(ev.comm_s[i]) * 1e3}})
    steps_added = False
    for r in trace.requests:
        if r.steps is None:
            continue
        st = r.steps
        for i in range(len(st)):
            if not (np.isfinite(st.t_start[i]) and np.isfinite(st.t_end[i])):
                continue
            steps_added = True
            out.append({"name": f"step {int(st.step[i])}", "cat": "request", "ph": "X",
                        "pid": pid_offset + STEPS_PID, "tid": int(r.index),
                        "ts": float(st.t_start[i]) * 1e6,
                        "dur": max(0.0, float(st.t_end[i] - st.t_start[i])) * 1e6,
                        "args": {"step": int(st.step[i]), "n_tokens": int(st.tree_size[i]),
                                 "accepted": int(st.accepted[i]), "request": int(r.index)}})
    if steps_added:
        out.append({"ph": "M", "name": "process_name", "pid": pid_offset + STEPS_PID,
                    "args": {"name": f"{prefix}verify steps (per request)"}})
    return out


def write_perfetto(traces: list, labels: list[str], path: str) -> int:
    events = []
    for i, (t, label) in enumerate(zip(traces, labels)):
        many = len(traces) > 1
        events += perfetto_events(t, pid_offset=10000 * i if many else 0, label=label if many else "")
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    except OSError as exc:
        raise UserError(f"cannot write --perfetto {path} ({exc.strerror}); choose a writable path") from None
    return sum(1 for e in events if e["ph"] == "X")
