"""4-bit vs bf16 vs llama.cpp on the CPU: greedy decode of the real Qwen2.5-Coder 1.5B Q4_K_M.

    python benchmarks/bench_q4_cpu.py [--threads 2] [--rounds 2] [--max-new-tokens 64]
        [--prompts benchmarks/prompts_cpu2.jsonl] [--no-llama] [--no-e2e] [--json OUT]

Systems, each a fresh worker process per round (so they never share memory or caches), run in
an order rotated every round (load from other jobs on the machine hits all alike):
    q4     our Transformer, packed 4-bit weights (the GGUF's Q4_K / Q6_K blocks as they are)
    bf16   our Transformer, the same GGUF dequantized to bfloat16 panels (--quant none)
    llama  llama.cpp through llama-cpp-python (built from PyPI's sdist by
           benchmarks/build_llama_cpp.sh into .cache/llama_cpp, a peer, not a dependency)
    llama_pld  llama.cpp with prompt-lookup speculative decoding (the speculative decoding its
           Python API offers; a draft model is not exposed there)
Every system gets the same prompt token ids (our tokenizer, the chat template) and greedy
decoding of exactly --max-new-tokens tokens (EOS ignored). Per prompt: prefill seconds and
decode tokens/s (tokens after the first over the time after the first). q4 and bf16 also time
the verify forward of an n-node tree (n = 1, 2, 4, 8) at the end of the prompt.
--kernels instead times one decoder layer's four GEMMs at the 1.5B's shapes (random weights:
4-bit group 32 as Q4_K, bf16 panels) for M = 1, 2, 4, 8, 16 rows, the two kernels alternated,
best of 7 each: the per-layer cost of verifying an M-node tree, without model loading.
End to end (--no-e2e skips): `swiftspec run --mode async` (1 draft + 1 verify rank, one thread
each) on the 0.5B -> 1.5B 4-bit pair, same prompts and token count, tokens/s from its trace.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PY = ROOT / ".cache" / "llama_cpp" / "venv" / "bin" / "python"


def prompt_ids(path: str, target: str) -> list[list[int]]:
    from swiftspec_mpi.checkpoints.load import load_tokenizer
    tok = load_tokenizer(target)
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [tok.encode(tok.apply_chat_template(r["prompt"])) for r in rows]


# ------------------------------------------------------------------------------ our model

def worker_ours(args) -> dict:
    import torch

    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    import resource
    torch.set_num_threads(args.threads)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    quant = "auto" if args.system == "q4" else "none"
    model, _ = load_model(args.target, max_slots=4096, quant=quant,
                          dtype=torch.float32 if quant == "auto" else torch.bfloat16)
    load_s = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res = {"system": args.system, "load_s": load_s, "weight_bytes": model.weight_bytes(),
           "rss_before": rss0, "rss_peak_load": rss1,
           "prompts": [], "verify_ms": {}}
    for ids in json.loads(args.ids):
        n = len(ids)
        t = time.perf_counter()
        lg = model(torch.tensor(ids), torch.arange(n), 0, None, logits_rows=torch.tensor([n - 1]),
                   causal=True)
        tok = int(lg[-1].argmax())
        t_first = time.perf_counter()
        out, pos = [tok], n
        for _ in range(args.max_new_tokens - 1):
            lg = model(torch.tensor([tok]), torch.tensor([pos]), pos, chain_mask(pos, 1))
            tok = int(lg[-1].argmax())
            out.append(tok)
            pos += 1
        t_end = time.perf_counter()
        res["prompts"].append({"prefill_s": t_first - t, "decode_tok_s":
                               (len(out) - 1) / (t_end - t_first), "tokens": out})
        # verify forward of an n-node chain-shaped tree after the generated text
        for nodes in (1, 2, 4, 8):
            times = []
            for _ in range(5):
                toks = torch.tensor(out[:nodes])
                t = time.perf_counter()
                model(toks, torch.arange(pos, pos + nodes), pos, chain_mask(pos, nodes))
                times.append(time.perf_counter() - t)
            res["verify_ms"].setdefault(str(nodes), []).append(1e3 * statistics.median(times))
    return res


# ------------------------------------------------------------------------------ llama.cpp

LLAMA_WORKER = r'''
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.argv[1])
kw = {}
if a["pld"]:
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=a["pld"])
t0 = time.perf_counter()
llm = Llama(model_path=a["target"], n_ctx=4096, n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False, seed=0, **kw)
res = {"load_s": time.perf_counter() - t0, "prompts": []}
for ids in a["ids"]:
    out = []
    t = time.perf_counter()
    t_first = None
    for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                            reset=True):
        if t_first is None:
            t_first = time.perf_counter()
        out.append(int(tok))
        if len(out) >= a["max_new_tokens"]:
            break
    t_end = time.perf_counter()
    res["prompts"].append({"prefill_s": t_first - t, "decode_tok_s": (len(out) - 1) / (t_end - t_first),
                           "tokens": out})
print(json.dumps(res))
'''


def worker_llama(args, ids, pld: int) -> dict:
    payload = json.dumps({"target": args.target, "threads": args.threads, "ids": ids,
                          "max_new_tokens": args.max_new_tokens, "pld": pld})
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run([str(LLAMA_PY), "-c", LLAMA_WORKER, payload], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed: {proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["system"] = "llama_pld" if pld else "llama"
    return res


def run_system(system: str, args, ids) -> dict:
    if system in ("llama", "llama_pld"):
        return worker_llama(args, ids, 10 if system == "llama_pld" else 0)
    cmd = [sys.executable, __file__, "--worker", system, "--target", args.target,
           "--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens),
           "--ids", json.dumps(ids)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{system} worker failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_e2e(args, prompts_file: str) -> dict:
    """`swiftspec run --mode async` on the 4-bit pair; tokens/s and TTFT from the trace."""
    import h5py
    out = Path(tempfile.mkdtemp()) / "e2e.h5"
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "swiftspec_mpi", "run", "--mode", "async",
           "--target", args.target, "--draft", args.draft, "--chat", "--prompts", prompts_file,
           "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos", "--threads", "1",
           "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"async run failed: {proc.stderr[-2000:]}")
    with h5py.File(out, "r") as f:
        reqs = [f["requests"][k] for k in sorted(f["requests"])]
        rows = [{"tok_s": float(r.attrs["tokens_per_s"]), "ttft_s": float(r.attrs["ttft_s"]),
                 "tokens": r["output_ids"][()].tolist()} for r in reqs]
        quant = json.loads(f.attrs["config_json"])["quant"]
    return {"system": "async_q4", "quant": quant, "prompts": rows}


def bench_kernels(threads: int) -> str:
    import torch

    from swiftspec_mpi.packed import cpu_linear, cpu_quant, int4
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (2048, 1536), "o": (1536, 1536), "gate|up": (17920, 1536), "down": (1536, 8960)}
    w4, wb = {}, {}
    for name, (n, k) in shapes.items():
        w = int4.PackedInt4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                             torch.rand(n, k // 32, generator=gen) * 0.02,
                             -torch.rand(n, k // 32, generator=gen) * 0.1, 32)
        w4[name] = cpu_quant.QuantLinear(n, k)
        w4[name].load(0, n, [(0, w)])
        wb[name] = cpu_linear.PackedWeight.from_dense(int4.dequantize(w), torch.bfloat16)
    lines = [f"one Qwen2.5-1.5B layer (qkv, o, gate|up, down), {threads} threads, best of 7, ms",
             "", "| M | 4-bit | bf16 | bf16 / 4-bit | 4-bit M / 4-bit 1 | bf16 M / bf16 1 |",
             "|---|---|---|---|---|---|"]
    base = {}
    for m in (1, 2, 4, 8, 16):
        best = {"q4": 1e9, "bf16": 1e9}
        for _ in range(7):
            for kind, ws, fn in (("q4", w4, cpu_quant.linear), ("bf16", wb, cpu_linear.linear)):
                t = time.perf_counter()
                for name, (n, k) in shapes.items():
                    fn(torch.randn(m, k, generator=gen), ws[name])
                best[kind] = min(best[kind], time.perf_counter() - t)
        base.setdefault("q4", best["q4"])
        base.setdefault("bf16", best["bf16"])
        lines.append(f"| {m} | {1e3 * best['q4']:.2f} | {1e3 * best['bf16']:.2f} | "
                     f"{best['bf16'] / best['q4']:.2f} | {best['q4'] / base['q4']:.2f} | "
                     f"{best['bf16'] / base['bf16']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", default=str(ROOT / "benchmarks" / "prompts_cpu2.jsonl"))
    p.add_argument("--no-llama", action="store_true")
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--kernels", action="store_true")
    args = p.parse_args()
    if args.kernels:
        print(bench_kernels(args.threads))
        return 0
    if args.worker:
        args.system = args.worker
        print(json.dumps(worker_ours(args)))
        return 0
    from swiftspec_mpi.checkpoints import registry
    args.target = args.target or str(registry.ensure_gguf(registry.DEFAULT_TARGET, print))
    args.draft = args.draft or str(registry.ensure_gguf(registry.DEFAULT_DRAFT, print))
    systems = ["q4", "bf16"]
    if not args.no_llama:
        subprocess.run(["bash", str(ROOT / "benchmarks" / "build_llama_cpp.sh")], check=True)
        systems += ["llama", "llama_pld"]
    ids = prompt_ids(args.prompts, args.target)
    results: dict[str, list] = {s: [] for s in systems}
    e2e = []
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for s in order:
            try:
                res = run_system(s, args, ids)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:   # OOM-killed, ...: go on
                print(f"round {r} {s}: failed ({str(exc)[-300:]})", flush=True)
                continue
            results[s].append(res)
            if args.json:
                Path(args.json).write_text(json.dumps({"results": results, "e2e": e2e}, indent=1))
            dec = [x["decode_tok_s"] for x in res["prompts"]]
            print(f"round {r} {s:10s} decode tok/s {[round(d, 2) for d in dec]} load {res['load_s']:.1f}s",
                  flush=True)
        if not args.no_e2e:
            try:
                res = run_e2e(args, args.prompts)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"round {r} async_q4: failed ({str(exc)[-300:]})", flush=True)
                continue
            e2e.append(res)
            if args.json:
                Path(args.json).write_text(json.dumps({"results": results, "e2e": e2e}, indent=1))
            print(f"round {r} async_q4   end-to-end tok/s {[round(x['tok_s'], 2) for x in res['prompts']]}",
                  flush=True)
    summary = summarize(results, e2e, args)
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "e2e": e2e}, indent=1))
    return 0


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(results: dict, e2e: list, args) -> str:
    lines = [f"Qwen2.5-Coder-1.5B Q4_K_M, {args.threads} threads, {args.max_new_tokens} new tokens, "
             f"{args.rounds} round(s) x {len(results['q4'][0]['prompts'])} prompt(s)", "",
             "| system | decode tok/s (mean) | prefill s (mean) | end-to-end tok/s | load s |",
             "|---|---|---|---|---|"]
    dec = {}
    for s, runs in results.items():
        d = [x["decode_tok_s"] for r in runs for x in r["prompts"]]
        pf = [x["prefill_s"] for r in runs for x in r["prompts"]]
        e = [args.max_new_tokens / (x["prefill_s"] + (args.max_new_tokens - 1) / x["decode_tok_s"])
             for r in runs for x in r["prompts"]]
        dec[s] = _mean(d)
        lines.append(f"| {s} | {_mean(d):.2f} | {_mean(pf):.2f} | {_mean(e):.2f} | "
                     f"{_mean([r['load_s'] for r in runs]):.1f} |")
    if e2e:
        t = [x["tok_s"] for r in e2e for x in r["prompts"]]
        lines.append(f"| async 0.5B->1.5B, 4-bit | - | - | {_mean(t):.2f} | - |")
    lines.append("")
    lines.append(f"q4 / bf16 decode: {dec['q4'] / dec['bf16']:.2f}x")
    if "llama" in dec:
        lines.append(f"q4 / llama.cpp decode: {dec['q4'] / dec['llama']:.2f}x")
    same = [a["tokens"] == b["tokens"] for ra, rb in zip(results["q4"], results["bf16"])
            for a, b in zip(ra["prompts"], rb["prompts"])]
    lines.append(f"q4 tokens equal bf16 tokens: {sum(same)}/{len(same)} prompts")
    if "llama" in results:
        same = [a["tokens"] == b["tokens"] for ra, rb in zip(results["q4"], results["llama"])
                for a, b in zip(ra["prompts"], rb["prompts"])]
        lines.append(f"q4 tokens equal llama.cpp tokens: {sum(same)}/{len(same)} prompts")
    lines += ["", "| tree nodes n | q4 verify ms | bf16 verify ms | q4 n / q4 1 | bf16 n / bf16 1 |",
              "|---|---|---|---|---|"]
    v = {s: {n: statistics.median([m for r in results[s] for m in r["verify_ms"][str(n)]])
             for n in (1, 2, 4, 8)} for s in ("q4", "bf16")}
    for n in (1, 2, 4, 8):
        lines.append(f"| {n} | {v['q4'][n]:.1f} | {v['bf16'][n]:.1f} | {v['q4'][n] / v['q4'][1]:.2f} | "
                     f"{v['bf16'][n] / v['bf16'][1]:.2f} |")
    lines.append("")
    for s in ("q4", "bf16"):
        r = results[s][0]
        lines.append(f"{s}: weights {r['weight_bytes'] / 2**20:.0f} MiB, peak RSS while loading "
                     f"{r['rss_peak_load'] / 2**20:.0f} MiB ({r['rss_before'] / 2**20:.0f} MiB "
                     f"after the imports): peak / weights {r['rss_peak_load'] / r['weight_bytes']:.2f}, "
                     f"(peak - before) / weights "
                     f"{(r['rss_peak_load'] - r['rss_before']) / r['weight_bytes']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
