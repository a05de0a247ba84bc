"""`swiftspec analyze` and the trace reader on synthetic files (tests/synthetic_trace.py).

Expected numbers are recomputed here from the raw arrays that make_run returns, with plain
numpy, never through swiftspec_mpi.trace.analyze's helpers."""
from __future__ import annotations

import argparse
import json
import os
import sys

import h5py
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import synthetic_trace as st  # noqa: E402

from swiftspec_mpi.trace import analyze, plots  # noqa: E402
from swiftspec_mpi.core.errors import UserError  # noqa: E402
from swiftspec_mpi.trace.read import read_trace  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_analyze(argv, capsys):
    parser = argparse.ArgumentParser()
    analyze.add_arguments(parser)
    rc = analyze.main(parser.parse_args([str(a) for a in argv]))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def async_run():
    return st.make_run("async", n_requests=3, steps=25, seed=0)


@pytest.fixture()
def async_file(tmp_path, async_run):
    path = tmp_path / "async.h5"
    st.write(path, async_run)
    return path


def _leader_durations(run, role, kind):
    ev = run["events"]
    leader = min(int(r) for r, ro, gr in zip(run["ranks"]["rank"], run["ranks"]["role"],
                                             run["ranks"]["group_rank"]) if ro == role and gr == 0)
    m = (ev["rank"] == leader) & (ev["kind"] == st.K[kind])
    return ev["t_end"][m] - ev["t_start"][m], leader


def test_json_values_recomputed(async_file, async_run, capsys):
    rc, out, _ = run_analyze([async_file, "--json"], capsys)
    assert rc == 0
    s = json.loads(out)
    reqs = async_run["requests"]
    new = sum(r["new_tokens"] for r in reqs)
    sec = sum(r["seconds"] for r in reqs)
    assert s["mode"] == "async" and s["complete"] is True
    assert s["new_tokens"] == new
    assert s["tokens_per_s"] == pytest.approx(new / sec)
    acc = np.concatenate([r["steps"]["accepted"] for r in reqs])
    assert s["verify_steps"] == len(acc) == 75
    assert s["mean_accepted_length"] == pytest.approx(acc.mean())
    # acceptance by depth: fraction of steps with >= d accepted draft tokens (accepted - 1)
    max_d = acc.max() - 1
    assert len(s["acceptance_by_depth"]) == max_d
    for d in range(1, max_d + 1):
        assert s["acceptance_by_depth"][d - 1] == pytest.approx(np.sum(acc - 1 >= d) / len(acc))
    hist = {str(v): int(np.sum(acc == v)) for v in np.unique(acc)}
    assert s["accepted_hist"] == hist
    ttft = np.array([r["ttft_s"] for r in reqs])
    assert s["ttft_s"]["mean"] == pytest.approx(ttft.mean())
    # per-role event times of the group leader
    ev = async_run["events"]
    wall = ev["t_end"].max() - ev["t_start"].min()
    assert s["wall_s"] == pytest.approx(wall)
    d, leader = _leader_durations(async_run, 0, "verify")
    v = s["roles"]["verify"]
    assert v["leader_rank"] == leader == 0
    assert v["kinds"]["verify"]["count"] == len(d) == 75
    assert v["kinds"]["verify"]["mean_ms"] == pytest.approx(d.mean() * 1e3)
    srt = np.sort(d)
    assert v["kinds"]["verify"]["p50_ms"] == pytest.approx(np.median(d) * 1e3)
    # p95 by linear interpolation between order statistics
    pos = 0.95 * (len(srt) - 1)
    lo = int(np.floor(pos))
    p95 = srt[lo] + (srt[min(lo + 1, len(srt) - 1)] - srt[lo]) * (pos - lo)
    assert v["kinds"]["verify"]["p95_ms"] == pytest.approx(p95 * 1e3)
    de, dleader = _leader_durations(async_run, 1, "expand")
    assert s["roles"]["draft"]["leader_rank"] == dleader == 2
    assert s["roles"]["draft"]["kinds"]["expand"]["mean_ms"] == pytest.approx(de.mean() * 1e3)
    for role in (0, 1):
        dw, lead = _leader_durations(async_run, role, "wait")
        name = {0: "verify", 1: "draft"}[role]
        assert s["roles"][name]["idle_fraction"] == pytest.approx(dw.sum() / wall)
        assert s["roles"][name]["comm_s"] == pytest.approx(ev["comm_s"][ev["rank"] == lead].sum())
        assert s["roles"][name]["ranks"] == ([0, 1] if role == 0 else [2, 3])
    # per rank
    per_rank = {p["rank"]: p for p in s["per_rank"]}
    for rank in (0, 1, 2, 3):
        m = (ev["rank"] == rank) & (ev["kind"] == st.K["wait"])
        assert per_rank[rank]["wait_s"] == pytest.approx((ev["t_end"][m] - ev["t_start"][m]).sum())
    # per category
    for cat in ("writing", "coding"):
        rs = [r for r in reqs if r["category"] == cat]
        c = s["categories"][cat]
        assert c["n_requests"] == len(rs)
        assert c["tokens_per_s"] == pytest.approx(sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs))
        a = np.concatenate([r["steps"]["accepted"] for r in rs])
        assert c["mean_accepted_length"] == pytest.approx(a.mean())
    # the request records the brief promises
    assert len(s["requests"]) == 3
    for got, want in zip(s["requests"], reqs):
        for key in ("prompt_ids", "output_ids"):
            assert got[key] == want[key].tolist()
        assert got["text"] == want["text"]
        assert got["new_tokens"] == want["new_tokens"]
        assert got["seconds"] == pytest.approx(want["seconds"])
        assert got["tokens_per_s"] == pytest.approx(want["tokens_per_s"])
    assert s["warnings"] == []
    assert s["late_graph_captures"] == 0      # a file older than the field: read as 0, no warning


def test_table_shows_the_numbers(async_file, async_run, capsys):
    rc, out, err = run_analyze([async_file], capsys)
    assert rc == 0
    reqs = async_run["requests"]
    tps = sum(r["new_tokens"] for r in reqs) / sum(r["seconds"] for r in reqs)
    acc = np.concatenate([r["steps"]["accepted"] for r in reqs])
    lines = out.splitlines()
    row = lambda label: next(ln for ln in lines if ln.startswith(label))  # noqa: E731
    assert row("tokens/s ").split()[-1] == f"{tps:.2f}"
    assert row("mean accepted length").split()[-1] == f"{acc.mean():.3f}"
    assert row("  d = 1").split()[-1] == f"{100 * np.mean(acc >= 2):.1f}%"
    d, _ = _leader_durations(async_run, 0, "verify")
    assert f"{d.mean() * 1e3:.2f} / " in row("  verify: verify")
    assert "writing" in out and "coding" in out and "idle (wait) draft" in out
    assert row("GPU shared by").split()[-1] in ("-", "cpu", "no")    # synthetic / CPU traces
    assert err == ""


def test_side_by_side_and_json_list(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ar = st.make_run("ar", n_requests=2, steps=10, seed=5)
    asy = st.make_run("async", n_requests=2, steps=10, seed=6)
    st.write(tmp_path / "a" / "run.h5", ar)
    st.write(tmp_path / "b" / "run.h5", asy)
    rc, out, _ = run_analyze([tmp_path / "a" / "run.h5", tmp_path / "b" / "run.h5"], capsys)
    assert rc == 0
    header = out.splitlines()[0].split()
    assert header == ["run", "run-2"]
    mode_row = next(ln for ln in out.splitlines() if ln.startswith("mode"))
    assert mode_row.split()[1:] == ["ar", "async"]
    rc, out, _ = run_analyze([tmp_path / "a" / "run.h5", tmp_path / "b" / "run.h5", "--json"], capsys)
    data = json.loads(out)
    assert isinstance(data, list) and [d["mode"] for d in data] == ["ar", "async"]
    assert data[0]["mean_accepted_length"] == 1.0
    assert data[0]["acceptance_by_depth"] == []
    assert data[0]["verify_steps"] == 20
    ev = ar["events"]
    d = ev["t_end"][(ev["rank"] == 0) & (ev["kind"] == st.K["decode"])] - \
        ev["t_start"][(ev["rank"] == 0) & (ev["kind"] == st.K["decode"])]
    assert data[0]["roles"]["verify"]["kinds"]["decode"]["mean_ms"] == pytest.approx(d.mean() * 1e3)
    assert "draft" not in data[0]["roles"]


def test_partial_file(tmp_path, capsys):
    run = st.make_run("async", n_requests=3, steps=12, seed=2)
    run["complete"], run["exit_status"] = False, "error: rank 2 died"
    path = tmp_path / "partial.h5"
    st.write(path, run, omit={"events", "ranks", "steps:1", "reqattr:0:seconds", "reqattr:2:tokens_per_s",
                              "output_ids:2", "attr:created"})
    rc, out, err = run_analyze([path, "--json"], capsys)
    assert rc == 0
    s = json.loads(out)
    assert s["complete"] is False and s["exit_status"] == "error: rank 2 died"
    reqs = run["requests"]
    # request 0 has no seconds: only requests 1 and 2 are timed
    assert s["tokens_per_s"] == pytest.approx((reqs[1]["new_tokens"] + reqs[2]["new_tokens"])
                                              / (reqs[1]["seconds"] + reqs[2]["seconds"]))
    acc = np.concatenate([reqs[0]["steps"]["accepted"], reqs[2]["steps"]["accepted"]])
    assert s["verify_steps"] == len(acc)
    assert s["mean_accepted_length"] == pytest.approx(acc.mean())
    assert s["requests"][1]["verify_steps"] is None
    assert s["requests"][2]["output_ids"] == []
    assert s["requests"][2]["tokens_per_s"] == pytest.approx(reqs[2]["new_tokens"] / reqs[2]["seconds"])
    assert s["roles"] == {} and s["wall_s"] is None
    assert "dataset 'steps' missing" in err and "incomplete" in err
    # the table, plots and Perfetto export work on it too
    rc, out, err = run_analyze([path, "--plot", tmp_path / "figs", "--perfetto", tmp_path / "p.json"], capsys)
    assert rc == 0 and "NO (error: rank 2 died)" in out
    assert (tmp_path / "figs" / "partial_timeline.png").read_bytes()[:8] == PNG_MAGIC
    trace = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    steps = [e for e in trace if e["ph"] == "X"]
    assert len(steps) == len(reqs[0]["steps"]) + len(reqs[2]["steps"])


def test_nearly_empty_trace(tmp_path, capsys):
    """A job that died before its first request finished: root attributes only."""
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "swiftspec-trace"
        f.attrs["mode"] = "async"
        f.attrs["complete"] = False
        f.attrs["exit_status"] = "interrupted"
        f.create_group("requests")
    rc, out, err = run_analyze([path, "--json", "--plot", tmp_path / "figs", "--perfetto", tmp_path / "p.json"],
                               capsys)
    assert rc == 0
    s = json.loads(out)
    assert s["n_requests"] == 0 and s["tokens_per_s"] is None and s["requests"] == []
    assert (tmp_path / "figs" / "empty_timeline.png").stat().st_size > 1000
    assert json.loads((tmp_path / "p.json").read_text())["traceEvents"] == []


def test_plots_are_pngs(async_file, tmp_path, capsys):
    figs = tmp_path / "figs"
    rc, _, _ = run_analyze([async_file, "--plot", figs, "--window", "0.1:0.2"], capsys)
    assert rc == 0
    for name in ("async_timeline.png", "async_accepted_hist.png", "tokens_per_s.png"):
        data = (figs / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
    # default window and a file without events (timeline from the steps)
    run = st.make_run("sync", n_requests=1, steps=5, seed=9)
    st.write(tmp_path / "noev.h5", run, omit={"events"})
    rc, _, _ = run_analyze([async_file, tmp_path / "noev.h5", "--plot", figs], capsys)
    assert rc == 0
    assert (figs / "noev_timeline.png").read_bytes()[:8] == PNG_MAGIC


def test_default_window(async_run, async_file):
    t = read_trace(str(async_file))
    start, end = plots.default_window(t)
    ev = async_run["events"]
    m0 = ev["request"] == 0
    assert start == pytest.approx(ev["t_start"][m0].min())
    v = np.sort(ev["t_end"][m0 & (ev["rank"] == 0) & (ev["kind"] == st.K["verify"])])
    assert end == pytest.approx(v[19])


def test_perfetto_export(async_file, async_run, tmp_path, capsys):
    out = tmp_path / "trace.json"
    rc, _, _ = run_analyze([async_file, "--perfetto", out], capsys)
    assert rc == 0
    data = json.loads(out.read_text())
    x = [e for e in data["traceEvents"] if e["ph"] == "X" and e["pid"] < 9999]
    ev = async_run["events"]
    assert len(x) == len(ev)
    i = int(np.flatnonzero(ev["kind"] == st.K["verify"])[3])
    e = next(e for e in x if e["name"] == "verify" and e["pid"] == int(ev["rank"][i])
             and e["args"]["step"] == int(ev["step"][i]) and e["args"]["request"] == int(ev["request"][i]))
    assert e["tid"] == int(ev["role"][i]) == 0
    assert e["ts"] == pytest.approx(ev["t_start"][i] * 1e6)
    assert e["dur"] == pytest.approx((ev["t_end"][i] - ev["t_start"][i]) * 1e6)
    assert e["args"]["n_tokens"] == int(ev["n_tokens"][i])
    assert e["args"]["accepted"] == int(ev["accepted"][i])
    names = {(m["pid"], m["args"]["name"]) for m in data["traceEvents"] if m["ph"] == "M"
             and m["name"] == "thread_name"}
    assert (0, "verify") in names and (2, "draft") in names
    assert {e["name"] for e in x} == {"prefill", "expand", "verify", "reroot", "send", "wait"}


def test_not_a_trace(tmp_path, capsys):
    text = tmp_path / "notes.h5"
    text.write_text("hello")
    with pytest.raises(UserError, match="not a readable HDF5"):
        run_analyze([text], capsys)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f.create_dataset("x", data=np.arange(3))
    with pytest.raises(UserError, match="not a swiftspec trace"):
        run_analyze([other], capsys)
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(UserError, match="format 'something-else'"):
        run_analyze([other], capsys)
    with pytest.raises(UserError, match="does not exist"):
        run_analyze([tmp_path / "missing.h5"], capsys)
    with pytest.raises(UserError, match="START:END"):
        analyze.parse_window("1.0")
    with pytest.raises(UserError, match="ends before"):
        analyze.parse_window("2:1")
    assert analyze.parse_window(":3") == (None, 3.0)


def test_reader_reads_engine_writer(tmp_path):
    """The engine's own writer (swiftspec_mpi.trace.record) and this reader agree on the schema."""
    from swiftspec_mpi.trace import record as trace
    req = trace.RequestResult(index=0, category="qa", prompt_text="hi", prompt_ids=[1, 2, 3],
                              output_ids=[4, 5, 6, 7], text="abcd", t_start=1.0, t_first=1.25, t_end=3.0,
                              stop_reason="eos",
                              steps=[trace.step_row(0, 8, 2, 1.3, 1.5, trace.SOURCE["fresh"], 3, 20, 2, 0.0),
                                     trace.step_row(1, 8, 1, 1.6, 1.9, trace.SOURCE["remnant"], 2, 9, 0)])
    events = np.zeros(2, dtype=trace.EVENT_DTYPE)
    events[0] = (0, 0, 0, 0, trace.KIND["verify"], 1.3, 1.5, 8, 2, 0.01)
    events[1] = (1, 1, 0, 4, trace.KIND["expand"], 1.3, 1.4, 8, 0, 0.0)
    ranks = np.zeros(2, dtype=trace.RANK_DTYPE)
    ranks[0] = (0, 0, 0, 1, b"host", b"cuda:0", 0, 0)
    ranks[1] = (1, 1, 0, 1, b"host", b"cuda:0", 3, 2)
    path = str(tmp_path / "engine.h5")
    graphs = {"captured": 16, "prompt_buckets": 30, "prompt_graphs": 28, "warm_s": 4.196}
    trace.write_trace(path, mode="async", config_json="{\"mode\": \"async\"}",
                      env={"world_size": 2, "graphs": graphs},
                      requests=[req], events=events, ranks=ranks, complete=True, exit_status="ok")
    t = read_trace(path)
    assert t.warnings == [] and t.mode == "async" and t.complete and t.config == {"mode": "async"}
    r = t.requests[0]
    assert (r.category, r.text, r.stop_reason, r.new_tokens) == ("qa", "abcd", "eos", 4)
    assert r.seconds == pytest.approx(2.0) and r.ttft_s == pytest.approx(0.25)
    assert r.prompt_ids.tolist() == [1, 2, 3] and r.steps.accepted.tolist() == [2, 1]
    assert r.steps.tree_source.tolist() == [0, 2] and r.steps.tree_depth.tolist() == [3, 2]
    assert r.steps.tree_nodes.tolist() == [20, 9] and r.steps.drafted.tolist() == [2, 0]
    assert r.steps.fresh_wait_s[0] == 0.0 and np.isnan(r.steps.fresh_wait_s[1])
    assert t.events.kind_name(int(t.events.kind[1])) == "expand"
    assert t.ranks.host == ["host", "host"] and t.ranks.events_dropped.tolist() == [0, 3]
    assert t.ranks.late_graph_captures.tolist() == [0, 2]
    s = analyze.summarize(t)
    assert s["events_dropped"] == 3 and s["mean_accepted_length"] == pytest.approx(1.5)
    assert s["late_graph_captures"] == 2
    rows = analyze.table_rows([s])
    assert ("CUDA graphs captured in requests", ["2"]) in rows
    assert ("GPU warm-up (rank 0)", ["4.2 s: 16 step graphs, 28 prompt graphs / 30 prompt lengths"]) in rows


def test_tree_sources_summarised_and_plotted(tmp_path, capsys):
    """Per-step tree columns: shares per source with their accepted length, depth, nodes,
    drafted expansions and the would-be wait, recomputed here; a file without them has none."""
    run = st.with_tree_columns(st.make_run("async", n_requests=2, steps=30, seed=4), seed=5)
    path = tmp_path / "trees.h5"
    st.write(path, run)
    rc, out, _ = run_analyze([path, "--json"], capsys)
    assert rc == 0
    got = json.loads(out)["tree_sources"]
    steps = np.concatenate([r["steps"] for r in run["requests"]])
    assert got["steps"] == len(steps)
    for code, name in enumerate(("fresh", "rerooted", "remnant")):
        m = steps["tree_source"] == code
        assert got["by_source"][name]["fraction"] == pytest.approx(m.mean())
        assert got["by_source"][name]["mean_accepted_length"] == pytest.approx(steps["accepted"][m].mean())
    assert got["mean_depth"] == pytest.approx(steps["tree_depth"].mean())
    assert got["mean_nodes"] == pytest.approx(steps["tree_nodes"].mean())
    assert got["mean_drafted"] == pytest.approx(steps["drafted"].mean())
    w = steps["fresh_wait_s"]
    assert got["mean_fresh_wait_s"] == pytest.approx(np.nanmean(w))
    assert got["fresh_wait_known"] == pytest.approx(np.isfinite(w).mean())
    rc, table, _ = run_analyze([path], capsys)
    assert "verified trees (per step)" in table and "wait for a fresh tree, ms" in table
    figs = tmp_path / "figs"
    rc, _, _ = run_analyze([path, "--plot", figs], capsys)
    data = (figs / "trees_tree_sources.png").read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    # an older file (no such columns) and ar: no summary, no plot, no warning about them
    old = tmp_path / "old.h5"
    st.write(old, st.make_run("async", n_requests=1, steps=5, seed=6))
    rc, out, err = run_analyze([old, "--json", "--plot", figs], capsys)
    assert json.loads(out)["tree_sources"] is None
    assert not (figs / "old_tree_sources.png").exists()
    assert "missing" not in err
