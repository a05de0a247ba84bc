"""Run one prompt set through our modes and two reference baselines; write a Markdown table.

  swiftspec bench --out-dir runs/bench                      defaults: embedded pair, 13 prompts
  swiftspec bench --target T --draft D --np 4 --draft-ranks 1 --systems ar,async,hf-greedy

Systems: ar, sync, async (our engine: `mpiexec -n NP swiftspec run --mode M ...`, one subprocess
each, log in OUT_DIR/<mode>.log), hf-greedy (HF transformers `generate`) and hf-assisted (HF
assisted generation with the draft as `assistant_model`), in-process. Same models, dtype,
threads, max new tokens and prompts for all; the HF baselines take the prompt token ids from our
first trace that has them, so every system starts from identical ids (else they tokenize with
the engine's tokenizer and the same --chat choice). One HDF5 trace per system in OUT_DIR
(docs/trace-format.md), then OUT_DIR/bench.md and bench.json:
  tokens/s              sum of new tokens / sum of request seconds (prefill start to last token)
  speedup               tokens/s over hf-greedy's
  mean accepted length  tokens committed per verify (decode) step
  exact vs ar           requests whose output_ids equal ar's (greedy: all of them should)
A system that fails is reported in the table with its error and log; the others still run.
Exit code 0 when every system finished, 3 otherwise.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from swiftspec_mpi.checkpoints import registry
from swiftspec_mpi.core.config import SHUTDOWN_S
from swiftspec_mpi.core.errors import EXIT_RUNTIME_ERROR, UserError
from swiftspec_mpi.gpu.sharing import describe as describe_gpu_sharing
from swiftspec_mpi.gpu.sharing import time_sliced
from swiftspec_mpi.trace.analyze import fmt_number

OUR_SYSTEMS = ("ar", "sync", "async")
HF_SYSTEMS = ("hf-greedy", "hf-assisted")
ALL_SYSTEMS = OUR_SYSTEMS + HF_SYSTEMS
SHIPPED_PROMPTS = "spec_bench_13.jsonl"   # package data: the first question of each category


def default_prompts_path() -> str:
    """The prompts shipped in the package (swiftspec_mpi/data/): the first question of each of
    Spec-Bench's 13 categories, in the question set's order (its first turn is the prompt)."""
    return str(Path(__file__).resolve().parent.parent / "data" / SHIPPED_PROMPTS)


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", default=default_prompts_path(), metavar="FILE.jsonl",
                        help="Spec-Bench style JSONL ({\"turns\": [...], \"category\": ...} or {\"prompt\": ...}); "
                             "first turn used (default: the shipped first question of each of Spec-Bench's "
                             "13 categories)")
    parser.add_argument("--per-category", type=int, default=1, metavar="N",
                        help="first N prompts of each category, in file order (default 1: 13 Spec-Bench prompts "
                             "from the shipped file)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="default %(default)s")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank, and for the in-process HF baselines "
                             "(default: engine default per rank; all cores for HF)")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                        help="comma list of %(default)s (run in that canonical order)")
    parser.add_argument("--np", type=int, default=2, help="MPI ranks for each of our modes: ar/sync use them as one tensor-parallel group, "
                             "async splits them into draft + verify (default %(default)s)")
    parser.add_argument("--draft-ranks", type=int, default=None,
                        help="ranks in the draft group for async (default: the engine's)")
    parser.add_argument("--target", default=None, help="target HF folder (default: the embedded pair's)")
    parser.add_argument("--draft", default=None, help="draft HF folder (default: the embedded pair's)")
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the target's chat template")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default; exactness vs ar is only meaningful then)")
    parser.add_argument("--seed", type=int, default=0, help="default %(default)s")
    parser.add_argument("--out-dir", default=None, help="output folder (default runs/bench-<time>)")
    parser.add_argument("--mpiexec", default=None,
                        help="mpiexec to launch our modes (default: the one next to this Python)")
    parser.add_argument("--run-args", default="",
                        help="extra flags for every `swiftspec run`, one string: --run-args=\"--verify-size 16\" (mind the =)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds per system before it is stopped and reported failed (default %(default)s)")


# ---------------------------------------------------------------------------------------------
# prompts

def load_prompts(path: str, per_category: int) -> list[dict]:
    """[{index, question_id, category, text}]: the first `per_category` prompts of each category
    in file order (categories in order of first appearance); first turn of multi-turn entries.
    Parsing and its errors are the engine's own (config.read_prompts_file)."""
    from swiftspec_mpi.core.config import read_prompts_file
    if per_category < 1:
        raise UserError(f"--per-category must be >= 1, got {per_category}")
    picked, seen = [], {}
    for req in read_prompts_file(path):
        if seen.get(req.category, 0) >= per_category:
            continue
        seen[req.category] = seen.get(req.category, 0) + 1
        picked.append({"question_id": req.question_id, "category": req.category, "text": req.prompt})
    order = list(dict.fromkeys(p["category"] for p in picked))
    picked.sort(key=lambda p: order.index(p["category"]))  # stable: file order inside a category
    return [dict(p, index=i) for i, p in enumerate(picked)]


def write_prompts(prompts: list[dict], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"question_id": p["question_id"], "category": p["category"],
                                "prompt": p["text"]}, ensure_ascii=False) + "\n")


def parse_systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in ALL_SYSTEMS]
    if bad or not names:
        raise UserError(f"unknown system(s) {', '.join(bad) or '(none given)'}; choose from {','.join(ALL_SYSTEMS)}")
    return [s for s in ALL_SYSTEMS if s in names]


# ---------------------------------------------------------------------------------------------
# running our modes

def launcher(mpiexec: str | None) -> tuple[str, list[str]]:
    """(mpiexec path, the swiftspec command): next to this Python unless --mpiexec overrides."""
    import shutil

    bindir = Path(sys.executable).parent
    if mpiexec:
        found = shutil.which(mpiexec) or (mpiexec if Path(mpiexec).is_file() else None)
    else:
        cand = bindir / "mpiexec"
        found = str(cand) if cand.is_file() else shutil.which("mpiexec")
    if not found:
        raise UserError(f"mpiexec not found ({mpiexec or bindir / 'mpiexec'}); install mpich in this venv "
                        "(pip install mpich) or pass --mpiexec PATH")
    exe = bindir / "swiftspec"
    cmd = [str(exe)] if exe.is_file() else [sys.executable, "-m", "swiftspec_mpi"]
    return found, cmd


def run_command(mode: str, args, prompts_file: str, out_path: str, mpi: str, swiftspec: list[str]) -> list[str]:
    cmd = [mpi, "-n", str(args.np), *swiftspec, "run", "--target", str(args.target), "--draft", str(args.draft),
           "--mode", mode, "--prompts", prompts_file, "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", str(args.temperature), "--seed", str(args.seed), "--dtype", args.dtype,
           "--out", out_path, "--overwrite", "--quiet"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.chat:
        cmd += ["--chat"]
    if mode == "async" and args.draft_ranks:
        cmd += ["--draft-ranks", str(args.draft_ranks)]
    return cmd + shlex.split(args.run_args or "")


def _count_requests(path: str) -> int | None:
    try:
        import h5py
        with h5py.File(path, "r") as f:
            return len(f["requests"]) if "requests" in f else 0
    except Exception:
        return None


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher's process group (it was started in its own session), then SIGKILL once
    the run had its own shutdown time (it writes its partial trace within SHUTDOWN_S) and 10 s."""
    for sig, wait in ((signal.SIGTERM, SHUTDOWN_S + 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: str, n: int = 3) -> str:
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith("$ ")]
    except OSError:
        return ""
    errs = [ln for ln in lines if "error" in ln.lower()] or lines
    return " | ".join(list(dict.fromkeys(errs))[-n:])[:400]


def run_ours(mode: str, cmd: list[str], out_path: str, log_path: str, timeout: float, bar=None) -> dict:
    """Launch one mode; returns {system, status, error, file, log, wall_s, returncode, command}."""
    res = {"system": mode, "status": "failed", "error": "", "file": out_path, "log": log_path,
           "command": shlex.join(cmd), "returncode": None, "wall_s": 0.0}
    if os.path.exists(out_path):
        os.remove(out_path)
    t0 = time.perf_counter()
    counted = 0
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + res["command"] + "\n")
        log.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as exc:
            res["error"] = f"could not start {cmd[0]}: {exc.strerror}"
            return res
        try:
            last_poll = 0.0
            while proc.poll() is None:
                time.sleep(0.5)
                now = time.perf_counter()
                if now - t0 > timeout:
                    _stop(proc)
                    res["error"] = f"timed out after {timeout:.0f} s (raise --timeout)"
                    break
                if bar is not None and now - last_poll > 3.0 and os.path.exists(out_path):
                    last_poll = now
                    n = _count_requests(out_path)
                    if n is not None and n > counted:
                        bar.update(n - counted)
                        counted = n
        except KeyboardInterrupt:
            _stop(proc)
            res["error"] = "interrupted"
            res["interrupted"] = True
    res["returncode"] = proc.returncode
    res["wall_s"] = time.perf_counter() - t0
    n = _count_requests(out_path) if os.path.exists(out_path) else None
    if bar is not None and n is not None and n > counted:
        bar.update(n - counted)
    res["done"] = n or 0
    if not res["error"] and proc.returncode != 0:
        tail = _tail(log_path)
        res["error"] = f"exit code {proc.returncode}" + (f": {tail}" if tail else " (no output; see the log)")
    if not os.path.exists(out_path):
        res["error"] = res["error"] or "no trace file written"
        return res
    res["status"] = "ok" if not res["error"] else "partial"
    return res


# ---------------------------------------------------------------------------------------------
# table

def exactness(ref: dict | None, other: dict | None) -> dict | None:
    """Compare requests (by index) of two summaries: equal output ids, and prompts that differ."""
    if not ref or not other:
        return None
    ref_by = {r["index"]: r for r in ref["requests"]}
    same = total = prompt_diff = 0
    for r in other["requests"]:
        a = ref_by.get(r["index"])
        if a is None:
            continue
        total += 1
        if list(a["prompt_ids"]) != list(r["prompt_ids"]):
            prompt_diff += 1
        if list(a["output_ids"]) == list(r["output_ids"]):
            same += 1
    return {"equal": same, "compared": total, "fraction": same / total if total else None,
            "prompt_ids_differ": prompt_diff}


def build_markdown(results: list[dict], meta: dict) -> str:
    """results: [{system, status, error, log?, file?, summary (analyze.summarize dict) or None}].
    meta: {n_prompts, and any setup lines to list}. Pure function of its inputs."""
    by = {r["system"]: r for r in results}
    base = (by.get("hf-greedy") or {}).get("summary")
    base_tps = base.get("tokens_per_s") if base else None
    ref = (by.get("ar") or {}).get("summary")
    n = meta.get("n_prompts")
    lines = ["| system | status | requests | tokens/s | speedup vs hf-greedy | mean accepted length | "
             "exact vs ar | TTFT ms |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    notes = []
    for r in results:
        s = r.get("summary")
        status = r["status"] if r["status"] != "partial" else "partial (see note)"
        if not s:
            lines.append(f"| {r['system']} | {status} | - | - | - | - | - | - |")
            notes.append(f"- **{r['system']}** failed: {r.get('error') or 'no result'}"
                         + (f" (log: `{r['log']}`)" if r.get("log") else ""))
            continue
        if r["status"] != "ok":
            notes.append(f"- **{r['system']}** {r['status']}: {r.get('error') or 'incomplete trace'}"
                         + (f" (log: `{r['log']}`)" if r.get("log") else ""))
        sharing = (s.get("env") or {}).get("gpu_sharing")
        if time_sliced(sharing):
            notes.append(f"- **{r['system']}**: {describe_gpu_sharing(sharing)} shared a GPU without a "
                         "CUDA MPS daemon, so its ranks took turns on it; start one (`nvidia-cuda-mps-control "
                         "-d`) before the bench (docs/slurm.md, \"Ranks that share a GPU: MPS\")")
        tps = s.get("tokens_per_s")
        speed = f"{tps / base_tps:.2f}x" if tps and base_tps else "-"
        if r["system"] == "ar":
            exact = "reference"
        else:
            e = exactness(ref, s)
            if e is None or not e["compared"]:
                exact = "-"
            else:
                exact = f"{e['equal']}/{e['compared']} ({100 * e['fraction']:.0f}%)"
                if e["prompt_ids_differ"]:
                    notes.append(f"- **{r['system']}**: {e['prompt_ids_differ']} prompt(s) tokenized "
                                 "differently from ar; their outputs cannot match")
        reqs = f"{s.get('n_requests', 0)}/{n}" if n is not None else str(s.get("n_requests", 0))
        ttft = (s.get("ttft_s") or {}).get("mean")
        lines.append(f"| {r['system']} | {status} | {reqs} | {fmt_number(tps)} | {speed} | "
                     f"{fmt_number(s.get('mean_accepted_length'))} | {exact} | "
                     f"{fmt_number(ttft * 1e3 if ttft is not None else None, 0)} |")
    out = ["# swiftspec bench", ""]
    setup = meta.get("setup") or {}
    if setup:
        out += [f"- {k}: {v}" for k, v in setup.items()] + [""]
    out += lines
    if notes:
        out += ["", "Notes:"] + notes
    cats = []
    for r in results:
        for c in ((r.get("summary") or {}).get("categories") or {}):
            if c not in cats:
                cats.append(c)
    shown = [r for r in results if r.get("summary")]
    if cats and shown:
        out += ["", "Tokens/s per category:", "",
                "| category | " + " | ".join(r["system"] for r in shown) + " |",
                "|---|" + "---:|" * len(shown)]
        for c in cats:
            cells = [fmt_number(((r["summary"].get("categories") or {}).get(c) or {}).get("tokens_per_s"))
                     for r in shown]
            out.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------

def _resolve_models(args) -> None:
    """Fill args.target/args.draft with folders: the embedded pair by default; a registry name
    (e.g. qwen2.5-coder-1.5b) becomes its prepared folder, so the HF baselines can load it too."""
    if bool(args.target) != bool(args.draft):
        raise UserError("give both --target and --draft, or neither (the embedded pair)")
    log = lambda msg: print(f"swiftspec bench: {msg}", file=sys.stderr)  # noqa: E731
    try:
        if not args.target:
            target, draft = registry.default_pair(log=log)
            args.target, args.draft = str(target), str(draft)
        else:
            args.target = registry.resolve_flag(args.target, "--target", log)
            args.draft = registry.resolve_flag(args.draft, "--draft", log)
    except UserError:
        raise
    except Exception as exc:  # fetching/converting the embedded models failed (no network, disk)
        raise UserError(f"could not prepare the models ({type(exc).__name__}: {exc}); pass existing "
                        "--target DIR --draft DIR folders") from None
    for name, path in (("--target", args.target), ("--draft", args.draft)):
        if not os.path.exists(path):
            raise UserError(f"{name} {path} does not exist; pass an existing model folder")


def main(args) -> int:
    from tqdm import tqdm

    from swiftspec_mpi.trace.analyze import summarize
    from swiftspec_mpi.trace.read import read_trace

    # SIGTERM (scancel, Slurm's time limit) stops the benchmark like Ctrl-C: the running system
    # is stopped and the table of what finished is still written
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    systems = parse_systems(args.systems)
    if args.np < 1:
        raise UserError(f"--np must be >= 1, got {args.np}")
    if "async" in systems and args.np < 2:
        raise UserError("async needs --np 2 or more (one draft and one verify rank); raise --np or drop async")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompts:
        raise UserError("--prompts is empty: pass a JSONL file, or leave it out for the shipped Spec-Bench prompts")
    prompts = load_prompts(args.prompts, args.per_category)
    ours = [s for s in systems if s in OUR_SYSTEMS]
    mpi, swiftspec = launcher(args.mpiexec) if ours else (None, None)
    _resolve_models(args)
    out_dir = args.out_dir or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --out-dir {out_dir} ({exc.strerror}); choose a writable path") from None
    prompts_file = os.path.join(out_dir, "prompts.jsonl")
    write_prompts(prompts, prompts_file)

    results: list[dict] = []
    bar = tqdm(total=len(prompts) * len(systems), unit="req", desc="bench", dynamic_ncols=True)
    interrupted = False
    try:
        for mode in ours:
            bar.set_postfix_str(mode)
            out = os.path.join(out_dir, f"{mode}.h5")
            cmd = run_command(mode, args, prompts_file, out, mpi, swiftspec)
            res = run_ours(mode, cmd, out, os.path.join(out_dir, f"{mode}.log"), args.timeout, bar)
            results.append(res)
            bar.update(max(0, len(prompts) - res.get("done", 0)))  # a failed mode: skip its share
            bar.write(f"{mode}: {res['status']} in {res['wall_s']:.1f} s" + (f" ({res['error']})" if res["error"] else ""))
            if res.pop("interrupted", False):
                raise KeyboardInterrupt
        hf = [s for s in systems if s in HF_SYSTEMS]
        if hf:
            from swiftspec_mpi.bench import hf_baselines as hfb
            ids = _prompt_ids_from_traces([r["file"] for r in results if r["status"] != "failed"], read_trace)
            hp = [hfb.Prompt(p["index"], p["text"], p["category"], ids.get(p["index"])) for p in prompts]
            bar.set_postfix_str(",".join(hf))
            for r in hfb.run_systems(hf, target=args.target, draft=args.draft, prompts=hp, out_dir=out_dir,
                                     dtype=args.dtype, threads=args.threads, max_new_tokens=args.max_new_tokens,
                                     temperature=args.temperature, seed=args.seed, chat=args.chat,
                                     progress=bar.update):
                results.append({"system": r.system, "status": r.status, "error": r.error, "file": r.path,
                                "log": None, "wall_s": r.wall_s, "returncode": None,
                                "prompt_ids_from": "trace" if len(ids) == len(prompts) else
                                ("tokenizer" if not ids else "trace+tokenizer")})
                bar.update(max(0, len(prompts) - r.done))
                bar.write(f"{r.system}: {r.status} in {r.wall_s:.1f} s" + (f" ({r.error})" if r.error else ""))
    except KeyboardInterrupt:
        interrupted = True
        bar.write("interrupted: writing the table of what finished")
    finally:
        bar.close()
    done = {r["system"] for r in results}
    for s in systems:
        if s not in done:
            path = os.path.join(out_dir, f"{s}.h5")
            results.append({"system": s, "status": "partial" if os.path.exists(path) else "failed",
                            "error": "interrupted", "file": path if os.path.exists(path) else None})

    for r in results:
        r["summary"] = None
        if r.get("file") and os.path.exists(r["file"]):
            try:
                r["summary"] = summarize(read_trace(r["file"]), r["system"])
            except Exception as exc:  # an unreadable trace is one failed row, not a crash
                r["status"], r["error"] = "failed", f"trace unreadable: {exc}"
            else:
                if r["status"] == "ok" and not r["summary"]["complete"]:
                    r["status"], r["error"] = "partial", f"trace incomplete ({r['summary']['exit_status']})"
    setup = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "target": args.target, "draft": args.draft,
             "dtype": args.dtype, "threads": args.threads or "default", "ranks (our modes)": args.np,
             "draft ranks (async)": args.draft_ranks or "engine default",
             "HF baselines": f"in-process, torch threads {args.threads or 'default (all cores)'}",
             "prompts": f"{len(prompts)} from {args.prompts} ({args.per_category} per category)",
             "max new tokens": args.max_new_tokens, "temperature": args.temperature, "chat": args.chat,
             "host cores": os.cpu_count(), "extra run args": args.run_args or "none", "out dir": out_dir}
    md = build_markdown(results, {"n_prompts": len(prompts), "setup": setup})
    with open(os.path.join(out_dir, "bench.md"), "w", encoding="utf-8") as f:
        f.write(md)
    payload = {"setup": setup, "systems": [
        {k: v for k, v in r.items() if k != "summary"} | {"summary": _brief(r.get("summary"))} for r in results]}
    from swiftspec_mpi.trace.analyze import json_safe
    with open(os.path.join(out_dir, "bench.json"), "w", encoding="utf-8") as f:
        json.dump(json_safe(payload), f, indent=1)
    print(md)
    print(f"traces, logs, bench.md and bench.json in {out_dir}")
    ok = all(r["status"] == "ok" for r in results) and not interrupted
    return 0 if ok else EXIT_RUNTIME_ERROR


def _brief(s: dict | None) -> dict | None:
    if not s:
        return None
    keep = ("mode", "complete", "exit_status", "n_requests", "new_tokens", "seconds", "tokens_per_s",
            "ttft_s", "verify_steps", "mean_accepted_length", "acceptance_by_depth", "categories", "roles")
    return {k: s.get(k) for k in keep}


def _prompt_ids_from_traces(files: list[str], read_trace) -> dict[int, list[int]]:
    """index -> prompt ids from the first of our traces that has them (ar first)."""
    out: dict[int, list[int]] = {}
    for path in files:
        try:
            t = read_trace(path)
        except Exception:
            continue
        for r in t.requests:
            if r.index not in out and len(r.prompt_ids):
                out[r.index] = [int(x) for x in r.prompt_ids]
    return out
