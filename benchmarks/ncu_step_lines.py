"""Where the persistent step kernel's warps stall, by source line: Nsight Compute's warp-state
samples (SourceCounters) of one launch of the step, mapped from SASS addresses to lines of
cuda/step_kernel.cu (and its headers) through the cubin's line table.

    python benchmarks/ncu_step_lines.py [--row 1b-int4] [--n 1] [--no-waits] [--top 40] [--csv out.csv]

It runs itself under `ncu` (--inner) with the kernels compiled with -lineinfo
(SWIFTSPEC_KERNELS_LINEINFO=1) into a private CuPy cache, so the profiled cubin is the one it then
disassembles (`nvdisasm -g`): a warm-up launch, then launches of the step at N tokens on random
weights at the row's shape (bench_step_kernel.ROWS, context 1024); --no-waits removes every counter
wait from the instruction table first (the outputs are garbage; what is left is on-chip work and
streaming). Prints per line: % of the samples (every warp, the loader's too), % of the warp
instructions executed, the two largest stall reasons, the source text.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WARMUP = 3          # launches before the profiled one


def inner(args) -> None:
    """The profiled process: WARMUP launches, then the one ncu records."""
    import torch
    sys.path.insert(0, str(HERE))
    from bench_step_kernel import kernel_inputs, prefilled_model
    from swiftspec_mpi.gpu.step_kernel import StepKernel
    model = prefilled_model(args.row, 1024)
    sk = StepKernel(model)
    toks, pos, mask, nv = kernel_inputs(model, 1024, args.n)
    sk.forward(toks, pos, pos, mask, nv)
    torch.cuda.synchronize()
    sk.check()
    if args.no_waits:
        sk.state(args.n).instr[:, 4] = -1
    for _ in range(WARMUP + 1):
        sk.forward(toks, pos, pos, mask, nv)
    torch.cuda.synchronize()


def line_table(cubin: Path, func: str) -> dict[int, tuple[str, int, str]]:
    """{offset: (file, line, opcode)} of `func`'s SASS (nvdisasm -g)."""
    nvdisasm = shutil.which("nvdisasm")
    if nvdisasm is None:
        from cupy.cuda import get_nvcc_path
        nvdisasm = str(Path(get_nvcc_path().split()[0]).with_name("nvdisasm"))
    text = subprocess.run([nvdisasm, "-g", "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
    out, where, inside = {}, ("?", 0), False
    for ln in text.splitlines():
        if ln.startswith(f".text.{func}:"):
            inside = True
            continue
        if inside and ln.startswith(".text."):
            break
        if not inside:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if m:
            where = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", ln)
        if m:
            out[int(m.group(1), 16)] = (where[0], where[1], m.group(3))
    return out


def pasted_origins(name: str) -> list[tuple[str, int]]:
    """(file, line) of each line of launch.cuda_source(name), the text CuPy compiles (cuda/<name>.cu
    with its local headers pasted in place of their #include lines): the line table names that
    text's lines (its temporary file) where the .cu's own lines were compiled."""
    from swiftspec_mpi.gpu.launch import _LOCAL_HEADER, cuda_source, cuda_source_dir
    folder = cuda_source_dir()
    out = []
    for i, text in enumerate((folder / f"{name}.cu").read_text().split("\n"), 1):
        m = _LOCAL_HEADER.fullmatch(text)
        if m:
            hdr = (folder / m.group(1)).read_text().split("\n")
            out += [(m.group(1), j) for j in range(1, len(hdr))] + [(f"{name}.cu", i)]
        else:
            out.append((f"{name}.cu", i))
    assert len(out) == len(cuda_source(name).split("\n")), "pasted source lines"
    return out


def source_line(file: str, line: int) -> str:
    p = ROOT / "cuda" / file
    if p.exists():
        lines = p.read_text().splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", default="1b-int4")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--no-waits", action="store_true")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--csv", help="also write ncu's per-instruction table here")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return
    mb = 1 if args.n <= 8 else 2 if args.n <= 16 else 4
    func = f"step_kernel_mb{mb}"
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SWIFTSPEC_KERNELS_LINEINFO="1", CUPY_CACHE_DIR=str(Path(tmp) / "cupy"),
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        rep = Path(tmp) / "step"
        cmd = ["ncu", "--clock-control", "none", "--kernel-name", func, "--launch-skip", str(WARMUP + 1),
               "--launch-count", "1", "--section", "SourceCounters", "--section", "WarpStateStats",
               "-f", "-o", str(rep), sys.executable, __file__, "--inner", "--row", args.row, "--n", str(args.n)]
        if args.no_waits:
            cmd.append("--no-waits")
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0 or not rep.with_suffix(".ncu-rep").exists():
            sys.exit(f"ncu failed (rc {r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
        table = subprocess.run(["ncu", "-i", str(rep.with_suffix(".ncu-rep")), "--page", "source", "--csv",
                                "--print-source", "sass"], check=True, capture_output=True, text=True).stdout
        if args.csv:
            Path(args.csv).write_text(table)
        cached = next((c for c in Path(tmp, "cupy").rglob("*.cubin") if func.encode() in c.read_bytes()), None)
        if cached is None:
            sys.exit(f"no cubin with {func} in the private CuPy cache")
        data = cached.read_bytes()                 # CuPy's cache file: the cubin's hash, then the cubin
        cubin = Path(tmp) / "step.cubin"
        cubin.write_bytes(data[data.index(b"\x7fELF"):])
        lines = line_table(cubin, func)
    rows = list(csv.reader(io.StringIO(table)))
    hi = next(i for i, r in enumerate(rows) if "Address" in r)
    hdr, body = rows[hi], [r for r in rows[hi + 1:] if len(r) == len(rows[hi])]
    ai, si = hdr.index("Address"), hdr.index("Source")
    ci, ei = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Instructions Executed")
    stalls = [i for i, c in enumerate(hdr) if c.startswith("stall_") and "Not" not in c]

    def num(s: str) -> float:
        try:
            return float(s.replace(",", ""))
        except ValueError:
            return 0.0
    base = int(body[0][ai], 16)
    origins = pasted_origins("step_kernel")
    agg = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
    same = 0
    for r in body:
        f, ln, opc = lines.get(int(r[ai], 16) - base, ("?", 0, ""))
        if f.endswith(".cu") and 0 < ln <= len(origins):   # CuPy's temporary file: the pasted source
            f, ln = origins[ln - 1]
        same += opc != "" and opc in r[si]
        a = agg[(f, ln)]
        a[0] += num(r[ci])
        a[1] += num(r[ei])
        for i in stalls:
            a[2][hdr[i][len("stall_"):]] += num(r[i])
    tot, toti = sum(a[0] for a in agg.values()), sum(a[1] for a in agg.values())
    print(f"{args.row}, N = {args.n}{', no waits' if args.no_waits else ''}: {tot:.0f} samples, "
          f"{toti / 1e6:.1f} M warp instructions; SASS matched to the line table: {same} of {len(body)}")
    print("| samples | instructions | line | top stalls | source |\n|---:|---:|---|---|---|")
    for (f, ln), (s, ni, c) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:args.top]:
        top = ", ".join(f"{k} {100 * v / max(s, 1):.0f} %" for k, v in c.most_common(2))
        src = source_line(f, ln)[:70].replace("|", "\\|")
        print(f"| {100 * s / tot:.1f} % | {100 * ni / max(toti, 1):.1f} % | {f}:{ln} | {top} | `{src}` |")


if __name__ == "__main__":
    main()
