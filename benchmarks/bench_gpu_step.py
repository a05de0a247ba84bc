"""Batch-1 step times on one GPU: ours (CUDA graphs + fused tree attention, with and without the
fused elementwise kernels of swiftspec_mpi.gpu.fused_ops) vs eager torch and HF transformers eager,
bf16, random weights at real shapes. Prints a Markdown table.

    python benchmarks/bench_gpu_step.py --context 1024 [--shapes llama-3-8b,llama-3.2-1b] [--no-hf]
    SWIFTSPEC_FUSED_OPS=0 python benchmarks/bench_gpu_step.py ...   # or --no-fused: baseline only

Rows: device copy bandwidth (the floor); for each shape the single-token step, the 8-node tree
step (verify) and, for the draft shape, the w=8 leaf expansion; HF eager decode of one token.
"weights GB" = the model's weights; "floor ms" = the bytes a step streams (every layer, the final
norm and the LM head; an untied embedding table is only looked up: Transformer.step_read_bytes)
over the copy bandwidth.
Graph columns: "torch ops" = forward_graphable with its torch elementwise ops (the fused kernels
switched off while that graph was captured); "fused ops" = the fused kernels, every GEMM on
cuBLAS (SWIFTSPEC_FUSED_GEMM=cublas); "PDL chain" = the default, SWIFTSPEC_FUSED_GEMM=pdl: every projection on
kernels.gemm_rowparallel and every kernel launched with programmatic dependent launch
("PDL speed-up" = fused ops / PDL chain). All graphs are captured on the same model and timed in alternating blocks
in the same run; speed-up = torch ops / fused ops; rel. diff = max |logits - torch-ops logits| /
max |torch-ops logits| of the fused path, then of the PDL chain.
"""
from __future__ import annotations

import argparse
import json
import time

from pathlib import Path

import torch


TOPK = 8     # the draft's children per expanded leaf (RunConfig.tree_topk's default)


def cuda_time(fn, iters=50, warmup=5) -> float:
    """Median wall ms per call, each call followed by a device sync (as the engine does)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e3 * times[len(times) // 2]


def cuda_time_alternating(fns: dict, iters=60, blocks=6, warmup=5) -> dict:
    """Median wall ms per call of each fn (each call followed by a device sync), the fns timed in
    alternating blocks of iters/blocks calls so that clock or thermal drift hits all alike."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per = max(1, iters // blocks)
    for _ in range(blocks):
        for k, fn in fns.items():
            for _ in range(per):
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times[k].append(time.perf_counter() - t)
    out = {}
    for k, ts in times.items():
        ts.sort()
        out[k] = 1e3 * ts[len(ts) // 2]
    return out


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), iters=20)
    return 2 * n / (ms / 1e3) / 1e12     # TB/s, read + write


def tree_mask(start: int, n: int) -> torch.Tensor:
    """A binary-ish tree of n nodes over a prefix (node i's parent is (i-1)//2)."""
    m = torch.zeros(n, start + n, dtype=torch.bool)
    m[:, :start] = True
    for i in range(n):
        j = i
        while True:
            m[i, start + j] = True
            if j == 0:
                break
            j = (j - 1) // 2
    return m


def ours(shape: str, context: int, sizes: list[int], fused: bool = True) -> dict:
    """Step times of one shape: eager torch `forward`, and CUDA graphs of `forward_graphable`
    with the torch elementwise ops ("graph_nofuse_N") and, if `fused` and available, with the
    fused kernels and cuBLAS GEMMs ("graph_N") and with the PDL chain ("graph_pdl_N", the
    default); plus each one's max relative logit difference to the torch-ops graph."""
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import fused_ops
    from swiftspec_mpi.gpu.graphs import GraphedModel, graphs_supported, logits_topk_logprobs
    from swiftspec_mpi.network.transformer import chain_mask
    model, _ = dummy_model(shape, SingleComm(), context + 128, torch.bfloat16, "cuda")
    weight_gb = model.weight_bytes() / 1e9
    step_gb = model.step_read_bytes() / 1e9     # what a step streams: not an untied embedding table
    dev = "cuda"
    pre = torch.randint(0, 1000, (context,), device=dev)
    model.forward(pre, torch.arange(context, device=dev), 0, chain_mask(0, context).to(dev))
    res = {"weight_gb": weight_gb, "step_gb": step_gb, "graphs": graphs_supported(model)}
    fused = fused and res["graphs"] and fused_ops.available()
    res["fused_ops"] = fused
    g_plain = GraphedModel(model) if res["graphs"] else None
    g_fused = GraphedModel(model) if fused else None          # fused ops, cuBLAS GEMMs (default)
    g_pdl = GraphedModel(model) if fused else None            # fused ops, all GEMMs ours, PDL chain
    was, was_mode = fused_ops._enabled, fused_ops.gemm_mode()
    for n in sizes:
        toks = torch.randint(0, 1000, (n,))
        pos = torch.arange(context, context + n)
        mask = tree_mask(context, n)
        res[f"eager_{n}"] = cuda_time(lambda: model.forward(toks, pos, context, mask).argmax(-1).cpu())
        if g_plain is None:
            continue
        fns = {}
        try:           # a graph keeps the path active when it was captured (at its first call)
            fused_ops.set_enabled(False)
            ref = g_plain.forward(toks, pos, context, mask).float().clone()
            fns[f"graph_nofuse_{n}"] = lambda: g_plain.forward(toks, pos, context, mask).argmax(-1).cpu()
            if g_fused is not None:
                fused_ops.set_enabled(True)
                for key, g, mode in (("graph", g_fused, "cublas"), ("graph_pdl", g_pdl, "pdl")):
                    fused_ops.set_gemm_mode(mode)
                    got = g.forward(toks, pos, context, mask).float()
                    res[f"{key}_rel_diff_{n}"] = ((got - ref).abs().max() / ref.abs().max()).item()
                    fns[f"{key}_{n}"] = (lambda g=g: g.forward(toks, pos, context, mask).argmax(-1).cpu())
                    if key == "graph_pdl":      # the engine's reads, reduced inside the graph
                        ids = g.forward_argmax(toks, pos, context, mask)
                        ids2, _ = g.forward_topk_logprobs(toks, pos, context, mask, TOPK)
                        # the same tokens, or (top-k vs argmax among bf16-valued ties) equal logits
                        ref_ids = got.argmax(-1).cpu().numpy()
                        top1 = got.gather(1, torch.from_numpy(ids2[:, :1]).to(got.device)).squeeze(1)
                        res[f"read_same_{n}"] = bool((ids == ref_ids).all() and torch.equal(top1, got.max(-1).values))
                        fns[f"graph_pdl_argmax_{n}"] = lambda g=g: g.forward_argmax(toks, pos, context, mask)
                        fns[f"graph_pdl_topk_host_{n}"] = lambda g=g: logits_topk_logprobs(
                            g.forward(toks, pos, context, mask), TOPK)
                        fns[f"graph_pdl_topk_{n}"] = lambda g=g: g.forward_topk_logprobs(toks, pos, context, mask, TOPK)
        finally:
            fused_ops.set_enabled(was)
            fused_ops.set_gemm_mode(was_mode)
        res.update(cuda_time_alternating(fns))
    del model, g_plain, g_fused, g_pdl
    torch.cuda.empty_cache()
    return res


def hf(shape: str, context: int) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftspec_mpi.checkpoints.dummy import SHAPES
    c = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                      intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                      num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                      rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                      max_position_embeddings=c.max_position_embeddings)
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 1000, (1, context), device="cuda")
    with torch.inference_mode():
        out = m(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(30):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = m(nxt, past_key_values=past, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            nxt.cpu()
            times.append(time.perf_counter() - t)
            past = out.past_key_values
    times.sort()
    del m
    torch.cuda.empty_cache()
    return 1e3 * times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-fused", action="store_true",
                    help="time only the torch-ops graph (also: SWIFTSPEC_FUSED_OPS=0)")
    ap.add_argument("--json", help="also write the raw numbers here")
    a = ap.parse_args()
    from swiftspec_mpi.gpu import fused_ops
    fused = not a.no_fused and fused_ops._enabled
    bw = copy_bandwidth()
    rows = {"copy_TBps": bw, "gpu": torch.cuda.get_device_name(), "context": a.context, "torch": torch.__version__}
    print(f"device copy bandwidth: {bw:.2f} TB/s  ({rows['gpu']}, torch {torch.__version__})", flush=True)
    print("| shape | weights GB | floor ms | N | eager ms | graph, torch ops ms | graph + fused ops ms "
          "| speed-up | PDL chain ms | PDL speed-up "
          "| logits rel. diff (fused / PDL) | HF eager ms (N=1) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    nan = float("nan")
    reads = {}
    for shape in a.shapes.split(","):
        r = ours(shape, a.context, [1, 8], fused=fused)
        reads[shape] = r
        r["hf_1"] = None if a.no_hf else hf(shape, a.context)
        rows[shape] = r
        floor = r["step_gb"] / bw            # ms: every byte a step streams, read once at copy speed
        for n in (1, 8):
            base, fast = r.get(f"graph_nofuse_{n}", nan), r.get(f"graph_{n}", nan)
            print(f"| {shape} | {r['weight_gb']:.2f} | {floor:.2f} | {n} | {r[f'eager_{n}']:.2f} | "
                  f"{base:.2f} | {fast:.2f} | {base / fast:.2f}x | "
                  f"{r.get(f'graph_pdl_{n}', nan):.2f} | {fast / r.get(f'graph_pdl_{n}', nan):.2f}x | "
                  f"{r.get(f'graph_rel_diff_{n}', nan):.1e} / "
                  f"{r.get(f'graph_pdl_rel_diff_{n}', nan):.1e} | "
                  f"{(r['hf_1'] if n == 1 and r['hf_1'] else nan):.2f} |",
                  flush=True)
    print("\nWhat the engine reads back per step (PDL chain; wall ms incl. the sync): the argmax "
          "(verify) and the top-8 log-probs (draft expansion), reduced after the graph and read vs "
          "reduced inside the graph (GraphedModel.forward_argmax / forward_topk_logprobs); both reduce "
          "with cuda_graphs._argmax / _topk_logprobs (fused_ops.logits_topk on a GPU)")
    print("| shape | N | logits, then argmax + read | argmax in the graph | logits, then top-k + reads "
          "| top-k in the graph | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for shape, r in reads.items():
        for n in (1, 8):
            print(f"| {shape} | {n} | {r.get(f'graph_pdl_{n}', nan):.3f} | {r.get(f'graph_pdl_argmax_{n}', nan):.3f} | "
                  f"{r.get(f'graph_pdl_topk_host_{n}', nan):.3f} | {r.get(f'graph_pdl_topk_{n}', nan):.3f} | "
                  f"{r.get(f'read_same_{n}')} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
