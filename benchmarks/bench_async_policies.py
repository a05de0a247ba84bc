"""Ablation of the async policies (--async-policy) against serial tree speculation (`sync`).

    python benchmarks/bench_async_policies.py --out-dir runs/async-policies \\
        --dtype float32 --verify-size 4 --n-prompts 26 --max-new-tokens 128

The first N prompts of the file (default benchmarks/prompts_specbench32.jsonl: the 13 Spec-Bench
categories round-robin, so 26 = two of each) are cut into chunks of --chunk prompts. For each
chunk every system runs once (`sync` on 2 ranks as one tensor-parallel group, `async` on 1 + 1
ranks, one job per system and chunk, the system order rotated from chunk to chunk), so a change
in the machine's load falls on all systems alike. A system `async-POLICY:F` runs the policy
with --floor-depth F (e.g. async-rate:3). Pass --run-args "--expansions D" to fix the
draft expansions per step of `sync` (else each job's startup profile picks floor(t_target /
t_draft), which moves with the machine's load); in `async` it also paces the draft to D
expansions a step (without it the draft never pauses on CPUs). Greedy, chat template, the real
Qwen2.5-Coder 0.5B -> 1.5B pair (embedded default). Per system, over every finished chunk:
  tokens/s            sum of new tokens / sum of request seconds (prefill start to last token)
  accepted length     tokens committed per verify step (mean), and its ratio to sync's
  >= 3 drafted        share of verify steps that accepted 3 or more draft tokens
  idle verify/draft   the group leader's wait time / the job's event wall time
  fresh | rerooted | remnant, depth, drafted, fresh wait   where the verified trees came from
                      (trace/tree_sources.py)
  abandoned / step    draft expansions abandoned between layers for a result (engine/abandon.py)
                      per verify step
  exact vs sync       requests whose output equals sync's (greedy: all)
  acc x busy          accepted length x (1 - idle verify): the async policies' tokens per verify
                      step time, a speed figure that does not move with the machine's load
                      (the verify step costs the same under every policy at one tree size)
Each job's trace is OUT_DIR/<system>-cNN.h5; a job whose trace is complete is not run again, so
the script resumes. OUT_DIR/summary.md and summary.json are rewritten after every job.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swiftspec_mpi.trace.analyze import summarize  # noqa: E402
from swiftspec_mpi.trace.read import read_trace  # noqa: E402
from swiftspec_mpi.trace.tree_sources import tree_source_summary  # noqa: E402

SYSTEMS = ("sync", "async-fresh", "async-rate")


def job_command(system: str, prompts: Path, out: Path, args) -> list[str]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    mode, _, policy = system.partition("-")
    n = 2      # sync: one tensor-parallel group of 2 ranks; async: 1 draft + 1 verify rank
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "swiftspec_mpi", "run", "--mode", mode,
           "--prompts", str(prompts), "--chat", "--max-new-tokens", str(args.max_new_tokens),
           "--dtype", args.dtype, "--verify-size", str(args.verify_size), "--out", str(out),
           "--overwrite", "--quiet", "--peer-timeout", "300"]
    policy, _, floor_depth = policy.partition(":")
    if policy:
        cmd += ["--async-policy", policy]
    if floor_depth:
        cmd += ["--floor-depth", floor_depth]
    return cmd + args.run_args.split()


def complete(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        return bool(read_trace(str(path)).complete)
    except Exception:  # noqa: BLE001
        return False


def system_figures(paths: list[Path]) -> dict:
    traces = [read_trace(str(p)) for p in paths]
    reqs = [r for t in traces for r in t.requests]
    tokens = sum(int(r.new_tokens or 0) for r in reqs)
    seconds = sum(float(r.seconds or 0.0) for r in reqs)
    acc = np.concatenate([r.steps.accepted for r in reqs if r.steps is not None and len(r.steps)])
    out = {"requests": len(reqs), "new_tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds if seconds else None,
           "mean_accepted_length": float(acc.mean()), "verify_steps": int(len(acc)),
           "steps_3plus_drafted": float(np.mean(acc - 1 >= 3)),
           "outputs": [r.output_ids.tolist() for r in reqs],
           "expansions_per_verify": sorted({(t.env or {}).get("expansions_per_verify") for t in traces},
                                           key=str)}
    wall, waits, abandoned = 0.0, {}, 0
    for t in traces:
        s = summarize(t)
        wall += s["wall_s"] or 0.0
        for role, info in (s.get("roles") or {}).items():
            waits[role] = waits.get(role, 0.0) + info["wait_s"]
        abandoned += ((s.get("roles") or {}).get("draft", {}).get("kinds", {})
                      .get("abandon", {}).get("count", 0))
    out["idle"] = {role: w / wall for role, w in waits.items()} if wall else {}
    out["abandoned_per_step"] = abandoned / len(acc) if len(acc) else None
    out["tree_sources"] = tree_source_summary(reqs)
    return out


def render(figs: dict, args, chunks_done: dict) -> str:
    sync = figs.get("sync")
    lines = [f"{args.n_prompts} prompts x {args.max_new_tokens} new tokens, {args.dtype}, "
             f"tree size {args.verify_size}, chunks of {args.chunk} (finished chunks per system: "
             + ", ".join(f"{k} {v}" for k, v in chunks_done.items()) + ")", "",
             "| system | requests | tok/s | accepted length | vs sync | >= 3 drafted | idle verify | "
             "idle draft | acc x busy | fresh / rerooted / remnant | depth | drafted | fresh wait ms | "
             "abandoned / step | d | exact vs sync |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, f in figs.items():
        ts = f["tree_sources"]
        src = "-" if ts is None else " / ".join(f"{100 * ts['by_source'][k]['fraction']:.0f}%"
                                                  for k in ("fresh", "rerooted", "remnant"))
        ratio = f["mean_accepted_length"] / sync["mean_accepted_length"] if sync else None
        n_same = "-"
        if sync:
            pairs = list(zip(f["outputs"], sync["outputs"]))
            n_same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        fw = "-" if ts is None or ts["mean_fresh_wait_s"] is None else f"{1e3 * ts['mean_fresh_wait_s']:.0f}"
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        num = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        cells = [name, str(f["requests"]), num(f["tokens_per_s"], ".2f"),
                 num(f["mean_accepted_length"], ".3f"), "-" if ratio is None else f"{ratio:.3f}x",
                 pct(f["steps_3plus_drafted"]), pct(f["idle"].get("verify")), pct(f["idle"].get("draft")),
                 "-" if name == "sync" else num(f["mean_accepted_length"] * (1 - f["idle"].get("verify", 0.0)), ".3f"),
                 src, "-" if ts is None else num(ts["mean_depth"], ".2f"),
                 "-" if ts is None else num(ts["mean_drafted"], ".2f"), fw,
                 "-" if name == "sync" else num(f["abandoned_per_step"], ".3f"),
                 ",".join(str(x) for x in f["expansions_per_verify"]), n_same]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts_specbench32.jsonl"))
    ap.add_argument("--n-prompts", type=int, default=26)
    ap.add_argument("--chunk", type=int, default=2, help="prompts per job (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--verify-size", type=int, default=4)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--run-args", default="", help="extra flags for every `swiftspec run`")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--summary-only", action="store_true",
                    help="run no job: rewrite the summary from the traces already in OUT_DIR")
    args = ap.parse_args()
    systems = args.systems.split(",")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()][:args.n_prompts]
    chunks = [lines[i:i + args.chunk] for i in range(0, len(lines), args.chunk)]
    for c, chunk in enumerate(chunks):
        prompts = out / f"prompts-c{c:02d}.jsonl"
        prompts.write_text("\n".join(chunk) + "\n")
        order = systems[c % len(systems):] + systems[:c % len(systems)]
        for system in order:
            trace = out / f"{system}-c{c:02d}.h5"
            if complete(trace) or args.summary_only:
                continue
            t0 = time.time()
            with open(out / f"{system}-c{c:02d}.log", "w") as log:
                rc = subprocess.run(job_command(system, prompts, trace, args), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=ROOT).returncode
            print(f"chunk {c} {system}: exit {rc}, {time.time() - t0:.0f} s", flush=True)
        done = {s: [out / f"{s}-c{i:02d}.h5" for i in range(len(chunks))] for s in systems}
        # only chunks that every system finished, so all systems cover the same prompts
        common = [i for i in range(len(chunks)) if all(complete(done[s][i]) for s in systems)]
        figs = {s: system_figures([done[s][i] for i in common]) for s in systems} if common else {}
        if figs:
            (out / "summary.md").write_text(render(figs, args, {s: len(common) for s in systems}))
            (out / "summary.json").write_text(json.dumps(
                {s: {k: v for k, v in f.items() if k != "outputs"} for s, f in figs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
