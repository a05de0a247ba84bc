"""The acceptance model of a draft/target pair: at each depth of a verified tree, how likely the
target's token is the draft's 1st, 2nd, 3rd ... child there, or none of them.

Estimated from a trace's `verdicts` (trace.record.VERDICT_DTYPE: per node the target chose at,
its depth, its children in the verified tree, the draft rank of the target's token among them).
A node with c children only shows ranks 1..c: "none of them" there means "rank > c or not among
the draft's choices" (censored). So rank r is estimated by its hazard, as in a Kaplan-Meier
estimate: h[d][r] = (nodes at depth d whose token was rank r) / (nodes at depth d with at least r
children whose token was not rank 1..r-1), and p[d][r] = h[d][r] * prod_{j<r} (1 - h[d][j]);
p_none[d] = 1 - sum_r p[d][r]. Ranks no node was at risk for get h = 0 (counted as none).

The model file (JSON, `swiftspec analyze TRACE --acceptance-out FILE`):
    {"format": "swiftspec-acceptance", "version": 1, "source": {...}, "mean_accepted": float,
     "topk": K, "conf_edges": [log-probabilities], "depths": [{"depth": d, "nodes": n,
                            "chosen": [count of rank 1..K], "none": count,
                            "at_risk": [K], "p": [K], "p_none": float,
                            "draft_lp": [3 floats or null]}, ...]}
`draft_lp` is the draft's mean log-probability of its 1st, 2nd, 3rd child at that depth (the
real draft's confidence, which shapes its trees; a replay's draft takes it, engine/replay.py).
Depths past the last one in the file use the last one's row (`probs`).
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np

from swiftspec_mpi.core.errors import UserError

FORMAT = "swiftspec-acceptance"
VERSION = 1
# the draft's confidence at a node: the log-probability of its likeliest child, in buckets split
# at p = 0.2, 0.3, 0.4, 0.5, 0.8; acceptance is estimated per depth and bucket too
# (`by_confidence`), since a draft that is sure is right more often (and grows deeper there). Below
# 0.5 the first child's share still climbs with it (the tiny pair: 62 % under p = 0.2, 93 % at
# 0.4-0.5): one bucket there replayed its unsure and fairly sure nodes alike, and `async` 4-6 %
# short. A model file names its edges (`conf_edges`); one without them has LEGACY_EDGES.
CONF_EDGES = (math.log(0.2), math.log(0.3), math.log(0.4), math.log(0.5), math.log(0.8))
LEGACY_EDGES = (math.log(0.5), math.log(0.8))
LP_SAMPLES = 64      # rows of the draft's confidence kept per depth (lp_samples)
MIN_NODES = 20       # a depth with fewer decision nodes than this is pooled into the one above it


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rows(trace, requests=None):
    """(depth, children, rank int64[N], lp float64[N, 4]) of the verdicts of `requests` (default
    all); lp columns: the draft's log-probabilities of the node's first three children, then the
    node's own (the one its parent gave it, when the parent is the row before: the accepted path)."""
    reqs = trace.requests if requests is None else requests
    parts = [r.verdicts for r in reqs if r.verdicts is not None and len(r.verdicts)]
    if not parts:
        return (np.zeros(0, np.int64),) * 3 + (np.zeros((0, 4)),)
    cols = [np.concatenate([getattr(v, f) for v in parts]).astype(np.int64) for f in ("step", "depth", "children", "rank")]
    step, depth, children, rank = cols
    lp = np.stack([np.concatenate([getattr(v, f) for v in parts]).astype(np.float64)
                   for f in ("lp1", "lp2", "lp3")], axis=1)
    own = np.full(len(depth), np.nan)
    prev = np.arange(len(depth)) - 1
    ok = (prev >= 0) & (depth == depth[np.maximum(prev, 0)] + 1) & (step == step[np.maximum(prev, 0)])
    prank = rank[np.maximum(prev, 0)]
    ok &= (prank >= 1) & (prank <= 3)
    idx = np.flatnonzero(ok)
    own[idx] = lp[idx - 1, prank[idx] - 1]
    return depth, children, rank, np.concatenate([lp, own[:, None]], axis=1)


def mean_accepted(trace, requests=None) -> float:
    """Tokens committed per verify step (accepted draft tokens + the bonus) over the steps that
    verified a tree (tree_size > 1); NaN without any."""
    reqs = trace.requests if requests is None else requests
    acc = [r.steps.accepted[r.steps.tree_size > 1] for r in reqs if r.steps is not None and len(r.steps)]
    acc = np.concatenate(acc) if acc else np.zeros(0)
    return float(acc.mean()) if len(acc) else float("nan")


def estimate(depth: np.ndarray, children: np.ndarray, rank: np.ndarray, topk: int | None = None,
             lp: np.ndarray | None = None) -> list[dict]:
    """The per-depth rows of the model from verdict columns (int64[N] each; lp float64[N, 4] the
    draft's log-probabilities of the first three children and the node's own, NaN where absent:
    _rows); see the module doc. Depths with fewer than MIN_NODES nodes (that have children) join
    the next ones (the deepest ones: the row above)."""
    informative = children > 0
    depth, children, rank = depth[informative], children[informative], rank[informative]
    lp = np.full((len(depth), 4), np.nan) if lp is None else lp[informative]
    if len(depth) == 0:
        return []
    K = int(topk or children.max())
    rows = []
    groups, lo = [], 0                   # [first depth, last depth] of each row
    top = int(depth.max())
    for d in range(top + 1):
        if (depth[(depth >= lo) & (depth <= d)]).size >= MIN_NODES or d == top:
            groups.append([lo, d])
            lo = d + 1
    if len(groups) > 1 and ((depth >= groups[-1][0]) & (depth <= top)).sum() < MIN_NODES:
        last = groups.pop()              # too few at the deepest levels: join the row above
        groups[-1][1] = last[1]
    all_conf = confidence_bucket(lp[:, 0])
    B = len(CONF_EDGES) + 1
    for lo, hi in groups:
        sel = (depth >= lo) & (depth <= hi)
        c, k = children[sel], rank[sel]
        chosen, at_risk, p, alive = _km(c, k, K)
        conf = confidence_bucket(lp[sel, 0])
        by_conf = []
        for b in range(B):
            m = conf == b
            if m.sum() >= MIN_NODES:
                by_conf.append(_bucket_row(c[m], k[m], K))
            else:                        # too few here: the bucket's nodes at every depth
                m = all_conf == b
                by_conf.append(dict(_bucket_row(children[m], rank[m], K), all_depths=True)
                               if m.sum() >= MIN_NODES else None)
        draft_lp = []
        for j in range(3):
            col = lp[sel, j]
            col = col[np.isfinite(col)]
            draft_lp.append(round(float(col.mean()), 4) if len(col) else None)
        incoming = confidence_bucket(lp[sel, 3])
        rows.append({"depth": lo, "nodes": int(sel.sum()), "chosen": chosen, "none": int((k == 0).sum()),
                     "at_risk": at_risk, "p": [round(x, 6) for x in p], "p_none": round(max(0.0, alive), 6),
                     "draft_lp": draft_lp, "draft_lp_samples": lp_samples(lp[sel, :3]),
                     "draft_lp_samples_by_own": [lp_samples(lp[sel, :3][incoming == b]) if (incoming == b).sum() >= MIN_NODES
                                                 else [] for b in range(B)],
                     "by_confidence": by_conf})
    return rows


def _bucket_row(c: np.ndarray, k: np.ndarray, K: int) -> dict:
    """A `by_confidence` entry: the hazard estimate (_km) of the nodes of one confidence bucket."""
    _chosen, _at_risk, p, alive = _km(c, k, K)
    return {"nodes": int(len(c)), "p": [round(x, 6) for x in p], "p_none": round(max(0.0, alive), 6)}


def _km(c: np.ndarray, k: np.ndarray, K: int):
    """(chosen, at_risk, p, p_none) of decision nodes with c children and draft rank k (0: none):
    the hazard estimate of the module doc."""
    chosen = [int((k == r).sum()) for r in range(1, K + 1)]
    at_risk = [int(((c >= r) & ((k == 0) | (k >= r))).sum()) for r in range(1, K + 1)]
    p, alive = [], 1.0
    for r in range(K):
        h = chosen[r] / at_risk[r] if at_risk[r] else 0.0
        p.append(alive * h)
        alive *= 1.0 - h
    return chosen, at_risk, p, alive


def conf_edges(model: dict) -> tuple[float, ...]:
    """The confidence bucket edges (log-probabilities) `model`'s rows were estimated with."""
    return tuple(model.get("conf_edges") or LEGACY_EDGES)


def confidence_bucket(lp1, edges=CONF_EDGES) -> np.ndarray:
    """int64[...] bucket (0 .. len(edges): the number of `edges` at or below it) of the draft's
    log-probability of a node's likeliest child; NaN (unknown) gives -1."""
    lp1 = np.asarray(lp1, dtype=np.float64)
    b = np.searchsorted(np.asarray(edges), np.nan_to_num(lp1, nan=-np.inf), side="right")
    return np.where(np.isfinite(lp1), b, -1)


def lp_samples(lp: np.ndarray, n: int = LP_SAMPLES) -> list[list[float]]:
    """Up to n rows of lp float64[N, 3] (the draft's log-probabilities of a node's first three
    children), evenly spaced over the rows sorted by the first: the spread of the real draft's
    confidence at a depth, which a replay draws from. A child the verified tree did not hold
    (NaN) gets half the probability the ones before it left: log((1 - sum p) / 2)."""
    if len(lp) == 0:
        return []
    rows = lp[np.argsort(np.nan_to_num(lp[:, 0], nan=-np.inf))]
    take = rows[np.unique(np.linspace(0, len(rows) - 1, min(n, len(rows))).round().astype(int))]
    out = []
    for row in take:
        vals, mass = [], 1.0
        for x in row:
            x = float(x) if np.isfinite(x) else math.log(max(mass / 2, 1e-9))
            x = min(x, math.log(max(mass, 1e-9)), vals[-1] if vals else 0.0)
            vals.append(round(x, 4))
            mass = max(0.0, mass - math.exp(x))
        out.append(vals)
    return out


def from_trace(trace, requests=None) -> dict:
    """The acceptance model of a trace read by trace.read.read_trace (of `requests`, default all).
    Raises UserError when the trace holds no verified trees with recorded verdicts."""
    depth, children, rank, lp = _rows(trace, requests)
    topk = int(trace.config.get("tree_topk") or 0) or None
    rows = estimate(depth, children, rank, topk, lp)
    if not rows:
        raise UserError(f"{trace.path}: no verified trees with per-node verdicts (an `ar` run, or a trace "
                        "written before they were recorded); record one with --mode sync or async")
    cfg = trace.config
    replayed = cfg.get("accept_from")
    source = {"kind": "trace", "path": os.path.abspath(trace.path), "sha256": file_sha256(trace.path),
              "mode": trace.mode, "target": cfg.get("target"), "draft": cfg.get("draft"),
              "draft_layers": cfg.get("draft_layers"), "load_format": cfg.get("load_format"),
              "verify_size": cfg.get("verify_size"), "tree_width": cfg.get("tree_width"),
              "requests": len(trace.requests if requests is None else requests),
              "nodes": int((children > 0).sum())}
    if replayed:
        source["replayed_from"] = replayed
    return {"format": FORMAT, "version": VERSION, "source": source,
            "mean_accepted": round(mean_accepted(trace, requests), 4),
            "topk": len(rows[0]["p"]), "conf_edges": [round(e, 6) for e in CONF_EDGES], "depths": rows}


def chain_model(mean_tokens: float, tree_nodes: int, topk: int = 8, depths: int = 16,
                source: dict | None = None) -> dict:
    """A model from a reported mean accepted length alone: the target takes the draft's first
    choice with the same probability a at every depth and never a lower-ranked one, a chosen so
    that a chain of `tree_nodes` nodes (root + tree_nodes - 1 draft tokens) commits
    `mean_tokens` a step on average: sum_{i < tree_nodes} a^i = mean_tokens."""
    if not 1.0 <= mean_tokens < tree_nodes:
        raise UserError(f"a mean of {mean_tokens} tokens a step needs a tree of more than {mean_tokens} nodes")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(tree_nodes)) < mean_tokens else (lo, a)
    a = round((lo + hi) / 2, 6)
    rows = [{"depth": d, "nodes": 0, "chosen": [0] * topk, "none": 0, "at_risk": [0] * topk,
             "p": [a] + [0.0] * (topk - 1), "p_none": round(1 - a, 6)} for d in range(depths)]
    return {"format": FORMAT, "version": VERSION, "source": dict(source or {}, kind="reported",
                                                                 assumption="first choice only, same rate at every depth",
                                                                 tree_nodes=tree_nodes, first_choice_rate=a),
            "mean_accepted": mean_tokens, "topk": topk, "depths": rows}


def write_model(model: dict, path: str) -> None:
    """The model as JSON, one line per top-level field and per depth row (atomically)."""
    head = {k: v for k, v in model.items() if k != "depths"}
    lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    rows = ",\n".join(f"  {json.dumps(r, separators=(',', ':'))}" for r in model["depths"])
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write("{\n" + "\n".join(lines) + '\n "depths": [\n' + rows + "\n ]\n}\n")
    os.replace(tmp, path)


def check_model(model, where: str) -> dict:
    """`model` (parsed JSON) validated: UserError naming `where` and the problem, else the model."""
    if not isinstance(model, dict) or model.get("format") != FORMAT:
        raise UserError(f"{where} is not an acceptance model (format '{FORMAT}'); write one with "
                        "`swiftspec analyze TRACE --acceptance-out FILE`")
    rows = model.get("depths")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{where}: the acceptance model has no depths")
    for row in rows:
        p = row.get("p") if isinstance(row, dict) else None
        if not isinstance(p, list) or not p or not all(isinstance(x, (int, float)) and 0 <= x <= 1 for x in p) \
                or sum(p) > 1 + 1e-6:
            raise UserError(f"{where}: depth {row.get('depth') if isinstance(row, dict) else '?'} of the "
                            "acceptance model needs 'p', probabilities in [0, 1] summing to at most 1")
    return model


def load(path: str) -> tuple[dict, str]:
    """-> (model, sha256 of the file) from a model file (JSON) or a trace (HDF5: estimated from
    its verdicts). UserError when it is neither or holds no acceptance."""
    if not os.path.isfile(path):
        raise UserError(f"--accept-from {path}: no such file (a trace .h5 or a model .json)")
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x89HDF"):
        from swiftspec_mpi.trace.read import read_trace
        return from_trace(read_trace(path)), file_sha256(path)
    try:
        with open(path) as f:
            model = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"--accept-from {path}: neither an HDF5 trace nor JSON ({exc})") from None
    return check_model(model, path), file_sha256(path)


def probs(model: dict, by_confidence: bool = False) -> np.ndarray:
    """float64[D, K + 1]: per depth (row D-1 serves deeper ones) the probability that the target's
    token is the draft's rank-1..K child (columns 0..K-1) or none of them (column K).
    by_confidence: float64[D, B + 1, K + 1], [:, b] the rows of confidence bucket b
    (confidence_bucket with the model's conf_edges; the bucket's row over all depths where its
    depth had too few of its nodes, the depth's own row where all depths had), [:, B] the
    depth's own row (for an unknown confidence)."""
    rows = sorted(model["depths"], key=lambda r: r["depth"])
    K = max(len(r["p"]) for r in rows)
    D = int(rows[-1]["depth"]) + 1
    B = len(conf_edges(model)) + 1
    out = np.zeros((D, B + 1, K + 1))

    def fill(dst, p):
        p = list(p) + [0.0] * (K - len(p))
        dst[:K] = p
        dst[K] = max(0.0, 1.0 - sum(p))

    for d in range(D):
        row = max((r for r in rows if r["depth"] <= d), key=lambda r: r["depth"], default=rows[0])
        fill(out[d, B], row["p"])
        conf = row.get("by_confidence") or [None] * B
        for b in range(B):
            fill(out[d, b], conf[b]["p"] if b < len(conf) and conf[b] else row["p"])
    return out if by_confidence else out[:, B]


def _lp_table(samples, k: int) -> np.ndarray:
    """float64[S, k] from sample rows of up to 3 log-probabilities: ranks past them go on with
    the ratio of the last two (geometrically), but never past the mass the ones before left."""
    table = np.zeros((len(samples), k))
    for i, lp in enumerate(samples):
        lp = [float(x) for x in lp][:k] or [-1.0]
        mass = max(1e-9, 1.0 - sum(math.exp(x) for x in lp))
        while len(lp) < k:
            step = min(lp[-1] - lp[-2], -1e-3) if len(lp) >= 2 else -1.0
            lp.append(min(lp[-1] + step, math.log(max(mass, 1e-9))))
            mass = max(1e-9, mass - math.exp(lp[-1]))
        table[i] = lp
    return table


def draft_logprobs(model: dict, k: int) -> list[np.ndarray] | None:
    """B + 1 tables float64[S, k] (every depth draws from them): the real
    draft's log-probabilities of its top-k children at S nodes (`draft_lp_samples`: ranks 1-3,
    then on geometrically within the mass left: _lp_table), [b] those of nodes whose own
    log-probability (their parent's for them) fell in confidence bucket b (the whole's where no
    depth had enough such nodes), [B] the whole's. Pooled over the depths, each depth's samples
    weighted by its nodes (_pooled): a row's depth is the depth its node had when its tree was
    verified, while a replayed draft draws when it expands the node, which in `sync` with several
    expansions a step or in `async` lies deeper under the root of that time (the tree is re-rooted
    on the accepted tokens in between). Indexed by depth, the samples of the surer deep nodes
    served shallower nodes at their expansion: a replay's trees grew deeper and surer than the
    recorded ones (+3 to +6 % tokens a step at 3 expansions a step), and replaying a replay drifted
    on. The parent's confidence carries what depth told of a sure path. A replayed draft draws
    from them. None when the model has none (a model built from a reported figure)."""
    rows = sorted(model["depths"], key=lambda r: r["depth"])
    B = len(conf_edges(model)) + 1
    if not all(r.get("draft_lp_samples") for r in rows):
        return None
    whole = _lp_table(_pooled([(r["draft_lp_samples"], r["nodes"]) for r in rows]), k)
    own = []
    for b in range(B):
        parts = [((r.get("draft_lp_samples_by_own") or [[]] * B)[b], r["nodes"]) for r in rows]
        pooled = _pooled([(x, n) for x, n in parts if x])
        own.append(_lp_table(pooled, k) if pooled else whole)
    return own + [whole]


def _pooled(parts: list[tuple[list, int]], n: int = 4 * LP_SAMPLES) -> list:
    """Up to n sample rows from (rows sorted by their first value, weight) parts: each part gives
    a share of n proportional to its weight, evenly spaced over its rows (lp_samples' quantiles)."""
    total = sum(w for rows, w in parts if rows)
    out = []
    for rows, w in parts:
        if not rows or w <= 0:
            continue
        m = max(1, int(round(n * w / total)))
        idx = np.linspace(0, len(rows) - 1, m).round().astype(int)
        out += [rows[i] for i in idx]
    return out


def expected_tokens(table: np.ndarray, parents: np.ndarray) -> float:
    """Expected tokens a step commits verifying a tree (parents int32[n], best-first so siblings
    are in draft rank order) when the target chooses by `table` (probs): 1 (the bonus) + the sum
    over non-root nodes of the probability that their whole root path is accepted."""
    n = len(parents)
    depth = np.zeros(n, dtype=np.int64)
    reach = np.ones(n)
    seen = {}
    for i in range(1, n):
        p = int(parents[i])
        r = seen.get(p, 0)
        seen[p] = r + 1
        depth[i] = depth[p] + 1
        row = table[min(depth[p], len(table) - 1)]
        reach[i] = reach[p] * (row[r] if r < len(row) - 1 else 0.0)
    return 1.0 + float(reach[1:].sum())


def model_mean_tokens(model: dict, tree_nodes: int) -> float:
    """Expected tokens a step of the best `tree_nodes`-node tree under the model (the nodes with
    the highest path probability, which a draft calibrated to the model picks)."""
    table = probs(model)
    K = table.shape[1] - 1
    # best-first growth; a candidate is (-its path probability, its parent's depth d, its rank
    # index r among the parent's children, the parent's path probability)
    import heapq
    total, taken = 0.0, 0
    frontier = [(-table[0, 0], 0, 0, 1.0)] if K else []
    heapq.heapify(frontier)
    while taken < tree_nodes - 1 and frontier:
        neg, d, r, parent_p = heapq.heappop(frontier)
        p = -neg
        if p <= 0:
            break
        total += p
        taken += 1
        row_next = table[min(d + 1, len(table) - 1)]
        heapq.heappush(frontier, (-p * row_next[0], d + 1, 0, p))          # its first child
        row = table[min(d, len(table) - 1)]
        if r + 1 < K:
            heapq.heappush(frontier, (-parent_p * row[r + 1], d, r + 1, parent_p))   # its next sibling
    return 1.0 + total


def describe_source(model: dict) -> str:
    s = model.get("source", {})
    if s.get("kind") == "trace":
        pair = f"{s.get('draft') or 'default draft'} -> {s.get('target') or 'default target'}"
        return f"{s.get('mode')} trace {os.path.basename(str(s.get('path')))} ({pair}, {s.get('nodes')} nodes)"
    return str(s.get("what") or s.get("kind") or "?")


def format_table(model: dict, head: str | None = None) -> list[str]:
    """The model as text lines: per depth the decision nodes, then the share of each rank."""
    K = model["topk"]
    shown = min(K, 4)
    lines = [head or f"acceptance model: {describe_source(model)}"]
    lines.append(f"mean tokens a step (trace): {model.get('mean_accepted')}; "
                 + ", ".join(f"best {n}-node tree: {model_mean_tokens(model, n):.2f}" for n in (4, 8, 16)))
    cols = " ".join(f"{_ordinal(r):>6}" for r in range(1, shown + 1))
    lines.append(f"{'depth':>5} {'nodes':>6} {cols} {'lower':>6} {'none':>6}")
    for row in model["depths"]:
        p = row["p"]
        rest = sum(p[shown:])
        lines.append(f"{row['depth']:>5} {row['nodes']:>6} "
                     + " ".join(f"{100 * x:5.1f}%" for x in p[:shown])
                     + f" {100 * rest:5.1f}% {100 * row['p_none']:5.1f}%")
    lines.append("(share of decision nodes at that depth where the target's token was the draft's "
                 "r-th child; 'lower' = ranks past 4th; estimated past the children the trees held)")
    return lines


def _ordinal(r: int) -> str:
    return f"{r}{'st' if r == 1 else 'nd' if r == 2 else 'rd' if r == 3 else 'th'}"


def spread(a: dict, b: dict, depths: int = 4) -> float:
    """The largest absolute difference of p (rank 1..3 and none) over the first `depths` depths
    that both models (e.g. of the two halves of a trace) estimated from their own nodes (not
    pooled with deeper ones): how stable the estimate is."""
    ta, tb = probs(a), probs(b)
    own = {r["depth"] for r in a["depths"]} & {r["depth"] for r in b["depths"]}
    out = 0.0
    for d in sorted(own)[:depths]:
        for c in (0, 1, 2, ta.shape[1] - 1):
            if c < ta.shape[1] and c < tb.shape[1]:
                out = max(out, abs(ta[d, c] - tb[d, c]))
    return out if math.isfinite(out) else float("nan")
