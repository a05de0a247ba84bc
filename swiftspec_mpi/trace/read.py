"""Read a swiftspec HDF5 trace (docs/trace-format.md) into plain dataclasses and numpy arrays.

The reader is tolerant: a file from a job that died half way may lack `/events`, `/ranks`, some
requests' datasets or attributes, or whole fields of a compound dataset. Whatever is missing gets
an empty/NaN default and one line in `Trace.warnings`; the reader never raises for that. It raises
`UserError` only when the path is not an HDF5 file or the file is not a swiftspec trace.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from swiftspec_mpi.core.errors import UserError

FORMAT_NAME = "swiftspec-trace"
FORMAT_VERSION = 1
DEFAULT_EVENT_KINDS = ("prefill", "expand", "verify", "reroot", "send", "wait", "decode", "abandon")
ROLE_NAMES = {0: "verify", 1: "draft"}

# field name -> (numpy dtype, fill value when the field is missing)
STEP_FIELDS = {"step": (np.int32, -1), "tree_size": (np.int32, -1), "accepted": (np.int32, 0),
               "t_start": (np.float64, np.nan), "t_end": (np.float64, np.nan),
               "tree_source": (np.int8, -1), "tree_depth": (np.int32, -1), "tree_nodes": (np.int32, -1),
               "drafted": (np.int32, -1), "fresh_wait_s": (np.float64, np.nan)}
EVENT_FIELDS = {"rank": (np.int32, -1), "role": (np.int8, -1), "request": (np.int32, -1),
                "step": (np.int32, -1), "kind": (np.int8, -1), "t_start": (np.float64, np.nan),
                "t_end": (np.float64, np.nan), "n_tokens": (np.int32, 0), "accepted": (np.int32, 0),
                "comm_s": (np.float64, 0.0)}
RANK_FIELDS = {"rank": (np.int32, -1), "role": (np.int8, -1), "group_rank": (np.int32, -1),
               "group_size": (np.int32, -1), "host": (object, ""), "device": (object, ""),
               "events_dropped": (np.int64, 0), "late_graph_captures": (np.int32, 0)}
VERDICT_FIELDS = {"step": (np.int32, -1), "depth": (np.int16, -1), "children": (np.int16, 0),
                  "rank": (np.int16, 0), "lp1": (np.float32, np.nan), "lp2": (np.float32, np.nan),
                  "lp3": (np.float32, np.nan)}
# fields added after format_version 1 was first written: older files lack them, silently
ADDED_FIELDS = {"late_graph_captures", "tree_source", "tree_depth", "tree_nodes", "drafted",
                "fresh_wait_s"}


@dataclass
class Steps:
    """One row per verify step (per decode step in `ar`); plain column arrays."""
    step: np.ndarray
    tree_size: np.ndarray
    accepted: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    tree_source: np.ndarray     # trace.record.SOURCE code, -1 in `ar` or an older file
    tree_depth: np.ndarray      # -1 where unknown (older file)
    tree_nodes: np.ndarray
    drafted: np.ndarray
    fresh_wait_s: np.ndarray    # NaN where unknown

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class Verdicts:
    """One row per node of a verified tree at which the target chose (trace.record.VERDICT_DTYPE):
    its depth, its children in the verified tree, the draft rank of the target's token among
    them (1 = the draft's likeliest, 0 = none)."""
    step: np.ndarray
    depth: np.ndarray
    children: np.ndarray
    rank: np.ndarray
    lp1: np.ndarray             # the draft's log-probability of its 1st child there (NaN: none)
    lp2: np.ndarray
    lp3: np.ndarray

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class Request:
    """One request of a trace: its prompt, output, timings and per-step rows (`steps`)."""

    index: int
    name: str                      # the HDF5 group name (e.g. "000003")
    category: str = ""
    prompt_text: str = ""
    text: str = ""
    new_tokens: int | None = None
    seconds: float | None = None
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    stop_reason: str = ""
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    output_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    steps: Steps | None = None     # None when the dataset is absent
    verdicts: Verdicts | None = None   # None when absent (`ar`, or a file from before the field)


@dataclass
class Events:
    """The `/events` table as column arrays; `kind_names[kind]` names each kind index."""
    rank: np.ndarray
    role: np.ndarray
    request: np.ndarray
    step: np.ndarray
    kind: np.ndarray
    t_start: np.ndarray
    t_end: np.ndarray
    n_tokens: np.ndarray
    accepted: np.ndarray
    comm_s: np.ndarray
    kind_names: list[str]

    def __len__(self) -> int:
        return len(self.rank)

    def kind_name(self, k: int) -> str:
        return self.kind_names[k] if 0 <= k < len(self.kind_names) else f"kind{k}"

    def kind_index(self, name: str) -> int:
        return self.kind_names.index(name) if name in self.kind_names else -999

    def select(self, mask: np.ndarray) -> "Events":
        return Events(**{f: getattr(self, f)[mask] for f in EVENT_FIELDS}, kind_names=self.kind_names)


@dataclass
class RankInfo:
    """The trace's ranks table, one entry per world rank."""

    rank: np.ndarray
    role: np.ndarray
    group_rank: np.ndarray
    group_size: np.ndarray
    host: list[str]
    device: list[str]
    events_dropped: np.ndarray
    late_graph_captures: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)


@dataclass
class Trace:
    """A whole trace file as read_trace returns it: run config, environment, requests, events."""

    path: str
    format_version: int | None = None
    mode: str = "?"
    complete: bool = False
    exit_status: str = ""
    config: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    created: str = ""
    event_kinds: list[str] = field(default_factory=lambda: list(DEFAULT_EVENT_KINDS))
    requests: list[Request] = field(default_factory=list)
    events: Events | None = None   # None when /events is absent or unreadable
    ranks: RankInfo | None = None  # None when /ranks is absent or unreadable
    ranks_missing: list[int] = field(default_factory=list)   # ranks whose events never reached the file
    trace_id: str = ""             # a rotated trace (--trace-rotate): the id its files share
    segment: int | None = None     # ... and this file's place among them (0 = --out)
    files: list[str] = field(default_factory=list)   # the files read (several: segments merged)
    warnings: list[str] = field(default_factory=list)


def _to_str(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _to_str(value[()])
    return str(value)


def _attr(attrs, name: str, kind, warnings: list[str], where: str, default=None):
    """Read one attribute converted by `kind` (str/int/float/bool); missing or bad -> default."""
    if name not in attrs:
        warnings.append(f"{where}: attribute '{name}' missing")
        return default
    try:
        raw = attrs[name]
        if kind is str:
            return _to_str(raw)
        if isinstance(raw, np.ndarray):
            raw = raw.reshape(-1)[0]
        if kind is bool:
            if isinstance(raw, (bytes, str)):
                return _to_str(raw).strip().lower() in ("1", "true", "yes")
            return bool(raw)
        return kind(raw)
    except Exception as exc:  # an unreadable attribute must not stop the report
        warnings.append(f"{where}: attribute '{name}' unreadable ({exc})")
        return default


def _json_attr(attrs, name: str, warnings: list[str]) -> dict:
    text = _attr(attrs, name, str, warnings, "file", default=None)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        warnings.append(f"file: attribute '{name}' is not valid JSON ({exc})")
        return {}
    return value if isinstance(value, dict) else {"value": value}


def _columns(arr, fields: dict, where: str, warnings: list[str]) -> dict:
    """Split a structured array into columns, filling fields the file lacks."""
    n = len(arr)
    names = arr.dtype.names or ()
    out = {}
    missing = []
    for name, (dtype, fill) in fields.items():
        if name in names:
            col = arr[name]
            if dtype is object:
                out[name] = [_to_str(v).rstrip("\x00") for v in col]
            else:
                out[name] = np.asarray(col).astype(dtype, copy=True)
        else:
            if name not in ADDED_FIELDS:
                missing.append(name)
            out[name] = [fill] * n if dtype is object else np.full(n, fill, dtype=dtype)
    if missing:
        warnings.append(f"{where}: field(s) {', '.join(missing)} missing")
    return out


def _read_dataset(group, name: str, where: str, warnings: list[str], required: bool = True):
    if name not in group:
        if required:
            warnings.append(f"{where}: dataset '{name}' missing")
        return None
    try:
        return group[name][()]
    except Exception as exc:
        warnings.append(f"{where}: dataset '{name}' unreadable ({exc})")
        return None


def _read_request(g, name: str, warnings: list[str]) -> Request:
    where = f"request {name}"
    a = g.attrs
    index = _attr(a, "index", int, warnings, where, default=None)
    if index is None:
        try:
            index = int(name)
        except ValueError:
            index = -1
    r = Request(index=index, name=name)
    r.category = _attr(a, "category", str, warnings, where, default="") or ""
    r.prompt_text = _attr(a, "prompt_text", str, warnings, where, default="") or ""
    r.text = _attr(a, "text", str, warnings, where, default="") or ""
    r.stop_reason = _attr(a, "stop_reason", str, warnings, where, default="") or ""
    r.new_tokens = _attr(a, "new_tokens", int, warnings, where)
    r.seconds = _attr(a, "seconds", float, warnings, where)
    r.ttft_s = _attr(a, "ttft_s", float, warnings, where)
    r.tokens_per_s = _attr(a, "tokens_per_s", float, warnings, where)
    if r.ttft_s is not None and not math.isfinite(r.ttft_s):
        r.ttft_s = None
    for ds in ("prompt_ids", "output_ids"):
        data = _read_dataset(g, ds, where, warnings)
        if data is not None:
            setattr(r, ds, np.asarray(data, dtype=np.int64).reshape(-1))
    steps = _read_dataset(g, "steps", where, warnings)
    if steps is not None:
        if steps.dtype.names is None:
            warnings.append(f"{where}: dataset 'steps' is not a compound table; ignored")
        else:
            r.steps = Steps(**_columns(steps, STEP_FIELDS, f"{where} steps", warnings))
    verdicts = _read_dataset(g, "verdicts", where, warnings, required=False)
    if verdicts is not None and verdicts.dtype.names is not None:
        r.verdicts = Verdicts(**_columns(verdicts, VERDICT_FIELDS, f"{where} verdicts", warnings))
    # derive what a partial request lacks from what it has
    if r.new_tokens is None and "output_ids" in g:
        r.new_tokens = int(len(r.output_ids))
    if r.tokens_per_s is None and r.new_tokens is not None and r.seconds:
        r.tokens_per_s = r.new_tokens / r.seconds
    return r


def read_trace(path: str) -> Trace:
    """Read FILE.h5; see the module doc for what is tolerated."""
    import os

    import h5py

    if not os.path.exists(path):
        raise UserError(f"{path} does not exist; pass the .h5 file written by `swiftspec run --out`")
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder; pass the .h5 trace file inside it")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise UserError(f"{path} is not a readable HDF5 file ({exc}); pass a trace written by "
                        "`swiftspec run --out FILE.h5`") from None
    with f:
        warnings: list[str] = []
        attrs = f.attrs
        fmt = _to_str(attrs["format"]) if "format" in attrs else None
        if fmt is not None and fmt != FORMAT_NAME:
            raise UserError(f"{path} is an HDF5 file of format '{fmt}', not a swiftspec trace; pass a "
                            "file written by `swiftspec run --out`")
        if fmt is None:
            if "requests" not in f and "events" not in f:
                raise UserError(f"{path} is an HDF5 file but not a swiftspec trace (no 'format' "
                                "attribute, no /requests); pass a file written by `swiftspec run --out`")
            warnings.append("file: attribute 'format' missing (treated as a swiftspec trace)")
        t = Trace(path=path, files=[path])
        t.format_version = _attr(attrs, "format_version", int, warnings, "file")
        if t.format_version is not None and t.format_version > FORMAT_VERSION:
            warnings.append(f"file: format_version {t.format_version} is newer than this reader "
                            f"({FORMAT_VERSION}); fields it does not know are ignored")
        t.mode = _attr(attrs, "mode", str, warnings, "file", default="?") or "?"
        t.complete = bool(_attr(attrs, "complete", bool, warnings, "file", default=False))
        t.exit_status = _attr(attrs, "exit_status", str, warnings, "file", default="") or ""
        t.created = _attr(attrs, "created", str, warnings, "file", default="") or ""
        t.config = _json_attr(attrs, "config_json", warnings)
        t.env = _json_attr(attrs, "env_json", warnings)
        if "event_kinds" in attrs:
            try:
                kinds = json.loads(_to_str(attrs["event_kinds"]))
                if not isinstance(kinds, list):
                    raise ValueError("not a list")
                t.event_kinds = [str(k) for k in kinds]
            except ValueError as exc:
                warnings.append(f"file: attribute 'event_kinds' unreadable ({exc}); using the "
                                "documented order")

        if "requests" in f:
            group = f["requests"]
            for name in sorted(group.keys()):
                try:
                    t.requests.append(_read_request(group[name], name, warnings))
                except Exception as exc:  # a broken group: report it, keep the others
                    warnings.append(f"request {name}: unreadable ({exc})")
            t.requests.sort(key=lambda r: (r.index, r.name))
        else:
            warnings.append("file: group /requests missing")

        ev = _read_dataset(f, "events", "file", warnings, required=False)
        if ev is None and "events" not in f and t.mode in ("async", "sync", "ar"):
            warnings.append("file: dataset /events missing (no per-rank timing)")
        if ev is not None:
            if ev.dtype.names is None:
                warnings.append("file: /events is not a compound table; ignored")
            else:
                t.events = Events(**_columns(ev, EVENT_FIELDS, "events", warnings),
                                  kind_names=t.event_kinds)
        rk = _read_dataset(f, "ranks", "file", warnings, required=False)
        if rk is not None and rk.dtype.names is not None:
            t.ranks = RankInfo(**_columns(rk, RANK_FIELDS, "ranks", warnings))
        if "ranks_missing" in attrs:
            try:
                t.ranks_missing = [int(r) for r in json.loads(_to_str(attrs["ranks_missing"]))]
            except (ValueError, TypeError) as exc:
                warnings.append(f"file: attribute 'ranks_missing' unreadable ({exc})")
        if t.ranks_missing:
            warnings.append(f"file: rank(s) {', '.join(map(str, t.ranks_missing))} sent no events at the "
                            "end of the job (dead or hung); their events are missing")
        if "trace_id" in attrs:
            t.trace_id = _to_str(attrs["trace_id"])
            t.segment = _attr(attrs, "segment", int, warnings, "file", default=None)
        if t.exit_status == "rotated":
            warnings.append(f"file: segment {t.segment} of a rotated trace (the job went on in the next "
                            "file); pass all its files to read them as one")
        elif not t.complete:
            warnings.append(f"file: run incomplete (exit_status: {t.exit_status or 'unknown'}); "
                            "reporting what was written")
        t.warnings = warnings
        return t


ROLE_NAMES = {0: "verify", 1: "draft"}     # trace role -> name (record.ROLE_VERIFY, ROLE_DRAFT)


def group_leaders(trace) -> dict[int, int]:
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


def expand_paths(paths: list[str]) -> list[str]:
    """Command-line trace paths, a quoted glob pattern (runs/serve*.h5) expanded in name order;
    a file named twice is read once."""
    import glob
    import os
    out, seen = [], set()
    for p in paths:
        hits = sorted(glob.glob(p)) if any(c in p for c in "*?[") else []
        for q in hits or [p]:
            key = os.path.realpath(q)
            if key not in seen:
                seen.add(key)
                out.append(q)
    return out


def read_traces(paths: list[str]) -> list[Trace]:
    """Read every path (globs expanded); the files of one rotated trace (same trace_id) become
    one Trace, its segments in order, wherever they stand in `paths`."""
    traces, by_id = [], {}
    for path in expand_paths(paths):
        t = read_trace(path)
        if not t.trace_id:
            traces.append(t)
        elif t.trace_id in by_id:
            by_id[t.trace_id].append(t)
        else:
            by_id[t.trace_id] = [t]
            traces.append(t)
    return [merge_segments(by_id[t.trace_id]) if t.trace_id else t for t in traces]


def merge_segments(parts: list[Trace]) -> Trace:
    """The files of one rotated trace -> one Trace: requests and events of all of them, the
    run's config, environment and first file's path from segment 0 (or the first given), the
    exit status and ranks table from the last segment."""
    parts = sorted(parts, key=lambda t: (t.segment if t.segment is not None else -1, t.path))
    if len(parts) == 1:
        return parts[0]
    first, last = parts[0], parts[-1]
    t = Trace(path=first.path, format_version=first.format_version, mode=first.mode,
              complete=last.complete, exit_status=last.exit_status, config=first.config, env=first.env,
              created=first.created, event_kinds=first.event_kinds, trace_id=first.trace_id,
              segment=first.segment, files=[p.path for p in parts])
    seen = {}
    for p in parts:
        for r in p.requests:
            seen[r.index] = r
        t.warnings += [w for w in p.warnings if not (w.startswith("file: segment ") or
                                                     (p is not last and w.startswith("file: run incomplete")))]
        t.ranks_missing = sorted(set(t.ranks_missing) | set(p.ranks_missing))
    t.requests = [seen[i] for i in sorted(seen)]
    have = [p.segment for p in parts if p.segment is not None]
    gaps = sorted(set(range(min(have), max(have) + 1)) - set(have)) if have else []
    if have and (gaps or min(have) > 0):
        lacking = ([0] if min(have) > 0 else []) + gaps
        t.warnings.append(f"file: segment(s) {', '.join(map(str, lacking))} of this rotated trace not given")
    evs = [p.events for p in parts if p.events is not None]
    if evs:
        t.events = Events(**{f: np.concatenate([getattr(e, f) for e in evs]) for f in EVENT_FIELDS},
                          kind_names=first.event_kinds)
    t.ranks = next((p.ranks for p in reversed(parts) if p.ranks is not None), None)
    return t
