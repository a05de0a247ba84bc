"""Matplotlib figures of a trace: the ranks' timeline over a window, the accepted-length
histogram and tokens/s per request (`swiftspec analyze --plot DIR`)."""
from __future__ import annotations

import math
import os

import numpy as np

from swiftspec_mpi.trace.read import ROLE_NAMES, group_leaders

KIND_COLORS = {"prefill": "#8c564b", "expand": "#2ca02c", "verify": "#1f77b4", "reroot": "#9467bd",
               "send": "#ff7f0e", "wait": "#d9d9d9", "decode": "#17becf"}
DEFAULT_WINDOW_STEPS = 20


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(float(x))


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
        leaders = group_leaders(trace)
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
        leaders = group_leaders(trace)
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
