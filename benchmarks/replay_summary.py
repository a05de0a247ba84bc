"""One Markdown table of runs that replayed acceptance (or `ar` beside them), from their traces:

    python3 benchmarks/replay_summary.py OUT/*.h5 [--json OUT/replay.json]

Columns: the run (file name), mode, acceptance replayed from (model file name, '-' for none),
tok/s, tokens committed a verify step, the verify leader's verify step (or `ar`'s decode step) and
the draft leader's expansion, mean ms (p50 in brackets), and the draft expansions a step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from md_table import md_table   # same folder
from swiftspec_mpi.trace.analyze import summarize
from swiftspec_mpi.trace.read import read_trace


def row(path: str) -> dict:
    s = summarize(read_trace(path))
    roles = s.get("roles") or {}

    def kind(role, name):
        k = (roles.get(role) or {}).get("kinds", {}).get(name) or {}
        return k.get("mean_ms"), k.get("p50_ms"), k.get("count", 0)

    verify = kind("verify", "decode" if s["mode"] == "ar" else "verify")
    expand = kind("draft" if s["mode"] == "async" else "verify", "expand")
    src = (s["config"] or {}).get("accept_from")
    return {"run": os.path.splitext(os.path.basename(path))[0], "mode": s["mode"],
            "accept_from": os.path.basename(src) if src else None, "tok_s": s.get("tokens_per_s"),
            "accepted": s.get("mean_accepted_length"), "verify_ms": verify[0], "verify_p50_ms": verify[1],
            "expand_ms": expand[0], "expand_p50_ms": expand[1],
            "expansions_a_step": expand[2] / verify[2] if verify[2] else None,
            "draft_pace": (s.get("env") or {}).get("draft_pace"), "complete": s.get("complete")}


def fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+")
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for path in args.traces:
        try:
            rows.append(row(path))
        except Exception as exc:  # noqa: BLE001 - a failed run's file: say so, go on
            print(f"{path}: unreadable ({exc})", file=sys.stderr)
    head = ["run", "mode", "acceptance from", "tok/s", "tokens a step", "verify ms (p50)",
            "expand ms (p50)", "expansions a step"]
    print(md_table(head, [[r["run"], r["mode"], r["accept_from"] or "-", fmt(r["tok_s"], 1),
                           fmt(r["accepted"]), f"{fmt(r['verify_ms'], 3)} ({fmt(r['verify_p50_ms'], 3)})",
                           f"{fmt(r['expand_ms'], 3)} ({fmt(r['expand_p50_ms'], 3)})",
                           fmt(r["expansions_a_step"], 1)] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
