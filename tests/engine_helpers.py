"""Launch `swiftspec run` under mpiexec from tests and read back what it wrote."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

BIN = Path(sys.executable).parent
# the venv's mpiexec (mpich wheel); elsewhere the site's, or SWIFTSPEC_TEST_MPIEXEC="mpirun --flags"
MPIEXEC = shlex.split(os.environ.get("SWIFTSPEC_TEST_MPIEXEC", "")) or \
    [str(BIN / "mpiexec") if (BIN / "mpiexec").exists() else (shutil.which("mpiexec") or "mpiexec")]


def env_for_tests() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", SWIFTSPEC_NO_PIN="1", PYTHONUNBUFFERED="1")
    return env


def run_swiftspec(n: int, args: list[str], timeout: float = 240, check: bool = True):
    """mpiexec -n N python -m swiftspec_mpi run ARGS; -> CompletedProcess (text)."""
    cmd = [*MPIEXEC, "-n", str(n), sys.executable, "-m", "swiftspec_mpi", "run", "--threads", "1",
           *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env_for_tests())
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}"
                             f"\nstderr:\n{proc.stderr[-5000:]}")
    return proc


def read_outputs(path) -> list[list[int]]:
    with h5py.File(path, "r") as f:
        return [f["requests"][k]["output_ids"][()].tolist() for k in sorted(f["requests"])]


def read_requests(path) -> list[dict]:
    out = []
    with h5py.File(path, "r") as f:
        for k in sorted(f["requests"]):
            g = f["requests"][k]
            d = {a: (v.decode() if isinstance(v, bytes) else v) for a, v in g.attrs.items()}
            d["output_ids"] = g["output_ids"][()].tolist()
            d["prompt_ids"] = g["prompt_ids"][()].tolist()
            d["steps"] = g["steps"][()]
            out.append(d)
    return out


def read_root(path) -> dict:
    with h5py.File(path, "r") as f:
        attrs = {a: (v.decode() if isinstance(v, bytes) else v) for a, v in f.attrs.items()}
        attrs["events"] = f["events"][()] if "events" in f else np.zeros(0)
        attrs["ranks"] = f["ranks"][()] if "ranks" in f else np.zeros(0)
    attrs["config"] = json.loads(attrs["config_json"])
    return attrs


def write_prompts(path, prompts: list[str]) -> str:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return str(path)


def batch_ar(target: str, folder, prompts: list[str], new_tokens: int) -> list[dict]:
    """The reference of the streamed-request tests: `ar` on one rank over `prompts` (greedy,
    --ignore-eos, `new_tokens` each) -> read_requests of its trace."""
    out = Path(folder) / "ar.h5"
    run_swiftspec(1, ["--target", target, "--mode", "ar", "--prompts", write_prompts(Path(folder) / "p.jsonl", prompts),
                      "--max-new-tokens", str(new_tokens), "--ignore-eos", "--out", str(out), "--quiet"])
    return read_requests(out)


def greedy_gaps(target: str, prompt_ids: list[int], output_ids: list[int]) -> list[tuple[float, float]]:
    """The float32 target (CPU, the checkpoint's own weights) teacher-forced on prompt + output:
    for each output token i, (gap, margin) relative to that position's largest |logit|: gap =
    (best logit - logit of output_ids[i]), margin = (best - second best). A greedy output of
    this model in float32 has every gap 0; a bf16 one has small gaps at near-ties only."""
    import torch

    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    n = len(prompt_ids) + len(output_ids)
    model, _ = load_model(target, max_slots=n, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(prompt_ids + output_ids), torch.arange(n), 0, chain_mask(0, n))
    logits = logits[len(prompt_ids) - 1:n - 1].double()             # [O, V]: predicts output i
    scale = logits.abs().max(-1).values
    top2 = logits.topk(2, dim=-1).values
    chosen = logits.gather(1, torch.tensor(output_ids)[:, None])[:, 0]
    gap = (top2[:, 0] - chosen) / scale
    margin = (top2[:, 0] - top2[:, 1]) / scale
    return list(zip(gap.tolist(), margin.tolist()))
