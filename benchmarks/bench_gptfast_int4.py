"""The peer for the 4-bit step: a gpt-fast-style Llama decode step in plain PyTorch, int4 weights
through torch's tinygemm kernel (`torch.ops.aten._weight_int4pack_mm`, group 128, inner k-tiles
8, as gpt-fast's `quantize.py --mode int4` makes them), `torch.compile(mode="reduce-overhead",
fullgraph=True)` (CUDA graphs), random weights at the named shapes.

As in gpt-fast's int4 model, every linear layer is int4, the LM head included; the embedding
table is bf16; attention is SDPA over the whole static KV cache [1, n_kv, max_seq, head_dim]
with a boolean mask, K/V repeated to the query heads; RoPE from a complex table.

Timed per shape after a `--context`-token prefix, as the engine's step is: one token, and an
8-token verify (8 new tokens, causal among themselves), each call followed by the argmax read to
the host (wall ms, median). Importable: `run(shapes, context)` -> rows, what
`bench_w4a16.py step --peer` calls in the same process after its own step.

    python benchmarks/bench_gptfast_int4.py [--shapes llama-3.2-1b,llama-3-8b,llama-3-70b] [--context 1024]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

GROUP = 128
INNER_K_TILES = 8


def _shape(name: str) -> dict:
    from swiftspec_mpi.checkpoints.dummy import SHAPES
    c = SHAPES[name]
    return dict(vocab=c.vocab_size, dim=c.hidden_size, inter=c.intermediate_size, layers=c.num_layers,
                heads=c.num_heads, kv=c.num_kv_heads, head_dim=c.head_dim, theta=c.rope_theta,
                eps=c.rms_norm_eps)


class Int4Linear(nn.Module):
    """y [.., n] = x [.., k] @ W^T, W int4 in tinygemm's packed layout (random codes), bf16
    scales and zeros [k / 128, n, 2]."""

    def __init__(self, k: int, n: int, gen: torch.Generator):
        super().__init__()
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack(q, INNER_K_TILES))
        sz = torch.empty(k // GROUP, n, 2, dtype=torch.bfloat16, device="cuda")
        sz[..., 0] = 0.0043
        sz[..., 1] = 0.0
        self.register_buffer("scales_and_zeros", sz)
        self.n, self.k = n, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.k), self.weight, GROUP, self.scales_and_zeros)
        return y.reshape(*lead, self.n)


class Block(nn.Module):
    def __init__(self, s: dict, max_seq: int, gen):
        super().__init__()
        d, hd = s["dim"], s["head_dim"]
        self.s = s
        self.wqkv = Int4Linear(d, (s["heads"] + 2 * s["kv"]) * hd, gen)
        self.wo = Int4Linear(s["heads"] * hd, d, gen)
        self.w1 = Int4Linear(d, s["inter"], gen)
        self.w3 = Int4Linear(d, s["inter"], gen)
        self.w2 = Int4Linear(s["inter"], d, gen)
        self.ln1 = nn.Parameter(torch.ones(d, dtype=torch.bfloat16, device="cuda"), requires_grad=False)
        self.ln2 = nn.Parameter(torch.ones(d, dtype=torch.bfloat16, device="cuda"), requires_grad=False)
        kv = torch.zeros(1, s["kv"], max_seq, hd, dtype=torch.bfloat16, device="cuda")
        self.register_buffer("k_cache", kv)
        self.register_buffer("v_cache", kv.clone())

    def forward(self, x, freqs, mask, pos):                     # x [1, T, d], freqs [T, hd/2, 2]
        s = self.s
        nh, nkv, hd = s["heads"], s["kv"], s["head_dim"]
        T = x.shape[1]
        h = F.rms_norm(x, (s["dim"],), self.ln1, s["eps"])
        q, k, v = self.wqkv(h).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = rope(q.view(1, T, nh, hd), freqs).transpose(1, 2)   # [1, nh, T, hd]
        k = rope(k.view(1, T, nkv, hd), freqs).transpose(1, 2)
        v = v.view(1, T, nkv, hd).transpose(1, 2)
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        kk = self.k_cache.repeat_interleave(nh // nkv, dim=1)
        vv = self.v_cache.repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        x = x + self.wo(o.transpose(1, 2).reshape(1, T, nh * hd))
        h = F.rms_norm(x, (s["dim"],), self.ln2, s["eps"])
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rope(x, freqs):                                             # x [1, T, H, hd], freqs [T, hd/2, 2]
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3).type_as(x)


class Llama(nn.Module):
    def __init__(self, s: dict, max_seq: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.s = s
        self.embed = nn.Parameter(torch.randn(s["vocab"], s["dim"], dtype=torch.bfloat16, device="cuda",
                                              generator=gen) * 0.02, requires_grad=False)
        self.layers = nn.ModuleList(Block(s, max_seq, gen) for _ in range(s["layers"]))
        self.norm = nn.Parameter(torch.ones(s["dim"], dtype=torch.bfloat16, device="cuda"), requires_grad=False)
        self.output = Int4Linear(s["dim"], s["vocab"], gen)
        hd = s["head_dim"]
        inv = 1.0 / (s["theta"] ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
        ang = torch.outer(torch.arange(max_seq, device="cuda").float(), inv)
        self.register_buffer("freqs", torch.stack([ang.cos(), ang.sin()], -1).to(torch.bfloat16))
        self.register_buffer("causal", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device="cuda")))

    def forward(self, idx, pos):                                 # idx [1, T], pos [T] -> logits [1, T, V]
        mask = self.causal[None, None, pos]
        freqs = self.freqs[pos]
        x = F.embedding(idx, self.embed)
        for layer in self.layers:
            x = layer(x, freqs, mask, pos)
        return self.output(F.rms_norm(x, (self.s["dim"],), self.norm, self.s["eps"]))


def weight_bytes(model: nn.Module) -> int:
    """Bytes a step streams: every buffer/parameter except the embedding table and KV caches."""
    skip = {"embed", "freqs", "causal"}
    return sum(t.numel() * t.element_size() for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if n.split(".")[-1] not in skip and "cache" not in n)


def time_ms(fn, iters=40, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return 1e3 * ts[len(ts) // 2]


def run(shapes: list[str], context: int = 1024) -> list[dict]:
    rows = []
    for name in shapes:
        s = _shape(name)
        t0 = time.perf_counter()
        model = Llama(s, context + 64)
        step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        prefix = torch.randint(0, 4000, (1, context), device="cuda")
        with torch.no_grad():
            model(prefix, torch.arange(context, device="cuda"))         # fills the cache (eager)
            r = {"shape": name, "step_gb": weight_bytes(model) / 1e9}
            for n in (1, 8):
                idx = torch.randint(0, 4000, (1, n), device="cuda")
                pos = torch.arange(context, context + n, device="cuda")
                r[f"argmax_{n}"] = time_ms(lambda: step(idx, pos).argmax(-1).tolist())
        r["compile_s"] = time.perf_counter() - t0
        rows.append(r)
        print(f"| {name} | {r['step_gb']:.2f} | {r['argmax_1']:.3f} | {r['argmax_8']:.3f} | "
              f"{r['argmax_8'] / r['argmax_1']:.2f} | {r['compile_s']:.0f} |", flush=True)
        del step, model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return rows


def header() -> None:
    print("| shape, gpt-fast-style int4 (tinygemm, torch.compile) | step GB | 1 token ms | 8-token verify ms | ratio | "
          "build + compile s |")
    print("|---|---:|---:|---:|---:|---:|")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b,llama-3-70b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    header()
    rows = run(args.shapes.split(","), args.context)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
