"""Where the time of one GPU decode step goes: the default forward (fused kernels, PDL chain) of
a model with random weights at a real shape, split into its kernel kinds. Each kind is timed
alone as a CUDA graph of all its launches of one step (one per layer, each on that layer's
weights and KV, so weights stream from HBM as in the step; launched with PDL as in the step),
next to the whole step captured the same way. Prints a Markdown table.

    python benchmarks/bench_step_breakdown.py [--shape llama-3-8b] [--context 1024] [--n 1]

Columns: launches per step, time per step (median of replays), time per launch, bytes each
kind must read (weights, or K/V for attention) and the bandwidth that implies, as a share of the
device copy bandwidth and of the read bandwidth (torch.sum over 4 GiB of bf16) measured in the
same run. "sum of kinds" vs "whole step" shows what the chain overlaps or adds.
"""
from __future__ import annotations

import argparse
import json

from pathlib import Path

import torch

from bench_kernels_gpu import copy_bandwidth, graph_time_us   # same folder (the kernel benchmark)


def graph_ms(fn, replays: int = 30) -> float:
    """Median ms of one replay of a CUDA graph holding fn()'s launches."""
    return graph_time_us([fn], replays) / 1e3


def bandwidths() -> tuple[float, float]:
    """(copy TB/s counting read + write, read TB/s of torch.sum over 4 GiB bf16)."""
    copy = copy_bandwidth() / 1e12
    x = torch.ones(2 << 30, dtype=torch.bfloat16, device="cuda")
    out = torch.empty((), dtype=torch.float32, device="cuda")
    read = x.numel() * 2 / (graph_ms(lambda: torch.sum(x, dim=0, dtype=torch.float32, out=out), 10) / 1e3) / 1e12
    del x
    torch.cuda.empty_cache()
    return copy, read


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1, help="tokens per step (tree size)")
    ap.add_argument("--json", help="also write the raw numbers here")
    a = ap.parse_args()
    from swiftspec_mpi.checkpoints.load import dummy_model
    from swiftspec_mpi.core.comm import SingleComm
    from swiftspec_mpi.gpu import fused_ops, kernels
    if not (kernels.available() and fused_ops.enabled() and fused_ops.gemm_mode() == "pdl"):
        raise SystemExit("needs the fused kernels and the default SWIFTSPEC_FUSED_GEMM=pdl")
    copy_bw, read_bw = bandwidths()
    L, N = a.context, a.n
    model, _ = dummy_model(a.shape, SingleComm(), L + 128, torch.bfloat16, "cuda")
    cfg, dev = model.cfg, "cuda"
    nh, hd, S = model.shard.nh_l, cfg.head_dim, model.max_slots
    nkv = model.shard.nkv_l
    tok = torch.randint(0, 1000, (N,), device=dev)
    pos = torch.arange(L, L + N, device=dev)
    slots = torch.arange(L, L + N, device=dev)
    mask = torch.zeros(N, S, dtype=torch.bool, device=dev)
    mask[:, :L + N] = True
    nv = torch.tensor([L + N], dtype=torch.int32, device=dev)
    for kc, vc in zip(model._k_layers, model._v_layers):      # a filled, finite context
        kc[:L + N].normal_(0, 1)
        vc[:L + N].normal_(0, 1)
    H = cfg.hidden_size
    x = (torch.randn(N, H, device=dev) * 0.5).to(torch.bfloat16)
    r = (torch.randn(N, H, device=dev) * 0.5).to(torch.bfloat16)
    h = torch.empty_like(x)
    qkv = torch.empty(N, model.layers[0].wqkv.shape[0], dtype=torch.bfloat16, device=dev)
    o = (torch.randn(N, nh, hd, device=dev)).to(torch.bfloat16)
    ao = torch.empty(N, H, dtype=torch.bfloat16, device=dev)
    m = (torch.randn(N, model.layers[0].wd.shape[1], device=dev) * 0.1).to(torch.bfloat16)
    dn = torch.empty(N, H, dtype=torch.bfloat16, device=dev)
    lays = model.layers
    nl = len(lays)

    def qkv_rope():
        for (_, wqkv, _, _, _, _, _, _, kc, vc) in lays:
            kernels.gemm_qkv_rope(x, wqkv, qkv, pos, slots, model.rope_cos, model.rope_sin, kc, vc, nh, pdl=True)

    def attention():
        for (_, _, _, _, _, _, _, _, kc, vc) in lays:
            kernels.tree_attention(qkv[:, :nh * hd].view(N, nh, hd), kc, vc, mask, nv, out=o, pdl=True)

    def o_proj():
        for lay in lays:
            kernels.gemm_rowparallel(o.view(N, nh * hd), lay.wo, out=ao, pdl=True)

    def norms():
        for lay in lays:
            fused_ops.add_rmsnorm(x, r, lay.ln1, cfg.rms_norm_eps, out=h, pdl=True)
            fused_ops.add_rmsnorm(x, r, lay.ln2, cfg.rms_norm_eps, out=h, pdl=True)

    def gate_up():
        for lay in lays:
            kernels.gemm_swiglu(h, lay.wgu, out=m, pdl=True)

    def down():
        for lay in lays:
            kernels.gemm_rowparallel(m, lay.wd, out=dn, pdl=True)

    def head():
        kernels.gemm_rowparallel(h, model.head, pdl=True)

    def step():
        model.forward_graphable(tok, pos, slots, mask, nv)

    wb = lambda name: sum(getattr(lay, name).numel() * 2 for lay in lays)       # noqa: E731
    kv_bytes = nl * (L + N) * nkv * hd * 2 * 2
    kinds = [("QKV GEMM + RoPE + KV write", nl, qkv_rope, wb("wqkv")),
             ("tree attention", nl, attention, kv_bytes),
             ("O GEMM", nl, o_proj, wb("wo")),
             ("add + RMSNorm", 2 * nl, norms, 0),
             ("gate|up GEMM + SwiGLU", nl, gate_up, wb("wgu")),
             ("down GEMM", nl, down, wb("wd")),
             ("LM head GEMM", 1, head, model.head.numel() * 2)]
    res = {"shape": a.shape, "context": L, "n": N, "copy_TBps": copy_bw, "read_TBps": read_bw,
           "gpu": torch.cuda.get_device_name(), "kinds": {}}
    print(f"{a.shape}, N = {N}, context {L}: copy {copy_bw:.2f} TB/s, read (torch.sum) {read_bw:.2f} TB/s")
    print("| kernel kind | launches | ms per step | us per launch | GB read | TB/s | % of copy BW | % of read BW |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    total = 0.0
    for name, count, fn, nbytes in kinds:
        ms = graph_ms(fn)
        total += ms
        tbps = nbytes / (ms / 1e3) / 1e12 if nbytes else float("nan")
        res["kinds"][name] = {"launches": count, "ms": ms, "bytes": nbytes}
        print(f"| {name} | {count} | {ms:.3f} | {1e3 * ms / count:.2f} | {nbytes / 1e9:.2f} | {tbps:.2f} | "
              f"{100 * tbps / copy_bw:.0f} % | {100 * tbps / read_bw:.0f} % |", flush=True)
    whole = graph_ms(step)
    wbytes = model.step_read_bytes()      # what a step streams (not an untied embedding table)
    res.update(sum_ms=total, step_ms=whole, step_read_bytes=wbytes, weight_bytes=model.weight_bytes())
    print(f"| sum of kinds | | {total:.3f} | | | | | |")
    print(f"| whole step (forward_graphable, embedding and logits included) | | {whole:.3f} | | "
          f"{wbytes / 1e9:.2f} | {wbytes / (whole / 1e3) / 1e12:.2f} | "
          f"{100 * wbytes / (whole / 1e3) / 1e12 / copy_bw:.0f} % | {100 * wbytes / (whole / 1e3) / 1e12 / read_bw:.0f} % |")
    print(f"floors (the {wbytes / 1e9:.2f} GB a step streams, Transformer.step_read_bytes): "
          f"/ copy BW {wbytes / copy_bw / 1e9:.2f} ms, / read BW {wbytes / read_bw / 1e9:.2f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
