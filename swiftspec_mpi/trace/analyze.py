"""Summarize swiftspec HDF5 traces: speed, acceptance, time per role, plots, Perfetto export.

  swiftspec analyze run.h5                      summary table
  swiftspec analyze ar.h5 sync.h5 async.h5      the same table, files side by side
  swiftspec analyze run.h5 --json               machine-readable (a list for several files)
  swiftspec analyze run.h5 --plot figs/         timeline, accepted-length histogram, tokens/s
  swiftspec analyze run.h5 --perfetto t.json    Chrome trace for https://ui.perfetto.dev

Definitions (all computed from the file, nothing estimated):
  tokens/s             sum of new tokens / sum of request seconds (prefill start to last token)
  accepted length      tokens committed by one verify step (accepted draft tokens + the target's
                       bonus token, so >= 1); its mean is the usual "tau"
  acceptance depth d   fraction of verify steps that accepted at least d draft tokens
  time per role        durations of the group leader's events (group rank 0), by event kind
  idle fraction        the leader's `wait` time (blocked on the other group) / wall time, where
                       wall time = last event end - first event start over all ranks
  comm                 the leader's time inside tensor-parallel all-reduces (sum of comm_s)
A file from a run that failed half way is reported as far as it goes (with notes on stderr).
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.gpu.sharing import describe as describe_gpu_sharing

ROLE_NAMES = {0: "verify", 1: "draft"}
KIND_COLORS = {"prefill": "#8c564b", "expand": "#2ca02c", "verify": "#1f77b4", "reroot": "#9467bd",
               "send": "#ff7f0e", "wait": "#d9d9d9", "decode": "#17becf"}
DEFAULT_WINDOW_STEPS = 20


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE.h5", help="trace(s) written by swiftspec run --out")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (one object per file; a list for several files) instead of the table")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="write PNGs to DIR: timeline per file, accepted-length histogram, tokens/s per request")
    parser.add_argument("--window", metavar="START:END", default=None,
                        help="timeline window in seconds on the job clock (default: the first request's "
                             f"first {DEFAULT_WINDOW_STEPS} verify steps)")
    parser.add_argument("--perfetto", metavar="FILE.json", default=None,
                        help="export the events in Chrome trace format (open in ui.perfetto.dev)")


# ---------------------------------------------------------------------------------------------
# numbers

def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(float(x))


def duration_stats(d: np.ndarray) -> dict:
    """count, total and mean/p50/p95/max of durations (seconds in, ms out)."""
    d = np.asarray(d, dtype=np.float64)
    d = d[np.isfinite(d)]
    if len(d) == 0:
        return {"count": 0, "total_s": 0.0, "mean_ms": None, "p50_ms": None, "p95_ms": None, "max_ms": None}
    return {"count": int(len(d)), "total_s": float(d.sum()), "mean_ms": float(d.mean() * 1e3),
            "p50_ms": float(np.percentile(d, 50) * 1e3), "p95_ms": float(np.percentile(d, 95) * 1e3),
            "max_ms": float(d.max() * 1e3)}


def _value_stats(values: list) -> dict:
    v = np.asarray([x for x in values if _finite(x)], dtype=np.float64)
    if len(v) == 0:
        return {"count": 0, "mean": None, "p50": None, "p95": None}
    return {"count": int(len(v)), "mean": float(v.mean()), "p50": float(np.percentile(v, 50)),
            "p95": float(np.percentile(v, 95))}


def _speed(requests) -> dict:
    """Aggregate speed over requests that have both new_tokens and seconds > 0."""
    timed = [r for r in requests if r.new_tokens is not None and _finite(r.seconds) and r.seconds > 0]
    tokens = sum(int(r.new_tokens) for r in timed)
    seconds = float(sum(r.seconds for r in timed))
    per_req = [r.tokens_per_s for r in requests if _finite(r.tokens_per_s)]
    return {"new_tokens": int(sum(int(r.new_tokens) for r in requests if r.new_tokens is not None)),
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "mean_request_tokens_per_s": float(np.mean(per_req)) if per_req else None,
            "ttft_s": _value_stats([r.ttft_s for r in requests])}


def _acceptance(requests) -> dict:
    acc = [r.steps.accepted for r in requests if r.steps is not None and len(r.steps)]
    tree = [r.steps.tree_size for r in requests if r.steps is not None and len(r.steps)]
    if not acc:
        return {"verify_steps": 0 if any(r.steps is not None for r in requests) else None,
                "mean_accepted_length": None, "acceptance_by_depth": [], "accepted_hist": {},
                "mean_tree_size": None}
    a = np.concatenate(acc).astype(np.int64)
    t = np.concatenate(tree).astype(np.int64)
    drafted = a - 1
    max_depth = int(drafted.max()) if len(drafted) else 0
    values, counts = np.unique(a, return_counts=True)
    return {"verify_steps": int(len(a)), "mean_accepted_length": float(a.mean()),
            "acceptance_by_depth": [float(np.mean(drafted >= d)) for d in range(1, max_depth + 1)],
            "accepted_hist": {str(int(v)): int(c) for v, c in zip(values, counts)},
            "mean_tree_size": float(t[t > 0].mean()) if np.any(t > 0) else None}


def _leaders(trace) -> dict[int, int]:
    """role -> world rank of its group leader (group rank 0; else the lowest rank seen)."""
    leaders = {}
    ev = trace.events
    if trace.ranks is not None:
        for rank, role, grank in zip(trace.ranks.rank, trace.ranks.role, trace.ranks.group_rank):
            if int(grank) == 0 and int(role) >= 0 and int(role) not in leaders:
                leaders[int(role)] = int(rank)
    if ev is not None:
        for role in np.unique(ev.role):
            role = int(role)
            ranks = ev.rank[ev.role == role]
            if role not in leaders or leaders[role] not in set(ranks.tolist()):
                leaders[role] = int(ranks.min())
    return leaders


def _event_summary(trace) -> dict:
    ev = trace.events
    out = {"events": 0 if ev is not None else None, "wall_s": None, "roles": {}, "per_rank": [],
           "events_dropped": int(trace.ranks.events_dropped.sum()) if trace.ranks is not None else None,
           "late_graph_captures": int(trace.ranks.late_graph_captures.sum()) if trace.ranks is not None else None}
    if ev is None or len(ev) == 0:
        return out
    ok = np.isfinite(ev.t_start) & np.isfinite(ev.t_end)
    ev = ev.select(ok)
    out["events"] = int(len(ev))
    if len(ev) == 0:
        return out
    wall = float(ev.t_end.max() - ev.t_start.min())
    out["wall_s"] = wall
    dur = np.clip(ev.t_end - ev.t_start, 0.0, None)
    wait_k = ev.kind_index("wait")
    for role, leader in sorted(_leaders(trace).items()):
        name = ROLE_NAMES.get(role, f"role{role}")
        m = ev.rank == leader
        kinds = {}
        for k in sorted(np.unique(ev.kind[m]).tolist()):
            mk = m & (ev.kind == k)
            st = duration_stats(dur[mk])
            st["mean_n_tokens"] = float(ev.n_tokens[mk].mean())
            st["comm_s"] = float(ev.comm_s[mk].sum())
            kinds[ev.kind_name(k)] = st
        wait_s = float(dur[m & (ev.kind == wait_k)].sum())
        comm_s = float(ev.comm_s[m].sum())
        out["roles"][name] = {
            "leader_rank": leader,
            "ranks": sorted(int(r) for r in np.unique(ev.rank[ev.role == role])),
            "kinds": kinds, "wait_s": wait_s, "busy_s": float(dur[m & (ev.kind != wait_k)].sum()),
            "idle_fraction": wait_s / wall if wall > 0 else None,
            "comm_s": comm_s, "comm_fraction": comm_s / wall if wall > 0 else None}
    for rank in sorted(np.unique(ev.rank).tolist()):
        m = ev.rank == rank
        wait_s = float(dur[m & (ev.kind == wait_k)].sum())
        out["per_rank"].append({
            "rank": int(rank), "role": ROLE_NAMES.get(int(ev.role[m][0]), str(int(ev.role[m][0]))),
            "events": int(m.sum()), "busy_s": float(dur[m & (ev.kind != wait_k)].sum()),
            "wait_s": wait_s, "comm_s": float(ev.comm_s[m].sum()),
            "idle_fraction": wait_s / wall if wall > 0 else None})
    return out


def _request_json(r) -> dict:
    acc = r.steps.accepted if r.steps is not None else None
    return {"index": r.index, "category": r.category, "prompt_text": r.prompt_text,
            "prompt_ids": [int(x) for x in r.prompt_ids], "output_ids": [int(x) for x in r.output_ids],
            "text": r.text, "new_tokens": r.new_tokens, "seconds": r.seconds,
            "tokens_per_s": r.tokens_per_s, "ttft_s": r.ttft_s, "stop_reason": r.stop_reason,
            "verify_steps": int(len(acc)) if acc is not None else None,
            "mean_accepted_length": float(acc.mean()) if acc is not None and len(acc) else None}


def summarize(trace, label: str | None = None) -> dict:
    """Everything the table shows, as a JSON-ready dict."""
    env = trace.env or {}
    s = {"file": trace.path, "label": label or os.path.splitext(os.path.basename(trace.path))[0],
         "mode": trace.mode, "complete": trace.complete, "exit_status": trace.exit_status,
         "created": trace.created, "format_version": trace.format_version,
         "world_size": env.get("world_size", len(trace.ranks) if trace.ranks is not None else None),
         "config": trace.config, "env": env, "n_requests": len(trace.requests)}
    s.update(_speed(trace.requests))
    s.update(_acceptance(trace.requests))
    s.update(_event_summary(trace))
    cats = {}
    if any(r.category for r in trace.requests):
        order = []
        for r in trace.requests:
            c = r.category or "(none)"
            if c not in order:
                order.append(c)
        for c in order:
            reqs = [r for r in trace.requests if (r.category or "(none)") == c]
            entry = {"n_requests": len(reqs)}
            entry.update(_speed(reqs))
            a = _acceptance(reqs)
            entry["verify_steps"] = a["verify_steps"]
            entry["mean_accepted_length"] = a["mean_accepted_length"]
            cats[c] = entry
    s["categories"] = cats
    s["requests"] = [_request_json(r) for r in trace.requests]
    s["warnings"] = list(trace.warnings)
    return s


def json_safe(x):
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.ndarray):
        return json_safe(x.tolist())
    return x


# ---------------------------------------------------------------------------------------------
# table

def fmt_number(x, digits: int = 2, suffix: str = "") -> str:
    """x with `digits` decimals and `suffix`; "-" for None, NaN or infinity (table cells)."""
    if not _finite(x):
        return "-"
    return f"{float(x):.{digits}f}{suffix}"


def _pct(x) -> str:
    return "-" if not _finite(x) else f"{100 * float(x):.1f}%"


def _stats_cell(st: dict | None) -> str:
    if not st or not st.get("count"):
        return "-"
    return f"{fmt_number(st['mean_ms'])} / {fmt_number(st['p50_ms'])} / {fmt_number(st['p95_ms'])} (n={st['count']})"


def describe_warmup(graphs: dict | None) -> str:
    """env_json["graphs"] (job.warm_graphs, rank 0's models) -> one cell, '-' when absent."""
    if not graphs:
        return "-"
    return (f"{fmt_number(graphs.get('warm_s'), 1)} s: {graphs.get('captured', 0)} step graphs, "
            f"{graphs.get('prompt_graphs', 0)} prompt graphs / {graphs.get('prompt_buckets', 0)} prompt lengths")


def table_rows(summaries: list[dict]) -> list[tuple[str, list[str]]]:
    """(row label, one cell per file); '' label = section header."""
    rows: list[tuple[str, list[str]]] = []
    col = lambda fn: [fn(s) for s in summaries]  # noqa: E731

    def groups(s):
        roles = s.get("roles") or {}
        parts = [f"{name} {len(info['ranks'])}" for name, info in roles.items()]
        ws = s.get("world_size")
        return f"{ws if ws is not None else '?'}" + (f" ({', '.join(parts)})" if parts else "")

    rows.append(("file", col(lambda s: s["file"])))
    rows.append(("mode", col(lambda s: s["mode"])))
    rows.append(("complete", col(lambda s: "yes" if s["complete"] else f"NO ({s['exit_status'] or '?'})")))
    rows.append(("ranks (groups)", col(groups)))
    rows.append(("GPU shared by", col(lambda s: describe_gpu_sharing((s.get("env") or {}).get("gpu_sharing")))))
    if any((s.get("env") or {}).get("graphs") for s in summaries):
        rows.append(("GPU warm-up (rank 0)", col(lambda s: describe_warmup((s.get("env") or {}).get("graphs")))))
    rows.append(("requests", col(lambda s: str(s["n_requests"]))))
    rows.append(("new tokens", col(lambda s: str(s["new_tokens"]))))
    rows.append(("request seconds", col(lambda s: fmt_number(s["seconds"], 3))))
    rows.append(("tokens/s", col(lambda s: fmt_number(s["tokens_per_s"]))))
    rows.append(("tokens/s, mean of requests", col(lambda s: fmt_number(s["mean_request_tokens_per_s"]))))
    rows.append(("TTFT ms mean / p50 / p95", col(lambda s: "-" if not s["ttft_s"]["count"] else
                                                  f"{fmt_number(s['ttft_s']['mean'] * 1e3, 1)} / "
                                                  f"{fmt_number(s['ttft_s']['p50'] * 1e3, 1)} / "
                                                  f"{fmt_number(s['ttft_s']['p95'] * 1e3, 1)}")))
    rows.append(("verify steps", col(lambda s: "-" if s["verify_steps"] is None else str(s["verify_steps"]))))
    rows.append(("mean accepted length", col(lambda s: fmt_number(s["mean_accepted_length"], 3))))
    rows.append(("mean verified tree size", col(lambda s: fmt_number(s["mean_tree_size"], 2))))
    max_d = max((len(s["acceptance_by_depth"]) for s in summaries), default=0)
    if max_d:
        rows.append(("steps accepting >= d draft tokens", [""] * len(summaries)))
        for d in range(1, max_d + 1):
            rows.append((f"  d = {d}", col(lambda s, d=d: _pct(s["acceptance_by_depth"][d - 1])
                                            if d <= len(s["acceptance_by_depth"]) else "-")))
    role_kinds = []
    for s in summaries:
        for role, info in (s.get("roles") or {}).items():
            for kind in info["kinds"]:
                if (role, kind) not in role_kinds:
                    role_kinds.append((role, kind))
    if role_kinds:
        rows.append(("event ms mean / p50 / p95 (leader)", [""] * len(summaries)))
        for role, kind in role_kinds:
            rows.append((f"  {role}: {kind}", col(lambda s, r=role, k=kind:
                                                   _stats_cell(((s.get("roles") or {}).get(r) or {})
                                                               .get("kinds", {}).get(k)))))
        rows.append(("wall seconds (events)", col(lambda s: fmt_number(s.get("wall_s"), 3))))
        roles = []
        for s in summaries:
            roles += [r for r in (s.get("roles") or {}) if r not in roles]
        for role in roles:
            rows.append((f"idle (wait) {role}", col(lambda s, r=role: _pct(((s.get("roles") or {}).get(r) or {})
                                                                          .get("idle_fraction")))))
        for role in roles:
            def comm(s, r=role):
                info = (s.get("roles") or {}).get(r)
                return "-" if not info else f"{fmt_number(info['comm_s'], 3)} s ({_pct(info['comm_fraction'])})"
            rows.append((f"comm {role}", col(comm)))
    if any(s.get("events_dropped") for s in summaries):
        rows.append(("events dropped", col(lambda s: str(s.get("events_dropped")))))
    if any(s.get("late_graph_captures") for s in summaries):   # warm-up missed a shape: a slow step
        rows.append(("CUDA graphs captured in requests", col(lambda s: str(s.get("late_graph_captures")))))
    cats = []
    for s in summaries:
        cats += [c for c in s["categories"] if c not in cats]
    if cats:
        rows.append(("per category: tok/s | accepted len | n", [""] * len(summaries)))
        for c in cats:
            def cell(s, c=c):
                e = s["categories"].get(c)
                if not e:
                    return "-"
                return f"{fmt_number(e['tokens_per_s'])} | {fmt_number(e['mean_accepted_length'], 2)} | {e['n_requests']}"
            rows.append((f"  {c}", col(cell)))
    return rows


def render_table(summaries: list[dict]) -> str:
    rows = table_rows(summaries)
    header = [""] + [s["label"] for s in summaries]
    lines = [header] + [[label] + cells for label, cells in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(line)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# plots

def parse_window(text: str | None) -> tuple[float | None, float | None] | None:
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 2:
        raise UserError(f"--window '{text}' is not START:END; give seconds like 1.5:2.0 (either side may be empty)")
    try:
        start = float(parts[0]) if parts[0].strip() else None
        end = float(parts[1]) if parts[1].strip() else None
    except ValueError:
        raise UserError(f"--window '{text}' has a non-number; give seconds like 1.5:2.0") from None
    if start is not None and end is not None and end <= start:
        raise UserError(f"--window '{text}' ends before it starts; give START < END")
    return start, end


def default_window(trace) -> tuple[float, float] | None:
    """The first request's first DEFAULT_WINDOW_STEPS verify (or decode) steps."""
    ev = trace.events
    if ev is not None and len(ev):
        ok = np.isfinite(ev.t_start) & np.isfinite(ev.t_end)
        ev = ev.select(ok)
    if ev is not None and len(ev):
        first = int(ev.request[ev.request >= 0].min()) if np.any(ev.request >= 0) else int(ev.request.min())
        m = ev.request == first
        start = float(ev.t_start[m].min())
        leaders = _leaders(trace)
        step_kinds = [ev.kind_index("verify"), ev.kind_index("decode")]
        vm = m & np.isin(ev.kind, step_kinds)
        if 0 in leaders:
            vm &= ev.rank == leaders[0]
        ends = np.sort(ev.t_end[vm])
        end = float(ends[DEFAULT_WINDOW_STEPS - 1]) if len(ends) >= DEFAULT_WINDOW_STEPS else float(ev.t_end[m].max())
        return start, max(end, start + 1e-6)
    for r in trace.requests:
        if r.steps is not None and len(r.steps):
            st = r.steps
            ok = np.isfinite(st.t_start) & np.isfinite(st.t_end)
            if not ok.any():
                continue
            ts, te = st.t_start[ok], st.t_end[ok]
            end = te[min(DEFAULT_WINDOW_STEPS, len(te)) - 1]
            return float(ts.min()), float(max(end, ts.min() + 1e-6))
    return None


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_timeline(trace, path: str, window=None, title: str = "") -> tuple[float, float] | None:
    """Bars per rank (verify ranks on top), colored by event kind; arrows show the hand-offs:
    draft `send` -> the verify leader's next `verify`, and `verify` end -> the draft's next `reroot`."""
    plt = _plt()
    from matplotlib.patches import Patch

    dw = default_window(trace)
    if window is not None:
        start, end = window
        if dw is not None:
            start = dw[0] if start is None else start
            end = dw[1] if end is None else end
        win = (start, end) if start is not None and end is not None else dw
    else:
        win = dw
    fig, ax = plt.subplots(figsize=(14, 4.5))
    ev = trace.events
    if ev is not None and len(ev):
        ev = ev.select(np.isfinite(ev.t_start) & np.isfinite(ev.t_end))
    if win is None or ((ev is None or len(ev) == 0) and not any(r.steps is not None and len(r.steps)
                                                               for r in trace.requests)):
        ax.text(0.5, 0.5, "no timing data in this file", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None
    t0, t1 = win
    legend = {}
    if ev is not None and len(ev):
        inwin = (ev.t_end >= t0) & (ev.t_start <= t1)
        ranks = sorted(np.unique(ev.rank).tolist(), key=lambda r: (int(ev.role[ev.rank == r][0]), r))
        ypos = {r: len(ranks) - 1 - i for i, r in enumerate(ranks)}
        for r in ranks:
            for k in np.unique(ev.kind[inwin & (ev.rank == r)]).tolist():
                m = inwin & (ev.rank == r) & (ev.kind == k)
                name = ev.kind_name(k)
                color = KIND_COLORS.get(name, "#7f7f7f")
                bars = [(s, max(e - s, 1e-7)) for s, e in zip(ev.t_start[m], ev.t_end[m])]
                ax.broken_barh(bars, (ypos[r] - 0.35, 0.7), facecolors=color,
                               edgecolor="#555555" if name == "wait" else "none", linewidth=0.3,
                               hatch="///" if name == "wait" else None)
                legend[name] = Patch(facecolor=color, hatch="///" if name == "wait" else None,
                                     label="wait (blocked on the other group)" if name == "wait" else name)
        labels = [f"rank {r} ({ROLE_NAMES.get(int(ev.role[ev.rank == r][0]), '?')})" for r in ranks]
        ax.set_yticks([ypos[r] for r in ranks])
        ax.set_yticklabels(labels)
        leaders = _leaders(trace)
        if 0 in leaders and 1 in leaders:
            vl, dl = leaders[0], leaders[1]
            kv, ks, kr = ev.kind_index("verify"), ev.kind_index("send"), ev.kind_index("reroot")
            arrows = 0
            # (source: event ends on one leader) -> (the other leader's next event of that request)
            pairs = (((ev.rank == dl) & (ev.kind == ks), (ev.rank == vl) & (ev.kind == kv),
                      ypos[dl], ypos[vl], KIND_COLORS["send"]),
                     ((ev.rank == vl) & (ev.kind == kv), (ev.rank == dl) & (ev.kind == kr),
                      ypos[vl], ypos[dl], KIND_COLORS["verify"]))
            for src_m, dst_m, y0, y1, color in pairs:
                src_m = src_m & inwin
                for req in np.unique(ev.request[src_m]).tolist():
                    targets = np.sort(ev.t_start[dst_m & (ev.request == req)])
                    for t in np.sort(ev.t_end[src_m & (ev.request == req)]):
                        j = np.searchsorted(targets, t - 1e-9)
                        if j >= len(targets) or arrows > 400:
                            continue
                        ax.annotate("", xy=(targets[j], y1), xytext=(t, y0),
                                    arrowprops=dict(arrowstyle="->", color=color, lw=0.7, alpha=0.7))
                        arrows += 1
    else:  # no /events: the verify steps of each request on one row
        for r in trace.requests:
            if r.steps is None or not len(r.steps):
                continue
            st = r.steps
            m = np.isfinite(st.t_start) & np.isfinite(st.t_end) & (st.t_end >= t0) & (st.t_start <= t1)
            bars = [(s, max(e - s, 1e-7)) for s, e in zip(st.t_start[m], st.t_end[m])]
            ax.broken_barh(bars, (-0.35, 0.7), facecolors=KIND_COLORS["verify"], edgecolor="white", linewidth=0.5)
            for s, e, a in zip(st.t_start[m], st.t_end[m], st.accepted[m]):
                ax.text((s + e) / 2, 0, str(int(a)), ha="center", va="center", fontsize=7, color="white")
        legend["verify"] = Patch(facecolor=KIND_COLORS["verify"], label="step (label: tokens committed)")
        ax.set_yticks([0])
        ax.set_yticklabels(["steps (no /events)"])
    ax.set_xlim(t0, t1)
    ax.set_xlabel("seconds on the job clock")
    ax.set_title(title or f"{trace.mode}: {os.path.basename(trace.path)}  [{t0:.4f}, {t1:.4f}] s")
    if legend:
        ax.legend(handles=list(legend.values()), loc="upper center", bbox_to_anchor=(0.5, -0.18),
                  ncol=min(len(legend), 7), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return t0, t1


def plot_accepted_hist(summary: dict, path: str) -> bool:
    hist = summary.get("accepted_hist") or {}
    if not hist:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [int(k) for k in hist]
    ys = [hist[k] for k in hist]
    total = sum(ys)
    ax.bar(xs, [y / total for y in ys], color=KIND_COLORS["verify"])
    ax.set_xticks(xs)
    ax.set_xlabel("tokens committed per verify step (accepted draft tokens + 1)")
    ax.set_ylabel("fraction of verify steps")
    ax.set_title(f"{summary['label']} ({summary['mode']}): mean {summary['mean_accepted_length']:.2f} "
                 f"over {total} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_tokens_per_s(summaries: list[dict], path: str) -> bool:
    series = [(s["label"], {r["index"]: r["tokens_per_s"] for r in s["requests"] if _finite(r["tokens_per_s"])})
              for s in summaries]
    indices = sorted({i for _, d in series for i in d})
    if not indices:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(min(16, max(6, 0.4 * len(indices) * max(1, len(series)))), 4.5))
    width = 0.8 / len(series)
    x = np.arange(len(indices))
    for j, (label, d) in enumerate(series):
        ax.bar(x + (j - (len(series) - 1) / 2) * width, [d.get(i, 0.0) for i in indices], width, label=label)
    cat = {}
    for s in summaries:
        for r in s["requests"]:
            cat.setdefault(r["index"], r["category"])
    ax.set_xticks(x)
    ax.set_xticklabels([f"{i}\n{cat.get(i) or ''}" for i in indices], fontsize=7,
                       rotation=0 if len(indices) < 16 else 90)
    ax.set_xlabel("request")
    ax.set_ylabel("tokens/s")
    ax.set_title("tokens/s per request")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# Perfetto / Chrome trace

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


# ---------------------------------------------------------------------------------------------

def unique_labels(paths: list[str]) -> list[str]:
    labels = []
    for p in paths:
        base = os.path.splitext(os.path.basename(p))[0] or "trace"
        label, n = base, 2
        while label in labels:
            label, n = f"{base}-{n}", n + 1
        labels.append(label)
    return labels


def main(args) -> int:
    from swiftspec_mpi.trace.read import read_trace

    window = parse_window(args.window)
    labels = unique_labels(args.files)
    traces = [read_trace(p) for p in args.files]
    summaries = [summarize(t, label) for t, label in zip(traces, labels)]
    info = sys.stderr if args.json else sys.stdout
    if args.json:
        payload = summaries[0] if len(summaries) == 1 else summaries
        print(json.dumps(json_safe(payload), indent=1))
    else:
        print(render_table(summaries))
    if args.plot:
        try:
            os.makedirs(args.plot, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create --plot folder {args.plot} ({exc.strerror}); choose a writable path") from None
        written = []
        for t, s in zip(traces, summaries):
            p = os.path.join(args.plot, f"{s['label']}_timeline.png")
            win = plot_timeline(t, p, window)
            written.append(p + ("" if win else " (no timing data)"))
            p = os.path.join(args.plot, f"{s['label']}_accepted_hist.png")
            if plot_accepted_hist(s, p):
                written.append(p)
        p = os.path.join(args.plot, "tokens_per_s.png")
        if plot_tokens_per_s(summaries, p):
            written.append(p)
        print("plots: " + ", ".join(written), file=info)
    if args.perfetto:
        n = write_perfetto(traces, labels, args.perfetto)
        print(f"perfetto: {n} events -> {args.perfetto} (open in https://ui.perfetto.dev)", file=info)
    for t, s in zip(traces, summaries):
        for w in t.warnings:
            print(f"note: {s['label']}: {w}", file=sys.stderr)
    return 0
