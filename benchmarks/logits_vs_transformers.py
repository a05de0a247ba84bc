"""Our logits against transformers' float32 ones for a registry GGUF model, packed and dequantized.

    python benchmarks/logits_vs_transformers.py [MODEL ...] [--prompt TEXT]

MODEL: registry names (default: smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b). For each,
transformers loads the GGUF file (it dequantizes to float32), then our model loads it twice:
`quant="auto"` (packed 4-/6-/8-bit weights on the CPU GEMM of `packed/csrc/gemm_q.h`) and
`quant="none"` (dequantized to float32). One forward over the chat-templated prompt; printed per
mode: the largest absolute logit difference, the largest |logit| of the reference, their ratio
(the check `tests/test_quant_cpu.py` and `tests/test_gguf.py` apply) and whether every
position's argmax agrees.
"""
from __future__ import annotations

import argparse
import os

import torch

DEFAULT = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def compare(name: str, prompt: str) -> None:
    import accelerate  # noqa: F401  (transformers loads GGUF files through it)
    import transformers

    from swiftspec_mpi.checkpoints import registry
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    path = registry.ensure_gguf(name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for quant in ("auto", "none"):
        model, tok = load_model(path, max_slots=512, quant=quant)
        ids = tok.encode(tok.apply_chat_template(prompt))
        n = len(ids)
        ours = model(torch.tensor(ids), torch.arange(n), 0, chain_mask(0, n))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        diff, top = (ours - ref).abs().max().item(), ref.abs().max().item()
        same = torch.equal(ours.argmax(-1), ref.argmax(-1))
        print(f"| {name} | {quant} | {n} | {diff:.3g} | {top:.2f} | {diff / top:.2g} | {same} |",
              flush=True)
        del model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=DEFAULT)
    ap.add_argument("--prompt", default="Write a Python function that reverses a list.")
    args = ap.parse_args()
    print("| model | quant | tokens | max abs diff | max abs logit | relative | argmax equal |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name in args.models:
        compare(name, args.prompt)


if __name__ == "__main__":
    main()
