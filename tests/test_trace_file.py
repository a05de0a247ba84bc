"""record.TraceFile: rank 0's incremental trace writer gives, after every write, the file a
one-shot write_trace of the same state gives, and a write costs what changed."""
from __future__ import annotations

import time

import numpy as np

from swiftspec_mpi.trace.read import read_trace
from swiftspec_mpi.trace.record import (RANK_DTYPE, Clock, EventRecorder, RequestResult, TraceFile,
                                        step_row, write_trace)


def state_of(path) -> dict:
    t = read_trace(str(path))
    return {"complete": t.complete, "exit_status": t.exit_status, "mode": t.mode,
            "requests": [(r.index, r.stop_reason, r.text, r.output_ids.tolist(), len(r.steps))
                         for r in t.requests],
            "events": None if t.events is None else (len(t.events), t.events.step.tolist()),
            "hosts": None if t.ranks is None else list(t.ranks.host),
            "warnings": list(t.warnings)}


def test_incremental_writes_equal_one_shot_writes(tmp_path):
    """Requests finish one by one, one stays in flight and grows, events are appended, the last
    write replaces the events (all ranks) and the ranks: each file reads back exactly like a
    write_trace of the same state."""
    rec = EventRecorder(0, 0, Clock(), capacity=1000)
    ranks = np.zeros(2, dtype=RANK_DTYPE)
    ranks["rank"] = [0, 1]
    ranks["host"] = [b"node1", b"node2"]
    inc, ref = tmp_path / "inc.h5", tmp_path / "ref.h5"
    trace = TraceFile(str(inc))
    results: list[RequestResult] = []
    common = dict(mode="async", config_json="{}", env={"world_size": 2}, ranks=ranks)
    for i in range(3):
        r = RequestResult(i, "", f"prompt {i}", [1, 2, 3])
        results.append(r)
        for step in range(4):                    # the request in flight, checkpointed each step
            r.output_ids += [10 * i + step, 7]
            r.steps.append(step_row(step, 4, 1, 0.1 * step, 0.1 * step + 0.05))
            rec.record(2, i, step, 0.0, 1.0)
            for sync in (False, True):
                trace.write(**common, requests=results, events=rec.snapshot(), complete=False,
                            exit_status="running", sync=sync)
                trace.wait_saved()
                write_trace(str(ref), **common, requests=results, events=rec.snapshot(),
                            complete=False, exit_status="running")
                assert state_of(inc) == state_of(ref)
        r.text, r.t_end, r.stop_reason = f"text {i}", 1.0, "max_new_tokens"
    everyone = np.concatenate([rec.snapshot(), rec.snapshot()[:3]])
    trace.write(**common, requests=results, events=everyone, complete=True, exit_status="ok")
    trace.close()
    write_trace(str(ref), **common, requests=results, events=everyone, complete=True, exit_status="ok")
    got = state_of(inc)
    assert got == state_of(ref)
    assert got["complete"] and [q[1] for q in got["requests"]] == ["max_new_tokens"] * 3
    assert got["events"][0] == 15 and got["hosts"] == ["node1", "node2"]


def test_write_cost_follows_what_changed(tmp_path):
    """After 300 finished requests, adding one more costs a fraction of rewriting them all."""
    rec = EventRecorder(0, 0, Clock(), capacity=100_000)
    ranks = np.zeros(1, dtype=RANK_DTYPE)
    trace = TraceFile(str(tmp_path / "inc.h5"))
    results = []
    common = dict(mode="ar", config_json="{}", env={}, ranks=ranks, complete=False,
                  exit_status="running")
    for i in range(300):
        results.append(RequestResult(i, "", "p", [1], list(range(64)), "t", 0.0, 0.1, 1.0,
                                     "max_new_tokens", [step_row(s, 1, 1, 0.0, 0.1) for s in range(64)]))
        for k in range(64):
            rec.record(6, i, k, 0.0, 1.0)
        trace.write(**common, requests=results, events=rec.snapshot(), sync=False)
    trace.wait_saved()
    t0 = time.perf_counter()
    for _ in range(3):
        trace.write(**common, requests=results, events=rec.snapshot(), sync=True)
    incremental = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    write_trace(str(tmp_path / "full.h5"), **common, requests=results, events=rec.snapshot())
    full = time.perf_counter() - t0
    trace.close()
    assert incremental < full / 3, (incremental, full)
    assert len(read_trace(str(tmp_path / "inc.h5")).requests) == 300


def test_rotated_segments_read_as_one_and_leave_no_thread(tmp_path):
    """Three segments of one trace_id (as --trace-rotate writes them: each closed with its own
    events), given out of order beside an unrelated file: read_traces merges the three in
    segment order (every request, every event, the last segment's status and ranks) and keeps the
    other apart; closing a TraceFile ends its saver thread; ranks_missing is read back."""
    import threading

    from swiftspec_mpi.core.config import parse_trace_rotate, segment_path
    from swiftspec_mpi.trace.read import read_traces

    assert parse_trace_rotate("1000") == (1000, None) and parse_trace_rotate("30m") == (None, 1800.0)
    assert parse_trace_rotate("50,2h") == (50, 7200.0) and parse_trace_rotate("0") == (None, None)
    for bad in ("", "x", "-3", "10,20", "0m", "5s"):
        try:
            parse_trace_rotate(bad)
        except Exception as exc:  # noqa: BLE001 - checked: the one-line UserError
            assert type(exc).__name__ == "UserError" and "--trace-rotate" in str(exc)
        else:
            raise AssertionError(f"--trace-rotate {bad!r} was accepted")
    out = str(tmp_path / "serve.h5")
    assert segment_path(out, 0) == out and segment_path(out, 2) == str(tmp_path / "serve.2.h5")
    threads = threading.active_count()
    ranks = np.zeros(2, dtype=RANK_DTYPE)
    ranks["rank"] = [0, 1]
    for k in range(3):
        rec = EventRecorder(0, 0, Clock(), capacity=100)
        trace = TraceFile(segment_path(out, k), ("abc", k))
        results = []
        for i in range(2 * k, 2 * k + 2):
            r = RequestResult(i, "server", f"p{i}", [1], output_ids=[5, 6], t_end=1.0)
            results.append(r)
            rec.record(1, i, 0, float(i), float(i) + 0.5)
            trace.write(mode="async", config_json="{}", env={}, requests=results, events=rec.snapshot(),
                        ranks=ranks, complete=False, exit_status="running", sync=False)
        last = k == 2
        trace.write(mode="async", config_json="{}", env={}, requests=results, events=rec.snapshot(),
                    ranks=ranks, complete=False, exit_status="interrupted" if last else "rotated",
                    ranks_missing=[1] if last else ())
        trace.close()
    assert threading.active_count() == threads, "a closed TraceFile left its saver thread running"
    other = str(tmp_path / "other.h5")
    write_trace(other, mode="ar", config_json="{}", env={}, requests=[], events=np.zeros(0),
                ranks=ranks, complete=True, exit_status="ok")
    merged, alone = read_traces([segment_path(out, 2), other, str(tmp_path / "serve.*.h5"), out])
    assert [r.index for r in merged.requests] == list(range(6)) and len(merged.events) == 6
    assert merged.exit_status == "interrupted" and merged.ranks_missing == [1]
    assert len(merged.files) == 3 and merged.path == out
    assert not any("segment" in w for w in merged.warnings)
    assert alone.path == other and alone.complete
    assert any("segment 1 of a rotated trace" in w for w in read_traces([segment_path(out, 1)])[0].warnings)
