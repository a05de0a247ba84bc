"""Event recording on every rank and the atomic HDF5 writer (schema: docs/trace-format.md).

Each rank appends fixed-size records into a preallocated numpy structured array (no allocation
per event). World rank 0 keeps the file as an HDF5 image in memory (`TraceFile`) and, after each
finished request, every few seconds of a request in flight and at the end, saves it under a
temporary name and renames it, so a reader never sees a half-written file. A long-lived job
(--serve, --interactive) rotates: a new TraceFile (and file) every --trace-rotate requests or
minutes, so the image, and the time to write it, stay bounded.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from swiftspec_mpi.core.roles import ROLE_DRAFT, ROLE_VERIFY  # noqa: F401  (the trace's role column)

EVENT_KINDS = ("prefill", "expand", "verify", "reroot", "send", "wait", "decode", "abandon")
KIND = {name: i for i, name in enumerate(EVENT_KINDS)}

EVENT_DTYPE = np.dtype([("rank", "<i4"), ("role", "i1"), ("request", "<i4"), ("step", "<i4"),
                        ("kind", "i1"), ("t_start", "<f8"), ("t_end", "<f8"),
                        ("n_tokens", "<i4"), ("accepted", "<i4"), ("comm_s", "<f8")])
STEP_DTYPE = np.dtype([("step", "<i4"), ("tree_size", "<i4"), ("accepted", "<i4"),
                       ("t_start", "<f8"), ("t_end", "<f8"), ("tree_source", "i1"),
                       ("tree_depth", "<i4"), ("tree_nodes", "<i4"), ("drafted", "<i4"),
                       ("fresh_wait_s", "<f8")])
# where a verified tree came from (steps.tree_source; -1: no tree, `ar`)
TREE_SOURCES = ("fresh", "rerooted", "remnant")
SOURCE = {name: i for i, name in enumerate(TREE_SOURCES)}
# one row per node of a verified tree at which the target chose a token (the accepted path's
# nodes: the root, each accepted draft token): the node's depth in the verified tree, its
# children there, and which of them the target's token was, by the draft's probability
# (1 = the most likely; 0 = none of them, the bonus token then ended the step), and the draft's
# log-probabilities of its first three children in the tree at hand (the draft's tree the
# verified one was cut from, as far as the verify leader holds it; NaN where it held fewer).
# The verified tree
# is best-first (scheduler best_subtree), so siblings stand in the draft's probability order.
VERDICT_DTYPE = np.dtype([("step", "<i4"), ("depth", "<i2"), ("children", "<i2"), ("rank", "<i2"),
                          ("lp1", "<f4"), ("lp2", "<f4"), ("lp3", "<f4")])
RANK_DTYPE = np.dtype([("rank", "<i4"), ("role", "i1"), ("group_rank", "<i4"), ("group_size", "<i4"),
                       ("host", "S64"), ("device", "S32"), ("events_dropped", "<i8"),
                       ("late_graph_captures", "<i4")])


class Clock:
    """The job clock: seconds since t0, taken by every rank right after a barrier."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0


class EventRecorder:
    """Preallocated per-rank event log. `record(...)` is O(1) and allocation-free."""

    def __init__(self, rank: int, role: int, clock: Clock, capacity: int = 200_000):
        self.rank, self.role, self.clock = rank, role, clock
        self.events = np.zeros(capacity, dtype=EVENT_DTYPE)
        self.n = 0
        self.dropped = 0

    def record(self, kind: int, request: int, step: int, t_start: float, t_end: float,
               n_tokens: int = 0, accepted: int = 0, comm_s: float = 0.0) -> None:
        if self.n >= len(self.events):
            self.dropped += 1
            return
        self.events[self.n] = (self.rank, self.role, request, step, kind, t_start, t_end,
                               n_tokens, accepted, comm_s)
        self.n += 1

    def snapshot(self) -> np.ndarray:
        return self.events[: self.n]

    def reset(self) -> None:
        """Start over (a new trace segment): the events so far are written, their rows reused."""
        self.n = 0
        self.dropped = 0


@dataclass
class RequestResult:
    """What the verify leader knows about one request (filled while it runs)."""
    index: int
    category: str
    prompt_text: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    stop_reason: str = "interrupted"
    steps: list[tuple] = field(default_factory=list)  # rows of STEP_DTYPE (step_row)
    logprobs: list[tuple] = field(default_factory=list)  # --serve logprobs: decoding.committed_logprobs
    verdicts: list[tuple] = field(default_factory=list)  # rows of VERDICT_DTYPE (verdict_rows)

    @property
    def seconds(self) -> float:
        return max(0.0, (self.t_end or self.t_start) - self.t_start)


def step_row(step: int, tree_size: int, accepted: int, t_start: float, t_end: float,
             source: int = -1, depth: int = 0, nodes: int = 1, drafted: int = 0,
             fresh_wait_s: float = float("nan")) -> tuple:
    """One row of a request's `steps` table (STEP_DTYPE): the verified tree's size, the tokens
    it committed, the step's span; where the tree came from (SOURCE, -1 in `ar`), its depth
    (edges), the nodes at hand it was cut from, the draft expansions it holds made while the
    verify group ran its previous step, and the time the step would have waited for the fresh
    tree (the one the draft re-rooted on the previous result; NaN when none came)."""
    return (step, tree_size, accepted, t_start, t_end, source, depth, nodes, drafted, fresh_wait_s)


def verdict_rows(step: int, parents: np.ndarray, path: np.ndarray, accepted: np.ndarray,
                 tokens: np.ndarray, hand: tuple | None = None) -> list[tuple]:
    """The VERDICT_DTYPE rows of one verified tree: parents int32[n] (-1 at the root, best-first),
    tokens int64[n], path int32[a] (the nodes the target chose at, path[0] = 0), accepted
    int64[a] (the target's token at each: the accepted draft tokens, then the bonus); hand =
    (parents int32[m], scores float64[m]) of the tree at hand, best-first, whose first n nodes
    are the verified tree (scores: the draft's path log-probabilities; None: lp fields NaN)."""
    rows = []
    par = np.asarray(parents)
    nan = float("nan")
    for depth, (node, chosen) in enumerate(zip(np.asarray(path).tolist(), np.asarray(accepted).tolist())):
        kids = np.flatnonzero(par == node)                    # in best-first order
        hit = np.flatnonzero(np.asarray(tokens)[kids] == chosen) if len(kids) else kids
        lp = [nan, nan, nan]
        if hand is not None:
            hand_parents, scores = hand
            for j, kid in enumerate(np.flatnonzero(np.asarray(hand_parents) == node)[:3].tolist()):
                lp[j] = float(scores[kid] - scores[node])
        rows.append((step, depth, len(kids), int(hit[0]) + 1 if len(hit) else 0, *lp))
    return rows


def h5_text(s: str) -> str:
    """`s` as an HDF5 string can hold it: NUL (which a byte-level tokenizer can generate, and
    which HDF5 strings cannot store: h5py raises) becomes U+2400 (SYMBOL FOR NULL), a lone
    surrogate (a JSON prompt can carry one; not UTF-8) becomes '?'. The exact tokens stay in
    output_ids."""
    s = str(s)
    if "\x00" in s:
        s = s.replace("\x00", "\u2400")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = s.encode("utf-8", "replace").decode("utf-8")
    return s


def _root_attrs(mode: str, config_json: str, env: dict, complete: bool, exit_status: str,
                segment: tuple[str, int] | None = None, ranks_missing=()) -> dict:
    """Root attributes; `segment` = (trace_id, k) of a rotated trace's k-th file."""
    attrs = {"format": "swiftspec-trace", "format_version": 1, "mode": mode, "complete": bool(complete),
             "exit_status": h5_text(exit_status), "config_json": config_json,
             "env_json": json.dumps(env, sort_keys=True, default=str),
             "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "event_kinds": json.dumps(list(EVENT_KINDS)),
             "ranks_missing": json.dumps(sorted(int(r) for r in ranks_missing))}
    if segment is not None:
        attrs["trace_id"], attrs["segment"] = segment[0], int(segment[1])
    return attrs


def _write_request(group, r: RequestResult) -> None:
    """/requests/<NNNNNN> of one request (replaced if it exists)."""
    name = f"{r.index:06d}"
    if name in group:
        del group[name]
    g = group.create_group(name)
    new = len(r.output_ids)
    g.attrs["index"] = r.index
    g.attrs["category"] = h5_text(r.category)
    g.attrs["prompt_text"] = h5_text(r.prompt_text)
    g.attrs["text"] = h5_text(r.text)
    g.attrs["new_tokens"] = new
    g.attrs["seconds"] = r.seconds
    g.attrs["ttft_s"] = (r.t_first - r.t_start) if r.t_first is not None else float("nan")
    g.attrs["tokens_per_s"] = new / r.seconds if r.seconds > 0 else 0.0
    g.attrs["stop_reason"] = r.stop_reason
    g.create_dataset("prompt_ids", data=np.asarray(r.prompt_ids, dtype=np.int64))
    g.create_dataset("output_ids", data=np.asarray(r.output_ids, dtype=np.int64))
    g.create_dataset("steps", data=np.array(r.steps, dtype=STEP_DTYPE))
    g.create_dataset("verdicts", data=np.array(r.verdicts, dtype=VERDICT_DTYPE))


def _save(path: str, image: bytes) -> None:
    """`image` to PATH.tmp.<pid>, then os.replace onto PATH: a reader never sees half a file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as out:
        out.write(image)
    os.replace(tmp, path)


def write_trace(path: str, *, mode: str, config_json: str, env: dict, requests: list[RequestResult],
                events: np.ndarray, ranks: np.ndarray, complete: bool, exit_status: str) -> None:
    """Write the whole trace atomically: PATH.tmp.<pid>, then os.replace onto PATH."""
    trace = TraceFile(path)
    trace.write(mode=mode, config_json=config_json, env=env, requests=requests, events=events,
                ranks=ranks, complete=complete, exit_status=exit_status)
    trace.close()


class TraceFile:
    """Rank 0's trace kept as an HDF5 image in memory, saved whole and atomically by `write`.

    A write costs what changed, not what the file holds: a finished request's group is made
    once, the request in flight is replaced, events are appended when `events` is a longer view
    of the same recorder array as last time (else replaced). The image (one memory copy) then
    goes to disk: at once with `sync=True`, else through a saver thread, so that the disk write
    and rename (about 2 ms per MB of file, GIL released) leave the decode loop alone; a newer
    image replaces one still waiting. So rank 0 can write after every request of a long job."""

    def __init__(self, path: str, segment: tuple[str, int] | None = None):
        import h5py
        self.path, self.segment = path, segment
        self.pending: bytes | None = None      # the newest image not yet handed to the disk
        self.saving = False
        self.closing = False                   # close(): the saver thread ends after its last image
        self.cond = threading.Condition()
        self.saver: threading.Thread | None = None
        self.f = h5py.File(f"{path}.image", "w", driver="core", backing_store=False)
        self.requests = self.f.create_group("requests")
        self.final: set[int] = set()           # indices of requests whose group is final
        self.events_base = None                # the recorder array the events dataset mirrors
        self.events_n = 0
        self.root: dict = {}                   # the root attributes as written (each rewritten on change)
        self.ranks_bytes = b""                 # the ranks table as written

    def write(self, *, mode: str, config_json: str, env: dict, requests: list[RequestResult],
              events: np.ndarray, ranks: np.ndarray, complete: bool, exit_status: str,
              sync: bool = True, ranks_missing=()) -> None:
        """`ranks_missing`: world ranks whose events could not be gathered (named in the file)."""
        f = self.f
        for k, v in _root_attrs(mode, config_json, env, complete, exit_status, self.segment, ranks_missing).items():
            if self.root.get(k) != v:          # an attribute costs ~0.2 ms a write: only what changed
                f.attrs[k] = self.root[k] = v
        for r in requests:
            if r.index not in self.final:
                _write_request(self.requests, r)
                if r.t_end is not None:
                    self.final.add(r.index)
        self._write_events(np.asarray(events).astype(EVENT_DTYPE, copy=False), events)
        ranks = ranks.astype(RANK_DTYPE, copy=False)
        if ranks.tobytes() != self.ranks_bytes:
            if "ranks" in f:
                del f["ranks"]
            f.create_dataset("ranks", data=ranks)
            self.ranks_bytes = ranks.tobytes()
        f.flush()
        image = f.id.get_file_image()
        if sync:
            self.wait_saved()
            _save(self.path, image)
            return
        with self.cond:
            self.pending = image
            self.cond.notify()
        if self.saver is None:
            self.saver = threading.Thread(target=self._save_loop, name="trace-saver", daemon=True)
            self.saver.start()

    def _save_loop(self) -> None:
        while True:
            with self.cond:
                while self.pending is None and not self.closing:
                    self.cond.wait()
                if self.pending is None:       # closing, nothing left to write
                    return
                image, self.pending, self.saving = self.pending, None, True
            try:
                _save(self.path, image)
            except OSError as exc:   # the next synchronous write reports a lasting problem
                print(f"swiftspec: could not save the trace checkpoint {self.path}: {exc}",
                      file=sys.stderr, flush=True)
            with self.cond:
                self.saving = False
                self.cond.notify_all()

    def wait_saved(self) -> None:
        """Until the saver thread has nothing left to write."""
        with self.cond:
            while self.pending is not None or self.saving:
                self.cond.wait()

    def _write_events(self, rows: np.ndarray, given: np.ndarray) -> None:
        base = getattr(given, "base", None)
        ds = self.f.get("events")
        if ds is not None and base is not None and base is self.events_base and len(rows) >= self.events_n:
            new = rows[self.events_n:]
            if len(new):
                ds.resize((len(rows),))
                ds[self.events_n:] = new
        else:
            if ds is not None:
                del self.f["events"]
            self.f.create_dataset("events", data=rows, maxshape=(None,), chunks=(4096,))
            self.events_base = base
        self.events_n = len(rows)

    def close(self) -> None:
        """Write what is pending, end the saver thread (a rotated trace makes one TraceFile per
        segment: none may leave a thread behind), close the in-memory file."""
        self.wait_saved()
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.saver is not None:
            self.saver.join()
            self.saver = None
        self.f.close()
