"""Cost of rank 0's trace write after each finished request: record.TraceFile (incremental, the
disk write on its saver thread) against a one-shot write_trace of the same state (the whole
file rewritten), as a job grows. Each request: 128 output tokens, 40 steps, 200 events.

    .venv/bin/python benchmarks/bench_trace_write.py [--requests 1000] [--dir /tmp]

Prints, at 1, 10, 100 and 1000 requests: the incremental write's stall of the caller, the
one-shot rewrite's time, and the file size; then the incremental writes' total over the job.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from swiftspec_mpi.trace.record import (RANK_DTYPE, Clock, EventRecorder, RequestResult, TraceFile, step_row,
                                        write_trace)


def request(i: int) -> RequestResult:
    return RequestResult(i, "bench", "prompt " * 20, list(range(30)), list(range(128)), "text " * 100,
                         0.0, 0.1, 1.0, "max_new_tokens", [step_row(s, 8, 3, 0.0, 0.1) for s in range(40)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    inc_path, full_path = os.path.join(args.dir, "bench-inc.h5"), os.path.join(args.dir, "bench-full.h5")
    rec = EventRecorder(0, 0, Clock(), capacity=max(1000, 200 * args.requests))
    ranks = np.zeros(3, dtype=RANK_DTYPE)
    common = dict(mode="async", config_json="{}", env={}, ranks=ranks, complete=False, exit_status="running")
    trace = TraceFile(inc_path)
    results, total = [], 0.0
    print(f"{'requests':>8} {'incremental ms':>15} {'one-shot rewrite ms':>20} {'file MiB':>9}")
    for i in range(args.requests):
        for k in range(200):
            rec.record(2, i, k, 0.0, 1.0)
        results.append(request(i))
        t0 = time.perf_counter()
        trace.write(**common, requests=results, events=rec.snapshot(), sync=False)
        took = time.perf_counter() - t0
        total += took
        if i + 1 in (1, 10, 100, 1000, args.requests):
            trace.wait_saved()
            t0 = time.perf_counter()
            write_trace(full_path, **common, requests=results, events=rec.snapshot())
            full = time.perf_counter() - t0
            print(f"{i + 1:>8} {took * 1e3:>15.1f} {full * 1e3:>20.1f} {os.path.getsize(inc_path) / 2**20:>9.1f}")
    trace.close()
    print(f"incremental writes after all {args.requests} requests: {total:.2f} s in total")


if __name__ == "__main__":
    main()
