"""Summaries of swiftspec HDF5 traces (speed, acceptance, time per role) and `swiftspec analyze`
(the figures: trace/plots.py; the Perfetto export: trace/perfetto.py).

  swiftspec analyze run.h5                      summary table
  swiftspec analyze ar.h5 sync.h5 async.h5      the same table, files side by side
  swiftspec analyze run.h5 --json               machine-readable (a list for several files)
  swiftspec analyze run.h5 --plot figs/         timeline, accepted-length histogram, tokens/s
  swiftspec analyze run.h5 --perfetto t.json    Chrome trace for https://ui.perfetto.dev
  swiftspec analyze 'serve*.h5'                 a rotated trace (--trace-rotate): its files as one
  swiftspec analyze run.h5 --acceptance         the acceptance model (trace/acceptance.py): per
                                                depth, how often the target took the draft's
                                                1st, 2nd ... child or none (--json: as JSON)
  swiftspec analyze run.h5 --acceptance-out m.json   write it as a model file (run --accept-from)

A trace of a run that replayed acceptance (run --accept-from) says so on the first line: its
accepted lengths are the model's, its text is meaningless.

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
from swiftspec_mpi.trace import tree_sources

from swiftspec_mpi.trace import perfetto, plots
from swiftspec_mpi.trace.read import ROLE_NAMES, group_leaders


def add_arguments(parser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE.h5",
                        help="trace(s) written by swiftspec run --out; the files of a rotated trace "
                             "(--trace-rotate: run.h5 run.1.h5 ..., or a quoted glob 'run*.h5') are read as one")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (one object per file; a list for several files) instead of the table")
    parser.add_argument("--plot", metavar="DIR", default=None,
                        help="write PNGs to DIR: timeline per file, accepted-length histogram, tokens/s per request")
    parser.add_argument("--window", metavar="START:END", default=None,
                        help="timeline window in seconds on the job clock (default: the first request's "
                             f"first {plots.DEFAULT_WINDOW_STEPS} verify steps)")
    parser.add_argument("--perfetto", metavar="FILE.json", default=None,
                        help="export the events in Chrome trace format (open in ui.perfetto.dev)")
    parser.add_argument("--acceptance", action="store_true",
                        help="print the acceptance model instead of the summary: per tree depth, how often "
                             "the target's token was the draft's 1st, 2nd, 3rd ... child or none (with "
                             "--json: the model file's JSON); the spread between the two halves of the requests")
    parser.add_argument("--acceptance-out", metavar="MODEL.json", default=None,
                        help="write the acceptance model of the (one) trace to MODEL.json, for "
                             "swiftspec run --accept-from / swiftspec plan --accept-from")


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
    for role, leader in sorted(group_leaders(trace).items()):
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


def placement(trace) -> dict[str, list[str]]:
    """Where the ranks ran: host -> ['rank 0 (verify)', ...], hosts in order of their first rank
    (empty when the file has no /ranks)."""
    out: dict[str, list[str]] = {}
    if trace.ranks is None:
        return out
    for rank, role, host in sorted(zip(trace.ranks.rank, trace.ranks.role, trace.ranks.host)):
        out.setdefault(str(host) or "?", []).append(f"rank {int(rank)} ({ROLE_NAMES.get(int(role), '?')})")
    return out


def describe_placement(nodes: dict[str, list[str]]) -> str:
    """{'node1': ['rank 0 (verify)'], ...} -> 'node1: rank 0 (verify); node2: ...' ('-' if none)."""
    return "; ".join(f"{host}: {', '.join(ranks)}" for host, ranks in nodes.items()) or "-"


def summarize(trace, label: str | None = None) -> dict:
    """Everything the table shows, as a JSON-ready dict."""
    env = trace.env or {}
    s = {"file": trace.path, "label": label or os.path.splitext(os.path.basename(trace.path))[0],
         "mode": trace.mode, "complete": trace.complete, "exit_status": trace.exit_status,
         "created": trace.created, "format_version": trace.format_version,
         "world_size": env.get("world_size", len(trace.ranks) if trace.ranks is not None else None),
         "config": trace.config, "env": env, "n_requests": len(trace.requests),
         "nodes": placement(trace), "files": list(trace.files or [trace.path]),
         "ranks_missing": list(trace.ranks_missing)}
    s.update(_speed(trace.requests))
    s.update(_acceptance(trace.requests))
    s.update(_event_summary(trace))
    s["tree_sources"] = tree_sources.tree_source_summary(trace.requests)
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
    """env_json["graphs"] (cli.loading.warm_graphs, rank 0's models) -> one cell, '-' when absent."""
    if not graphs:
        return "-"
    cell = (f"{fmt_number(graphs.get('warm_s'), 1)} s: {graphs.get('captured', 0)} step graphs, "
            f"{graphs.get('prompt_graphs', 0)} prompt graphs / {graphs.get('prompt_buckets', 0)} prompt lengths")
    return cell + describe_step_kernel(graphs.get("step_kernel"))


def describe_step_kernel(ran: dict | None) -> str:
    """env_json["graphs"]["step_kernel"] ({role: "persistent" | "chain"}) -> ", step kernel: target
    persistent, draft chain" ('' when the trace predates the record)."""
    if not ran:
        return ""
    return ", step kernel: " + ", ".join(f"{role} {how}" for role, how in ran.items())


def table_rows(summaries: list[dict]) -> list[tuple[str, list[str]]]:
    """(row label, one cell per file); '' label = section header."""
    rows: list[tuple[str, list[str]]] = []
    col = lambda fn: [fn(s) for s in summaries]  # noqa: E731

    def groups(s):
        roles = s.get("roles") or {}
        parts = [f"{name} {len(info['ranks'])}" for name, info in roles.items()]
        ws = s.get("world_size")
        return f"{ws if ws is not None else '?'}" + (f" ({', '.join(parts)})" if parts else "")

    rows.append(("file", col(lambda s: s["file"] + (f" (+{len(s['files']) - 1} segments)"
                                                     if len(s.get("files") or ()) > 1 else ""))))
    rows.append(("mode", col(lambda s: s["mode"])))
    rows.append(("complete", col(lambda s: "yes" if s["complete"] else f"NO ({s['exit_status'] or '?'})")))
    rows.append(("ranks (groups)", col(groups)))
    if any(s.get("ranks_missing") for s in summaries):
        rows.append(("ranks without events", col(lambda s: ", ".join(map(str, s.get("ranks_missing") or [])) or "-")))
    rows.append(("nodes", col(lambda s: describe_placement(s.get("nodes") or {}))))
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
    rows += tree_sources.table_rows(summaries)
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
# command line

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


def replay_line(trace) -> str | None:
    """The line that says a trace replayed acceptance (run --accept-from), None otherwise."""
    src = (trace.config or {}).get("accept_from")
    if not src:
        return None
    sha = str(trace.config.get("accept_sha256") or "")[:12]
    return (f"{os.path.basename(trace.path)}: acceptance REPLAYED from {src} (sha256 {sha}...) on "
            f"{trace.config.get('load_format')} weights: accepted lengths follow that model, the text is meaningless")


def acceptance_main(args, traces, labels) -> int:
    """--acceptance / --acceptance-out: the model of each trace, the halves' spread."""
    from swiftspec_mpi.trace import acceptance
    if args.acceptance_out and len(traces) != 1:
        raise UserError("--acceptance-out takes one trace; give one FILE.h5")
    models = []
    for t, label in zip(traces, labels):
        model = acceptance.from_trace(t)
        half = len(t.requests) // 2
        if half >= 1:
            try:
                a = acceptance.from_trace(t, t.requests[:half])
                b = acceptance.from_trace(t, t.requests[half:])
                model["halves_spread"] = round(acceptance.spread(a, b), 4)
                model["halves_mean_accepted"] = [a["mean_accepted"], b["mean_accepted"]]
            except UserError:
                pass
        models.append(model)
        if args.acceptance_out:
            acceptance.write_model(model, args.acceptance_out)
            print(f"acceptance model -> {args.acceptance_out}", file=sys.stderr)
        if args.acceptance and not args.json:
            line = replay_line(t)
            if line:
                print(line)
            for text in acceptance.format_table(model, f"{label}: acceptance of {acceptance.describe_source(model)}"):
                print(text)
            if "halves_spread" in model:
                ma, mb = model["halves_mean_accepted"]
                print(f"stability: the two halves of the requests differ by at most "
                      f"{100 * model['halves_spread']:.1f} points (ranks 1-3 and none, depths 0-3); "
                      f"mean tokens a step {ma} vs {mb}")
    if args.acceptance and args.json:
        print(json.dumps(models[0] if len(models) == 1 else models, indent=1))
    return 0


def main(args) -> int:
    from swiftspec_mpi.trace.read import read_traces

    window = parse_window(args.window)
    traces = read_traces(args.files)
    labels = unique_labels([t.path for t in traces])
    if args.acceptance or args.acceptance_out:
        acceptance_main(args, traces, labels)
        if args.acceptance:
            return 0
    summaries = [summarize(t, label) for t, label in zip(traces, labels)]
    info = sys.stderr if args.json else sys.stdout
    if args.json:
        for s in summaries:
            s["replay"] = replay_line(next(t for t in traces if t.path == s["file"]))
        payload = summaries[0] if len(summaries) == 1 else summaries
        print(json.dumps(json_safe(payload), indent=1))
    else:
        for t in traces:
            line = replay_line(t)
            if line:
                print(line)
        print(render_table(summaries))
    if args.plot:
        try:
            os.makedirs(args.plot, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create --plot folder {args.plot} ({exc.strerror}); choose a writable path") from None
        written = []
        for t, s in zip(traces, summaries):
            p = os.path.join(args.plot, f"{s['label']}_timeline.png")
            win = plots.plot_timeline(t, p, window)
            written.append(p + ("" if win else " (no timing data)"))
            p = os.path.join(args.plot, f"{s['label']}_accepted_hist.png")
            if plots.plot_accepted_hist(s, p):
                written.append(p)
            p = os.path.join(args.plot, f"{s['label']}_tree_sources.png")
            if tree_sources.plot_tree_sources(t, p, f"{s['label']}: verified trees"):
                written.append(p)
        p = os.path.join(args.plot, "tokens_per_s.png")
        if plots.plot_tokens_per_s(summaries, p):
            written.append(p)
        print("plots: " + ", ".join(written), file=info)
    if args.perfetto:
        n = perfetto.write_perfetto(traces, labels, args.perfetto)
        print(f"perfetto: {n} events -> {args.perfetto} (open in https://ui.perfetto.dev)", file=info)
    for t, s in zip(traces, summaries):
        for w in t.warnings:
            print(f"note: {s['label']}: {w}", file=sys.stderr)
    return 0
