"""Where the verified trees came from, per verify step: summary and plot (`swiftspec analyze`).

Reads the per-step columns of a request's `steps` table (docs/trace-format.md):
  tree_source    fresh (built by the draft on the previous step's result), rerooted (sent by the
                 draft before it took that result, re-rooted by the verify leader on the tokens
                 committed since), remnant (the rest of the tree verified in the previous step)
  tree_depth     edges from the root to the deepest verified node
  tree_nodes     nodes at hand the verified tree was cut from
  drafted        draft expansions the tree holds that were made while the verify group ran its
                 previous step
  fresh_wait_s   how long the step would have waited for the fresh tree (0 when it had it)
"""
from __future__ import annotations

import numpy as np

SOURCE_NAMES = ("fresh", "rerooted", "remnant")   # trace.record.TREE_SOURCES, by code


def _columns(requests) -> dict | None:
    """The per-step columns of every request with them, concatenated (None: no such steps)."""
    steps = [r.steps for r in requests if r.steps is not None and len(r.steps)]
    steps = [s for s in steps if np.any(s.tree_source >= 0)]
    if not steps:
        return None
    cat = lambda name: np.concatenate([getattr(s, name) for s in steps])  # noqa: E731
    cols = {name: cat(name) for name in ("tree_source", "tree_depth", "tree_nodes", "drafted",
                                         "fresh_wait_s", "accepted")}
    keep = cols["tree_source"] >= 0
    return {k: v[keep] for k, v in cols.items()}


def tree_source_summary(requests) -> dict | None:
    """-> {"steps", "by_source": {name: {"fraction", "mean_accepted_length", "mean_depth"}},
    "mean_depth", "mean_nodes", "mean_drafted", "mean_fresh_wait_s", "fresh_wait_known"},
    or None when no step carries these columns (`ar`, older files)."""
    c = _columns(requests)
    if c is None:
        return None
    n = len(c["tree_source"])
    by = {}
    for code, name in enumerate(SOURCE_NAMES):
        m = c["tree_source"] == code
        by[name] = {"fraction": float(m.mean()),
                    "mean_accepted_length": float(c["accepted"][m].mean()) if m.any() else None,
                    "mean_depth": float(c["tree_depth"][m].mean()) if m.any() else None}
    wait = c["fresh_wait_s"][np.isfinite(c["fresh_wait_s"])]
    return {"steps": n, "by_source": by,
            "mean_depth": float(c["tree_depth"].mean()), "mean_nodes": float(c["tree_nodes"].mean()),
            "mean_drafted": float(c["drafted"].mean()),
            "mean_fresh_wait_s": float(wait.mean()) if len(wait) else None,
            "fresh_wait_known": float(len(wait) / n)}


def table_rows(summaries: list[dict]) -> list[tuple[str, list[str]]]:
    """Rows for analyze's table, one cell per file (empty when no file has the columns)."""
    ts = [s.get("tree_sources") for s in summaries]
    if not any(ts):
        return []
    cell = lambda fn: [fn(t) if t else "-" for t in ts]  # noqa: E731
    rows = [("verified trees (per step)", [""] * len(ts))]
    for name in SOURCE_NAMES:
        rows.append((f"  {name}: share | accepted len",
                     cell(lambda t, n=name: f"{100 * t['by_source'][n]['fraction']:.1f}% | "
                          + ("-" if t["by_source"][n]["mean_accepted_length"] is None
                             else f"{t['by_source'][n]['mean_accepted_length']:.2f}"))))
    rows.append(("  depth | nodes at hand", cell(lambda t: f"{t['mean_depth']:.2f} | {t['mean_nodes']:.1f}")))
    rows.append(("  draft expansions held", cell(lambda t: f"{t['mean_drafted']:.2f}")))
    rows.append(("  wait for a fresh tree, ms", cell(lambda t: "-" if t["mean_fresh_wait_s"] is None
                                                      else f"{1e3 * t['mean_fresh_wait_s']:.1f}")))
    return rows


def plot_tree_sources(trace, path: str, title: str = "") -> bool:
    """Per verify step of every request in order: accepted length, tree depth and draft
    expansions held (lines), the would-be wait for a fresh tree (bars, right axis), and the
    tree's source as a colour band. Returns False when the file has no such steps."""
    c = _columns(trace.requests)
    if c is None:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(c["tree_source"]))
    fig, (ax, band) = plt.subplots(2, 1, figsize=(11, 4.5), sharex=True,
                                   gridspec_kw={"height_ratios": [5, 1]})
    ax.plot(x, c["accepted"], lw=0.8, label="accepted length")
    ax.plot(x, c["tree_depth"], lw=0.8, label="tree depth")
    ax.plot(x, c["drafted"], lw=0.8, label="draft expansions held")
    ax.set_ylabel("per step")
    ax2 = ax.twinx()
    wait = np.where(np.isfinite(c["fresh_wait_s"]), c["fresh_wait_s"], 0.0) * 1e3
    ax2.bar(x, wait, width=1.0, color="#d9d9d9", alpha=0.6, label="wait for fresh tree (ms)")
    ax2.set_ylabel("ms")
    ax.set_zorder(ax2.get_zorder() + 1)
    ax.patch.set_visible(False)
    lines, labels = ax.get_legend_handles_labels()
    l2, lab2 = ax2.get_legend_handles_labels()
    ax.legend(lines + l2, labels + lab2, loc="upper right", fontsize=7)
    colors = np.array([[0.17, 0.63, 0.17], [1.0, 0.5, 0.05], [0.84, 0.15, 0.16]])
    band.imshow(colors[c["tree_source"].astype(int)][None, :, :], aspect="auto",
                extent=(-0.5, len(x) - 0.5, 0, 1))
    band.set_yticks([])
    band.set_xlabel("verify step (requests in order); band: green fresh, orange rerooted, red remnant")
    ax.set_title(title or "verified trees")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
