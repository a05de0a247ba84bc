"""Compare the outputs of two traces token for token; at the first difference, measure how close
the target's top-2 logits were there (a near-tie explains a bf16 flip).

    python benchmarks/compare_outputs.py ar.h5 async.h5 [--target SHAPE_OR_PATH --dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json

import h5py
import torch


def outputs(path):
    with h5py.File(path, "r") as f:
        return [(f["requests"][k]["prompt_ids"][()].tolist(), f["requests"][k]["output_ids"][()].tolist())
                for k in sorted(f["requests"])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--target", help="recompute the logit margin at the first difference with this model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--quant", default="none", help="int4: the target's 4-bit dummy weights (--quant int4 runs)")
    a = ap.parse_args()
    for r, ((pa, oa), (pb, ob)) in enumerate(zip(outputs(a.a), outputs(a.b))):
        i = next((k for k, (x, y) in enumerate(zip(oa, ob)) if x != y), None)
        if i is None and len(oa) == len(ob):
            print(f"request {r}: identical ({len(oa)} tokens)")
            continue
        print(f"request {r}: first difference at token {i}: {oa[i:i+3]} vs {ob[i:i+3]}")
        if a.target:
            from swiftspec_mpi.checkpoints.load import dummy_model
            from swiftspec_mpi.core.comm import SingleComm
            from swiftspec_mpi.network.transformer import chain_mask
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
            seq = pa + oa[:i]
            model, _ = dummy_model(a.target, SingleComm(), len(seq) + 8, dt, dev, quant=a.quant)
            logits = model.forward(torch.tensor(seq), torch.arange(len(seq)), 0, chain_mask(0, len(seq)))[-1]
            top = torch.topk(logits.float(), 2)
            print(json.dumps({"top2_ids": top.indices.tolist(), "top2_logits": top.values.tolist(),
                              "margin": float(top.values[0] - top.values[1]),
                              "bf16_ulp_at_top": float(torch.finfo(torch.bfloat16).eps * abs(top.values[0]))}))


if __name__ == "__main__":
    main()
