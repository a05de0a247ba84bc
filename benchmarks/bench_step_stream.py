"""How fast one block an SM streams weights into shared memory: the persistent step kernel's weight
path alone (benchmarks/stream_probe.cu), by page layout, page size, ring depth and handshake, beside
plain 16-byte global loads and a device-to-device copy of the same bytes (same run).

    python benchmarks/bench_step_stream.py [--mb 512] [--json out.json]

Prints a markdown table: variant, GB/s, % of the copy's bandwidth (copy = read + write bytes / 2,
i.e. what a read-only stream can hope for)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import cupy as cp
import numpy as np

SMEM = 227 * 1024


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps runs (CUDA events, after two warm-ups)."""
    fn(); fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="bytes streamed, MiB")
    ap.add_argument("--row-bytes", type=int, default=4096, help="bytes of one weight row (bf16 K = 2048)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    src = (Path(__file__).parent / "stream_probe.cu").read_text()
    cuda_dir = Path(__file__).resolve().parent.parent / "cuda"     # mbarrier.cuh
    mod = cp.RawModule(code=src, backend="nvcc", options=("-O3", f"-I{cuda_dir}"))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = args.mb * 2**20 // args.row_bytes // 16 * 16
    nbytes = rows * args.row_bytes
    w = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    dst = cp.empty_like(w)
    out = cp.zeros(1, cp.uint32)
    res = []
    copy_s = timed(lambda: dst.__setitem__(slice(None), w), args.reps)
    read_bw_ref = nbytes * 2 / copy_s / 1e9
    res.append(("copy (read + write)", read_bw_ref))
    for u in (4, 8, 16):
        f = mod.get_function(f"ldg_probe{u}")
        s = timed(lambda: f((sms,), (256,), (w, np.int64(nbytes // 16), out)), args.reps)
        res.append((f"ld.global.nc, {u} in flight a thread", nbytes / s / 1e9))
    ring = mod.get_function("ring_probe")
    ring.max_dynamic_shared_size_bytes = SMEM
    for layout in (0, 1):
        for page in (8192, 16384, 32768):
            for protocol in (0, 1):
                for npages in (4, 8, 16, 24):
                    if npages * page + 1024 > SMEM:
                        continue
                    if protocol == 1 and npages % 8:
                        continue
                    s = timed(lambda: ring((sms,), (288,), (w, np.int64(rows), np.int64(args.row_bytes), np.int32(page),
                                                             np.int32(npages), np.int32(layout), np.int32(protocol), out),
                                           shared_mem=SMEM), args.reps)
                    name = (f"ring: {'16 row segments' if layout == 0 else 'one copy'} a page, {page // 1024} KB pages x "
                            f"{npages}, {'all warps pass' if protocol == 0 else 'owner only'}")
                    res.append((name, nbytes / s / 1e9))
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{dev}, {sms} SMs, {nbytes / 2**20:.0f} MiB streamed, row {args.row_bytes} B\n")
    print("| variant | GB/s | % of copy |\n|---|---:|---:|")
    for name, bw in res:
        print(f"| {name} | {bw:.0f} | {100 * bw / read_bw_ref:.0f} % |")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "bytes": nbytes, "rows": [
            {"variant": n, "gbs": b} for n, b in res]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
