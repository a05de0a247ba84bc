"""`swiftspec plan`'s predictions beside measured runs: for each trace, the row of the plan's table
(`plan --json`) with the trace's configuration (mode, draft / verify ranks, verify size n, width
w, expansions d: `--expansions` in sync, the draft's pace in async on a shared device), its
predicted tok/s, tokens a step and step ms against the run's.

    python3 benchmarks/plan_check.py PLAN.json TRACE.h5 ... [--json OUT.json]

Prints one Markdown table: run, configuration, predicted / measured tok/s and their error
(predicted / measured - 1), the same from each request's second step on (steady: without the
start of the request, e.g. an async draft rank starting the job's first request late), tokens a
step (predicted / measured), step ms (predicted, of which host; measured = tokens a step /
tok/s). A trace whose configuration the table lacks says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from swiftspec_mpi.trace.analyze import summarize
from swiftspec_mpi.trace.read import read_trace


def config_of(s: dict) -> tuple:
    """(mode, draft ranks, verify ranks, n, w, d) of a summarized trace; d None for async on
    devices of its own (the plan derives it from the timing)."""
    c, e = s["config"] or {}, s.get("env") or {}
    world, verify = int(e.get("world_size") or 1), int(e.get("verify_ranks") or 1)
    d = e.get("expansions_per_verify") if s["mode"] == "sync" else (e.get("draft_pace") or None)
    return (s["mode"], world - verify if s["mode"] == "async" else 0, verify, c.get("verify_size"),
            c.get("tree_width") or c.get("verify_size"), d)


def match(plan: dict, key: tuple) -> dict | None:
    mode, D, V, n, w, d = key
    for r in plan["table"]:
        if (r["mode"], r["draft_ranks"], r["verify_ranks"], r["verify_size"], r["tree_width"]) != (mode, D, V, n, w):
            continue
        if mode == "sync" or r["shared_device"]:
            if r["expansions"] != d:
                continue
        return r
    return None


def steady_tok_s(trace) -> float | None:
    """Tokens / second of every request from its second step's start to its last step's end."""
    tokens = seconds = 0.0
    for r in trace.requests:
        st = r.steps
        if st is None or len(st) < 3:
            continue
        tokens += float(st.accepted[1:].sum())
        seconds += float(st.t_end[-1] - st.t_start[1])
    return tokens / seconds if seconds > 0 else None


def check(plan: dict, path: str) -> dict:
    trace = read_trace(path)
    s = summarize(trace)
    key = config_of(s)
    r = match(plan, key)
    tok_s, acc = s.get("tokens_per_s"), s.get("mean_accepted_length")
    out = {"run": os.path.splitext(os.path.basename(path))[0], "config": key, "measured_tok_s": tok_s,
           "measured_tokens_per_step": acc,
           "measured_step_ms": 1e3 * acc / tok_s if tok_s and acc else None,
           "steady_tok_s": steady_tok_s(trace)}
    if r is not None:
        out.update(predicted_tok_s=r["tok_s"], predicted_tokens_per_step=r["tokens_per_step"],
                   predicted_step_ms=r["step_ms"], predicted_host_ms=r.get("host_ms"),
                   error=r["tok_s"] / tok_s - 1 if tok_s else None,
                   steady_error=r["tok_s"] / out["steady_tok_s"] - 1 if out["steady_tok_s"] else None)
    return out


def fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan")
    p.add_argument("traces", nargs="+")
    p.add_argument("--json")
    args = p.parse_args()
    with open(args.plan) as f:
        plan = json.load(f)
    rows = [check(plan, t) for t in args.traces]
    print("| run | mode, draft/verify, n, w, d | predicted tok/s | measured tok/s | error | steady tok/s | error "
          "| tokens a step (pred / meas) | step ms (pred, host) | step ms (meas) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mode, D, V, n, w, d = r["config"]
        cfg = f"{mode}, {D}/{V}, {n}, {w}, {d if d is not None else 'timed'}"
        if "predicted_tok_s" not in r:
            print(f"| {r['run']} | {cfg} | not in the plan's table | {fmt(r['measured_tok_s'])} | - | "
                  f"{fmt(r['steady_tok_s'])} | - | - | - | - |")
            continue
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f} %"
        serr = "-" if r["steady_error"] is None else f"{100 * r['steady_error']:+.1f} %"
        print(f"| {r['run']} | {cfg} | {fmt(r['predicted_tok_s'])} | {fmt(r['measured_tok_s'])} | {err} | "
              f"{fmt(r['steady_tok_s'])} | {serr} | "
              f"{fmt(r['predicted_tokens_per_step'], 2)} / {fmt(r['measured_tokens_per_step'], 2)} | "
              f"{fmt(r['predicted_step_ms'], 3)} ({fmt(r['predicted_host_ms'], 3)}) | {fmt(r['measured_step_ms'], 3)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
