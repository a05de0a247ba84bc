"""Where a persistent step's time goes: the per-instruction timeline the step kernel records
(`StepKernel.record_timeline`) summed into its stages. Pure numpy (the CPU tests build timelines
by hand).

Every stage of the schedule (embedding; per layer norm + QKV, attention, O, norm + gate|up, down;
norm + the LM head: each instruction normalizes x itself) waits for the whole previous stage, so the
step is the chain  sum over stages of (gap + span):
    gap   from the previous stage's last instruction done to this stage's first one running:
          the counter's signal -> acquire-load -> barrier latency (and any block still busy)
    span  from this stage's first instruction running to its last one done
    busy  the stage's instruction run times summed over blocks / (blocks x span): how much of the
          grid the stage keeps busy while it is the critical path
    GB/s  the stage's weight bytes / span (GEMV stages)

    t = sk.record_timeline(n); <launch the step>; torch.cuda.synchronize()
    rows = summarize(sk.state(n).schedule, t.cpu().numpy(), op_bytes)
    print(format_table(rows))
    print(format_phases(phases(sk.state(n).schedule, t.cpu().numpy())))

Inside an instruction (`phases`, per stage the mean over its instructions, µs): the wait, then
GEMV: stage X (+ RMSNorm) | the pages' MMAs | the epilogue | fence + signal, and how far ahead the
loader began the instruction's pages (run start - loader's first page; negative: it was late) and
how long it took to issue them; ATTN: RoPE + K/V append + q load | the keys' softmax | merge + store
| fence + signal.
"""
from __future__ import annotations

import numpy as np

from swiftspec_mpi.gpu import step_schedule as ss

TL_WORDS = 8     # cuda/step_kernel.cu's enum Timeline: the words of one instruction
TL_WAIT, TL_RUN, TL_DONE, TL_MARK1, TL_MARK2, TL_EPI, TL_LOAD0, TL_LOAD1 = range(TL_WORDS)

_KIND_NAMES = {ss.K_QKV: "norm + qkv", ss.K_O: "o", ss.K_GU: "norm + gate|up", ss.K_DOWN: "down",
               ss.K_HEAD: "norm + lm head"}
STAGE_ORDER = ("embed", "norm + qkv", "attention", "o", "norm + gate|up", "down", "norm + lm head")


def stage_of(s: ss.Schedule, i: int) -> tuple[str, int, int]:
    """Instruction i -> (stage name, layer, op index or -1)."""
    w = s.instr[i]
    if w[0] == ss.EMBED:
        return "embed", 0, -1
    if w[0] == ss.ATTN:
        return "attention", int(w[1]), -1
    kind, layer = s.op_kinds[int(w[1])]
    return _KIND_NAMES[kind], int(layer), int(w[1])


def summarize(s: ss.Schedule, t: np.ndarray, op_bytes: list[int] | None = None) -> dict:
    """t: int64 [n_instr, 3] (wait from, run from, done at) ns of one launch. op_bytes: weight
    bytes per op index (the schedule's op table), or None.
    -> {"total_us", "stages": {name: {"n": layers, "span_us", "gap_us", "busy", "gbs", "share"}}}
    (means over the layers; share = the stage's (gap + span) summed over layers / total)."""
    t = np.asarray(t, dtype=np.int64)
    if t.ndim != 2 or t.shape[0] != len(s.instr) or t.shape[1] < 3 or (t[:, :3] == 0).any():
        raise ValueError("the timeline must hold every instruction of one launch (record_timeline, then one step)")
    per: dict[tuple[int, int, str], dict] = {}       # (order, layer, name)
    for i in range(len(s.instr)):
        name, layer, op = stage_of(s, i)
        order = (layer, STAGE_ORDER.index(name)) if name not in ("embed", "norm + lm head") else \
            ((-1, 0) if name == "embed" else (1 << 30, 0))
        d = per.setdefault((*order, name), {"first": 1 << 62, "last": 0, "busy": 0, "op": op})
        d["first"] = min(d["first"], int(t[i, 1]))
        d["last"] = max(d["last"], int(t[i, 2]))
        d["busy"] += int(t[i, 2] - t[i, 1])
    keys = sorted(per)
    start, end = int(t[:, 0].min()), int(t[:, 2].max())
    prev_done = start
    acc: dict[str, dict] = {}
    for k in keys:
        d, name = per[k], k[2]
        span = max(d["last"] - d["first"], 1)
        gap = max(d["first"] - prev_done, 0)
        prev_done = d["last"]
        a = acc.setdefault(name, {"n": 0, "span": 0, "gap": 0, "busy": 0.0, "bytes": 0})
        a["n"] += 1
        a["span"] += span
        a["gap"] += gap
        a["busy"] += d["busy"] / (s.blocks * span)
        if op_bytes is not None and d["op"] >= 0:
            a["bytes"] += op_bytes[d["op"]]
    total = end - start
    stages = {}
    for name in STAGE_ORDER:
        if name not in acc:
            continue
        a = acc[name]
        stages[name] = {"n": a["n"], "span_us": a["span"] / a["n"] / 1e3, "gap_us": a["gap"] / a["n"] / 1e3,
                        "busy": a["busy"] / a["n"], "share": (a["span"] + a["gap"]) / total,
                        "gbs": a["bytes"] / a["span"] if a["bytes"] else None}
    return {"total_us": total / 1e3, "stages": stages}


def format_table(summary: dict) -> str:
    """The summary as a markdown table (one row a stage, per-layer means)."""
    out = [f"step {summary['total_us']:.1f} us (first wait to last instruction done)", "",
           "| stage | count | span us | gap before us | share of step | grid busy | GB/s in span |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in summary["stages"].items():
        gbs = f"{r['gbs']:.0f}" if r["gbs"] is not None else "-"
        out.append(f"| {name} | {r['n']} | {r['span_us']:.2f} | {r['gap_us']:.2f} | {r['share'] * 100:.1f} % | "
                   f"{r['busy'] * 100:.0f} % | {gbs} |")
    return "\n".join(out)


PHASES = {"gemv": ("wait", "stage x", "mma", "epilogue", "fence + signal"),
          "attention": ("wait", "append + q", "softmax", "merge + store", "fence + signal")}


def phases(s: ss.Schedule, t: np.ndarray) -> dict:
    """t: int64 [n_instr, TL_WORDS] of one launch -> {stage: {"n": instructions, phase: mean us,
    ..., GEMV stages also "loader ahead", "loader issue"}} (module docstring)."""
    t = np.asarray(t, dtype=np.int64)
    if t.shape != (len(s.instr), TL_WORDS):
        raise ValueError(f"phases need the full timeline, int64 [n_instr, {TL_WORDS}]")
    acc: dict[str, dict] = {}
    for i in range(len(s.instr)):
        name, _, op = stage_of(s, i)
        if name == "embed":
            continue
        w = t[i]
        edges = (w[TL_WAIT], w[TL_RUN], w[TL_MARK1], w[TL_MARK2], w[TL_EPI], w[TL_DONE])
        labels = PHASES["attention" if op < 0 else "gemv"]
        d = acc.setdefault(name, {"n": 0, **{k: 0.0 for k in labels}})
        d["n"] += 1
        for k, a, b in zip(labels, edges[:-1], edges[1:]):
            d[k] += (int(b) - int(a)) / 1e3
        if op >= 0:
            d["loader ahead"] = d.get("loader ahead", 0.0) + (int(w[TL_RUN]) - int(w[TL_LOAD0])) / 1e3
            d["loader issue"] = d.get("loader issue", 0.0) + (int(w[TL_LOAD1]) - int(w[TL_LOAD0])) / 1e3
    return {name: {k: (v if k == "n" else v / d["n"]) for k, v in d.items()} for name, d in
            sorted(acc.items(), key=lambda kv: STAGE_ORDER.index(kv[0]))}


def format_phases(ph: dict) -> str:
    """phases() as markdown tables (GEMV stages, then attention), µs per instruction."""
    out = []
    for kind in ("gemv", "attention"):
        rows = [(n, d) for n, d in ph.items() if (n == "attention") == (kind == "attention")]
        if not rows:
            continue
        cols = list(PHASES[kind]) + (["loader ahead", "loader issue"] if kind == "gemv" else [])
        out += ["", "| stage | instructions | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        out += [f"| {n} | {d['n']} | " + " | ".join(f"{d[c]:.2f}" for c in cols) + " |" for n, d in rows]
    return "\n".join(out)
