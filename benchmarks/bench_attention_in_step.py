"""Tree-attention configs timed inside the whole decode step, where the default choice
(kernels.tree_attention_config) is made for short contexts. A chain of attention calls
(bench_kernels_gpu.py) ranks configs differently from the step: there the QKV GEMV before the
attention and the O GEMV after it stream weights, and what overlaps what changes.

    python benchmarks/bench_attention_in_step.py [--shapes llama-3-8b,llama-3.2-1b] [--context 1024] [--n 1,8]

For each shape, context and token count: a model with random weights (context + 128 KV slots, a
filled context), one CUDA graph of the step (forward_graphable + the argmax read, as the engine
replays it) per config, every config forced through tree_attention_config; the graphs are
replayed in alternating rounds of 10 and the median device time (CUDA events) is printed per
config, best first, with the step's difference to the default and the largest logit difference
(configs with another split of the KV sum in another order; same splits give the same bits).
"""
from __future__ import annotations

import argparse

import torch


def _candidates(rows: int) -> list:
    from swiftspec_mpi.gpu.tree_attention import AttnConfigV1, AttnConfigV2, AttnConfigV4
    if rows <= 16:
        return [AttnConfigV4(t, 4, 1, 4, 32, 0) for t in (1, 2, 3, 4)] + \
            [AttnConfigV2(8, 4, 1, 4), AttnConfigV2(16, 2, 1, 4), AttnConfigV1(8, 4, 1)]
    return [AttnConfigV4(t, 4, 1, 4, 32, 0) for t in (1, 2, 4)] + [AttnConfigV4(t, 4, 2, 8, 32, 0) for t in (2, 4)] + \
        [AttnConfigV2(8, 4, 2, 4), AttnConfigV2(8, 4, 1, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3-8b,llama-3.2-1b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n", default="1,8", help="tokens per step (N * H / Hkv rows per KV head: <= 32)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import kernels
    from swiftspec_mpi.gpu.graphs import GraphedModel
    from swiftspec_mpi.network.transformer import chain_mask

    from swiftspec_mpi.gpu import tree_attention as attention_module
    default_rule = attention_module.tree_attention_config
    forced = {"cfg": None}
    attention_module.tree_attention_config = lambda rows, max_len, head_dim=128: \
        forced["cfg"] or default_rule(rows, max_len, head_dim)
    ctx = a.context
    print(f"{torch.cuda.get_device_name()}; context {ctx}, {ctx + 128} KV slots; step device ms (median)")
    for shape in a.shapes.split(","):
        model, _ = dummy_model(shape, SingleComm(), ctx + 128, torch.bfloat16, "cuda")
        model.forward(torch.randint(0, 1000, (ctx,), device="cuda"), torch.arange(ctx, device="cuda"), 0,
                      chain_mask(0, ctx).to("cuda"))
        G = model.shard.nh_l // model.shard.nkv_l
        for n in (int(x) for x in a.n.split(",")):
            rows = n * G
            default = default_rule(rows, model.max_slots, model.cfg.head_dim)
            configs = [None] + [c for c in _candidates(rows) if c != default]
            toks, pos = torch.randint(0, 1000, (n,)), torch.arange(ctx, ctx + n)
            mask = torch.ones(n, ctx + n, dtype=torch.bool)
            graphs, logits = {}, {}
            for c in configs:
                forced["cfg"] = c
                g = GraphedModel(model)
                logits[c] = g.forward(toks, pos, ctx, mask).float().clone()
                g.forward_argmax(toks, pos, ctx, mask)
                graphs[c] = g           # keeps the graph's input and output buffers alive
            forced["cfg"] = None
            ms = {c: [] for c in graphs}
            for _ in range(a.rounds):
                for c, g in graphs.items():
                    graph = g.static[(n, ("argmax",))].graph
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    for _ in range(10):
                        graph.replay()
                    t1.record()
                    t1.synchronize()
                    ms[c].append(t0.elapsed_time(t1) / 10)
            med = {c: sorted(v)[len(v) // 2] for c, v in ms.items()}
            print(f"\n{shape}, N = {n} ({rows} rows per KV head), default {default}: {med[None]:.3f} ms")
            print("| config | step ms | vs default | max abs logit diff |\n|---|---:|---:|---:|")
            for c in sorted(med, key=med.get):
                diff = (logits[c] - logits[None]).abs().max().item()
                print(f"| {'default ' + str(default) if c is None else c} | {med[c]:.3f} | "
                      f"{med[c] - med[None]:+.3f} | {diff:.3g} |", flush=True)
        del model, graphs
        torch.cuda.empty_cache()
    attention_module.tree_attention_config = default_rule


if __name__ == "__main__":
    main()
