"""Per-token decode latency of the real Qwen models on this CPU: ours vs Hugging Face transformers.

Both run the SAME weights (the prepared bf16 cache folder of `swiftspec models prepare`, cast to
the dtype under test), the same prompt (the Qwen chat template around a code request), greedy
decoding, one token per forward, the same torch thread count, in the SAME process:

    ours      swiftspec_mpi Transformer (checkpoint.load_model), forward(tok[1], pos[1], start,
              mask[1, start+1]) over its static KV slots
    HF sdpa   AutoModelForCausalLM, attn_implementation="sdpa" (transformers' CPU default),
              model(input_ids[1,1], past_key_values=DynamicCache) in eager PyTorch
    HF eager  the same with attn_implementation="eager" (matmul + softmax attention)

Each round prefills the prompt in every implementation, then runs `--tokens` decode steps
interleaved step by step (ours, HF sdpa, HF eager, ours, ...), so load from other processes on a
shared machine hits all of them alike; the table reports the median step over all rounds (and
the ratio of the fastest steps, the least disturbed ones).

    .venv/bin/python benchmarks/bench_model_cpu.py                       # the docs table
    .venv/bin/python benchmarks/bench_model_cpu.py --models qwen2.5-coder-0.5b --dtypes float32
    .venv/bin/python benchmarks/bench_model_cpu.py --profile ours         # torch profiler table
    .venv/bin/python benchmarks/bench_model_cpu.py --load-rss             # peak RSS of loading
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from md_table import md_row, md_table   # noqa: E402  same folder

PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


def _ours(folder, dtype, max_slots):
    from swiftspec_mpi.checkpoints.load import load_model
    model, tok = load_model(folder, max_slots=max_slots, dtype=dtype)
    return model, tok


def _hf(folder, dtype, attn):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn).eval()


def steps_ours(model, prompt_ids):
    """Generator: prefill on the first next(), then one greedy decode step per next(),
    yielding (step seconds, token)."""
    import torch
    from swiftspec_mpi.network.transformer import chain_mask

    p = len(prompt_ids)
    logits = model(torch.tensor(prompt_ids), torch.arange(p), 0, chain_mask(0, p),
                   logits_rows=torch.tensor([p - 1]))
    nxt = int(logits[-1].argmax())
    yield 0.0, nxt
    pos = p
    while True:
        t0 = time.perf_counter()
        logits = model(torch.tensor([nxt]), torch.tensor([pos]), pos,
                       torch.ones(1, pos + 1, dtype=torch.bool))
        nxt = int(logits[0].argmax())
        yield time.perf_counter() - t0, nxt
        pos += 1


def steps_hf(model, prompt_ids, attn):
    """The same for a transformers model with its DynamicCache (`attn` set before each step,
    untimed, so one model object serves sdpa and eager). Call under torch.inference_mode()."""
    import torch
    from transformers import DynamicCache

    model.set_attn_implementation(attn)
    cache = DynamicCache(config=model.config)
    res = model(input_ids=torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    nxt = int(res.logits[0, -1].argmax())
    yield 0.0, nxt
    while True:
        model.set_attn_implementation(attn)
        t0 = time.perf_counter()
        res = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        nxt = int(res.logits[0, -1].argmax())
        yield time.perf_counter() - t0, nxt


def decode(gen, n_tokens):
    """(step seconds [n_tokens], tokens [n_tokens + 1]) of one implementation run alone."""
    times, out = [], [next(gen)[1]]
    for _ in range(n_tokens):
        dt, t = next(gen)
        times.append(dt)
        out.append(t)
    return times, out


def bench_one(name, folder, dtype_name, args):
    """Rounds of: prefill every implementation, then `tokens` decode steps interleaved step by
    step (ours, HF sdpa, HF eager, ours, ...), so a load burst from other processes hits all
    implementations alike. Returns medians/min/p90 of the step times and greedy agreement."""
    import torch

    dtype = getattr(torch, dtype_name)
    t0 = time.time()
    ours, tok = _ours(folder, dtype, max_slots=512)
    loads = {"ours": time.time() - t0}
    prompt_ids = tok.encode(tok.apply_chat_template(PROMPT))
    t0 = time.time()       # ONE HF model (a 1.5B in float32 is 7 GiB); attention switched per step
    hf = _hf(folder, dtype, args.hf_attn[0])
    loads["HF"] = time.time() - t0
    makers = {"ours": lambda: steps_ours(ours, prompt_ids)}
    for attn in args.hf_attn:
        makers[f"HF {attn}"] = (lambda attn=attn: steps_hf(hf, prompt_ids, attn))
    steps = {k: [] for k in makers}
    toks = {k: [] for k in makers}
    with torch.inference_mode():
        for k, make in makers.items():     # warm-up (first-call allocations, oneDNN init)
            decode(make(), 4)
        for _ in range(args.rounds):
            gens = {k: make() for k, make in makers.items()}
            for k, g in gens.items():
                toks[k] = [next(g)[1]]     # prefill (untimed)
            for _ in range(args.tokens):
                for k, g in gens.items():
                    dt, t = next(g)
                    steps[k].append(dt)
                    toks[k].append(t)
            del gens
    res = {"model": name, "dtype": dtype_name, "prompt_tokens": len(prompt_ids),
           "load_s": loads, "ms": {k: 1e3 * statistics.median(v) for k, v in steps.items()},
           "p90_ms": {k: 1e3 * sorted(v)[int(0.9 * len(v))] for k, v in steps.items()},
           "min_ms": {k: 1e3 * min(v) for k, v in steps.items()}}
    ref = toks.get("HF sdpa") or next(v for k, v in toks.items() if k != "ours")
    res["agree"] = sum(a == b for a, b in zip(toks["ours"], ref)) / len(ref)
    del ours, hf, makers
    gc.collect()
    return res


def table(results) -> str:
    hf_keys = [k for k in results[0]["ms"] if k != "ours"]
    head = ["model", "dtype", "ours ms/tok", *[f"{k} ms/tok" for k in hf_keys], "ours tok/s",
            "best HF tok/s", "ours / best HF", "same, min step", "greedy agree"]
    rows = []
    for r in results:
        ms, mn = r["ms"], r["min_ms"]
        best = min(ms[k] for k in hf_keys)
        best_min = min(mn[k] for k in hf_keys)
        row = [r["model"], r["dtype"], f"{ms['ours']:.1f}", *[f"{ms[k]:.1f}" for k in hf_keys],
               f"{1e3 / ms['ours']:.2f}", f"{1e3 / best:.2f}", f"{ms['ours'] / best:.2f}x",
               f"{mn['ours'] / best_min:.2f}x", f"{100 * r['agree']:.0f}%"]
        rows.append(row)
    return md_table(head, rows, align="l l" + " r" * (len(head) - 2))


def profile(name, folder, dtype_name, which, args):
    """torch.profiler op table of `which` (ours | HF sdpa | HF eager) over --tokens decode steps
    (the prefill is not profiled)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as tprof

    dtype = getattr(torch, dtype_name)
    ours, tok = _ours(folder, dtype, max_slots=512)
    prompt_ids = tok.encode(tok.apply_chat_template(PROMPT))
    if which == "ours":
        make = lambda: steps_ours(ours, prompt_ids)  # noqa: E731
    else:
        del ours
        gc.collect()
        m = _hf(folder, dtype, which.split()[-1])
        make = lambda: steps_hf(m, prompt_ids, which.split()[-1])  # noqa: E731
    with torch.inference_mode():
        decode(make(), 4)                           # warm-up
        gen = make()
        next(gen)                                   # prefill: not profiled
        with tprof(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.tokens):
                next(gen)
    print(f"## {which}, {name} {dtype_name}, {args.tokens} decode steps ({args.threads} threads)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def load_child(path, dtype_name, how):
    """Peak RSS of loading one checkpoint (run in a fresh subprocess). how = "load_model": the
    way a rank does (checkpoint.load_model); "hinted": a GGUF through GGUFSource(path, dtype)
    (dequantized straight into the model dtype: what checkpoint.load_model could pass);
    "get_into": every GGUF tensor dequantized by GGUFSource.get_into into preallocated tensors
    of the model dtype (the loader's own overhead if Transformer.load_weights used get_into)."""
    import torch
    from swiftspec_mpi.checkpoints.load import load_model, load_tokenizer
    from swiftspec_mpi.network.transformer import Transformer

    dtype = getattr(torch, dtype_name)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.time()
    if how == "hinted":
        from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource
        load_tokenizer(path)
        with GGUFSource(path, dtype=dtype) as src:
            model = Transformer(src.config, max_slots=256, dtype=dtype)
            model.load_weights(src)
    elif how == "get_into":
        from swiftspec_mpi.checkpoints.gguf_loader import GGUFSource
        load_tokenizer(path)
        with GGUFSource(path) as src:
            dsts = {n: torch.empty(src.shape(n), dtype=dtype) for n in src.names()}
            for n, d in dsts.items():
                src.get_into(d, n)
        weights = sum(d.numel() * d.element_size() for d in dsts.values())
    else:
        model, _ = load_model(path, max_slots=256, dtype=dtype)
    if how != "get_into":
        weights = model.weight_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"path": str(path), "dtype": dtype_name, "load_s": time.time() - t0,
                      "weight_bytes": weights, "peak_rss": peak,
                      "rss_before_load": before}))


def load_rss(args):
    """Table of peak RSS while loading: GGUF (as ranks load it now, and with the dtype hint) and
    the prepared folder; `before` = RSS after the imports, before any file is read."""
    from swiftspec_mpi.checkpoints import registry
    head = ["checkpoint", "dtype", "how", "load s", "weights GiB", "RSS before GiB", "peak RSS GiB",
            "peak / weights", "(peak - before) / weights"]
    rows = []
    for name in args.models:
        for path, hows in ((registry.gguf_path(name), ("load_model", "hinted", "get_into")),
                           (registry.ensure_prepared(name), ("load_model",))):
            for dt in args.dtypes:
                for how in hows:
                    out = subprocess.run([sys.executable, __file__, "--threads", str(args.threads),
                                          "--_load-child", str(path), dt, how],
                                         check=True, capture_output=True, text=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    w, b, p = r["weight_bytes"], r["rss_before_load"], r["peak_rss"]
                    rows.append([os.path.basename(path), dt, how, f"{r['load_s']:.1f}",
                                 f"{w / 2**30:.2f}", f"{b / 2**30:.2f}", f"{p / 2**30:.2f}",
                                 f"{p / w:.2f}", f"{(p - b) / w:.2f}"])
                    print(md_row(rows[-1]), file=sys.stderr, flush=True)
    print(md_table(head, rows, align="l l l" + " r" * 6))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--hf-attn", default="sdpa,eager", help="HF attention implementations")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--profile", choices=["ours", "HF sdpa", "HF eager"])
    ap.add_argument("--load-rss", action="store_true", help="measure peak RSS of loading instead")
    ap.add_argument("--_load-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.hf_attn = [a for a in args.hf_attn.split(",") if a]
    if not args.hf_attn:
        ap.error("--hf-attn needs at least one of sdpa, eager")

    import torch
    torch.set_num_threads(args.threads)
    if args._load_child:
        load_child(*args._load_child)
        return 0
    if args.load_rss:
        load_rss(args)
        return 0
    from swiftspec_mpi.checkpoints import registry

    if args.profile:
        name = args.models[0]
        profile(name, str(registry.ensure_prepared(name)), args.dtypes[0], args.profile, args)
        return 0
    import transformers
    results = []
    for name in args.models:
        folder = str(registry.ensure_prepared(name))
        for dt in args.dtypes:
            r = bench_one(name, folder, dt, args)
            results.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"\nMachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
          f"visible, torch {torch.__version__} ({args.threads} threads), transformers "
          f"{transformers.__version__}; {args.rounds} rounds x {args.tokens} decode steps after a "
          f"{results[0]['prompt_tokens']}-token prompt, median step\n")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
