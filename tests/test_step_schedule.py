"""The persistent step kernel's schedule (swiftspec_mpi/gpu/step_schedule.py) on the CPU: every
dependency met in a run of the schedule (no deadlock), every weight tile of every projection
covered exactly once, every (layer, head, row) attended exactly once, each block's list in stage
order; the weight shapes it takes are those its pages compute whole; and cuda/step_kernel.cu
compiles for sm_90 (tools/compile_cuda.sh compiles every .cu)."""
from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import skip_or_fail
from swiftspec_mpi.gpu import step_schedule as ss

ROOT = Path(__file__).resolve().parent.parent

# (layers, heads, kv heads, head_dim, hidden, intermediate, vocab)
SHAPES = {
    "llama-1b": (16, 32, 8, 64, 2048, 8192, 128256),
    "llama-3b": (28, 24, 8, 128, 3072, 8192, 128256),
    "llama-8b": (32, 32, 8, 128, 4096, 14336, 128256),
    "llama-70b": (80, 64, 8, 128, 8192, 28672, 128256),
    "smollm2-135m": (30, 9, 3, 64, 576, 1536, 49152),
    "qwen2.5-0.5b": (24, 14, 2, 64, 896, 4864, 151936),
}


def _shape(name: str, n: int) -> ss.Shape:
    L, nh, nkv, hd, H, inter, V = SHAPES[name]
    return ss.Shape(L, n, nh, nkv, (nh + 2 * nkv) * hd, H, 2 * inter, V)


def _stage(s: ss.Schedule, w) -> int:
    """Stage order: embed 0; layer l: QKV 5l+1, attention 5l+2, O 5l+3, gate|up 5l+4, down 5l+5; head last."""
    if w[0] == ss.EMBED:
        return 0
    if w[0] == ss.ATTN:
        return 5 * int(w[1]) + 2
    kind, layer = s.op_kinds[w[1]]
    return 5 * layer + {ss.K_QKV: 1, ss.K_O: 3, ss.K_GU: 4, ss.K_DOWN: 5, ss.K_HEAD: 1}[kind]


CASES = ([(name, n, 132) for name in ("llama-1b", "smollm2-135m", "qwen2.5-0.5b") for n in (1, 2, 5, 8, 16, 32)]
         + [("llama-3b", n, 132) for n in (1, 8, 32)] + [("llama-8b", n, 132) for n in (1, 8)]
         + [("llama-70b", n, 132) for n in (1, 8)]
         + [("smollm2-135m", n, b) for n in (1, 5, 32) for b in (1, 7)])


@pytest.mark.parametrize("name,n,blocks", CASES)
def test_schedule_runs_and_covers(name, n, blocks):
    shape = _shape(name, n)
    s = ss.build(shape, blocks)
    order = ss.simulate(s)
    assert sorted(order) == list(range(len(s.instr)))                 # everything ran once
    assert s.instr[:, 0].tolist().count(ss.EMBED) == 1
    # each op's tiles exactly once
    rows = {ss.K_QKV: shape.qkv_rows, ss.K_O: shape.hidden, ss.K_GU: shape.inter2,
            ss.K_DOWN: shape.hidden, ss.K_HEAD: shape.vocab_rows}
    tiles = {i: Counter() for i in range(len(s.op_kinds))}
    attn = Counter()
    for w in s.instr:
        if w[0] == ss.GEMV:
            assert w[3] >= 1
            kind = s.op_kinds[int(w[1])][0]
            rounds = ss.instr_tiles(kind, rows[kind], int(w[2]), int(w[3]))
            if kind == ss.K_GU:                 # a round: gate tiles, then the up tiles of their rows
                assert w[3] % 2 == 0
                half = rows[kind] // (2 * ss.TILE)
                for r in rounds:
                    assert [t + half for t in r[:len(r) // 2]] == r[len(r) // 2:]
            tiles[int(w[1])].update(t for r in rounds for t in r)
        elif w[0] == ss.ATTN:
            nrows, split, splits = ss.attn_fields(int(w[7]))
            assert 1 <= nrows <= ss.ATTN_ROWS and 0 <= split < splits <= ss.MAX_SPLITS
            attn.update((int(w[1]), int(w[2]), r, split, splits) for r in range(int(w[3]), int(w[3] + nrows)))
    for i, (kind, _layer) in enumerate(s.op_kinds):
        assert sorted(tiles[i]) == list(range(rows[kind] // ss.TILE)) and set(tiles[i].values()) == {1}
        assert s.op_instr[i] == sum(1 for w in s.instr if w[0] == ss.GEMV and w[1] == i)
    splits = ss.attn_splits(n, shape.n_heads, blocks)
    assert len(attn) == shape.n_layers * shape.n_heads * n * splits and set(attn.values()) == {1}
    assert {k[4] for k in attn} == {splits}
    # each block's list in stage order (what makes the schedule deadlock-free on the device)
    for b in range(s.blocks):
        stages = [_stage(s, w) if not (w[0] == ss.GEMV and s.op_kinds[w[1]][0] == ss.K_HEAD)
                  else 10 ** 6 for w in s.instr[s.block_start[b]:s.block_start[b + 1]]]
        assert stages == sorted(stages)
    # a wait's counter belongs to an earlier stage's signal
    assert all(w[4] < 0 or w[4] <= w[6] for w in s.instr)


def test_schedule_spreads_the_work():
    """The 1B head's 8016 tiles over 132 blocks: every block gets 60 or 61."""
    s = ss.build(_shape("llama-1b", 1), 132)
    head = len(s.op_kinds) - 1
    per_block = Counter()
    for b in range(132):
        for w in s.instr[s.block_start[b]:s.block_start[b + 1]]:
            if w[0] == ss.GEMV and w[1] == head:
                per_block[b] += int(w[3])
    assert set(per_block.values()) == {60, 61}


def test_attention_keys_split_to_fill_the_blocks():
    """Small N: each (head, rows) pair's keys are split so that the attention instructions fill the
    blocks (1B at N = 1: 32 heads x 4 ranges on 132 blocks); large N: one range."""
    assert ss.attn_splits(1, 32, 132) == 4 and ss.attn_splits(1, 9, 132) == 14
    assert ss.attn_splits(8, 32, 132) == 1 and ss.attn_splits(32, 64, 132) == 1
    assert ss.attn_splits(1, 4, 132) == ss.MAX_SPLITS and ss.attn_splits(1, 32, 7) == 1
    assert ss.attn_fields(ss.attn_word(5, 3, 14)) == (5, 3, 14)


def test_simulate_finds_a_deadlock():
    s = ss.build(_shape("smollm2-135m", 2), 4)
    i = next(i for i, w in enumerate(s.instr) if w[0] == ss.ATTN)
    s.instr[i, 5] += 1                          # waits for one more QKV instruction than exist
    with pytest.raises(RuntimeError, match="deadlock"):
        ss.simulate(s)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="1..32"):
        ss.build(_shape("llama-1b", 33), 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        ss.build(ss.Shape(1, 1, 2, 1, 4 * 64, 100, 256, 256), 8)


def test_step_kernel_compiles_for_sm90(tmp_path):
    """cuda/step_kernel.cu compiles with the defines the host builds it with (one head dim, 16
    compute warps: the static_asserts check the host-packed struct sizes); tools/compile_cuda.sh
    (its cuda/*.cu glob) compiles it without them (both head dims, 8 warps)."""
    from swiftspec_mpi.gpu import step_kernel as sk
    if shutil.which("nvcc") is None:
        skip_or_fail("nvcc (the CUDA compiler) is not on PATH")
    assert 'for cu in "$ROOT"/cuda/*.cu' in (ROOT / "tools" / "compile_cuda.sh").read_text()
    variant = sk.compile_variant(64, 16)
    assert variant.split() == ["-DSTEP_HEAD_DIM=64", "-DSTEP_COMPUTE_WARPS=16"]
    assert sk.compile_variant(128, 8) == "-DSTEP_HEAD_DIM=128"
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-O3", "--cubin", "-I", str(ROOT / "cuda"),
                        *variant.split(), str(ROOT / "cuda" / "step_kernel.cu"), "-o", str(tmp_path / "s.cubin")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


def test_step_kernel_flag_and_record():
    """--step-kernel: unknown values refused; the trace's record of what ran, as analyze prints it;
    ranks sharing a GPU under MPS run the chain (time-sliced sharing keeps the kernel)."""
    from swiftspec_mpi.cli.job import mps_shared
    from swiftspec_mpi.core.config import RunConfig, validate_basic
    from swiftspec_mpi.core.errors import UserError
    from swiftspec_mpi.trace.analyze import describe_warmup
    with pytest.raises(UserError, match="--step-kernel"):
        validate_basic(RunConfig(step_kernel="megakernel"), 1)
    cell = describe_warmup({"warm_s": 1.0, "captured": 3, "prompt_graphs": 1, "prompt_buckets": 1,
                            "step_kernel": {"target": "persistent", "draft": "chain"}})
    assert cell.endswith("step kernel: target persistent, draft chain"), cell
    shared = {"shared_gpu_ranks": [[0, 1]], "mps_daemon": [True, True]}
    assert "share this GPU under MPS" in mps_shared(shared, 1)
    assert mps_shared({"shared_gpu_ranks": [[0, 1]], "mps_daemon": [False, False]}, 1) is None
    assert mps_shared({}, 0) is None


def test_shared_memory_pool_split():
    """The staged input and the weight pages share the pool: at least MIN_PAGES pages while a
    page's k's of X fit beside them, never more than the pool; the largest input whole when it
    fits (Llama-3.2-1B at N = 1: the down projection's 8192 inputs, 5 pages), else blocks of whole
    pages' k's (Llama-3-8B at N = 8: 4096 of 14336 for 4-bit); the rows 16-byte aligned, the pages
    128."""
    from swiftspec_mpi.gpu import step_kernel as sk
    assert sk.pool_split(1, [2048, 2048, 8192], sk.PAGE_K_BF16) == (16512, 5)
    # all-4-bit models stream pages of codes and scales only: 17 KB (groups of 128), 11 in flight
    assert sk.page_bytes(False, 128) == 17408 and sk.page_bytes(False, 32) == 20480
    assert sk.pool_split(1, [2048, 2048, 8192], sk.PAGE_K_Q4, 8, sk.page_bytes(False, 128)) == (16512, 11)
    xs, pages = sk.pool_split(8, [4096, 4096, 14336], sk.PAGE_K_Q4)
    assert pages == sk.MIN_PAGES and sk.x_block_k(xs, 8, 14336, sk.PAGE_K_Q4) == 4096
    for n in range(1, 33):
        for dims in ([2048, 2048, 8192], [4096, 4096, 14336], [8192, 8192, 28672], [576, 576, 1536],
                     [896, 896, 4864]):
            for pk, page in ((sk.PAGE_K_BF16, sk.PAGE_BYTES), (sk.PAGE_K_Q4, sk.PAGE_BYTES),
                             (sk.PAGE_K_Q4, sk.page_bytes(False, 128)), (sk.PAGE_K_Q4, sk.page_bytes(False, 32))):
                xs, pages = sk.pool_split(n, dims, pk, 8, page)
                assert xs % 128 == 0 and 1 <= pages <= sk.MAX_PAGES
                assert pages >= sk.MIN_PAGES or n * (2 * pk + 64) > sk.SMEM_BYTES - sk.head_bytes(8) - sk.MIN_PAGES * page
                assert sk.head_bytes(8) + xs + pages * page <= sk.SMEM_BYTES <= 227 * 1024
                assert xs >= sk.attn_scratch_bytes(n, 128)     # attention's partial O rows fit
                for k in dims:
                    kx = sk.x_block_k(xs, n, k, pk)
                    assert n * (2 * kx + 64) <= xs and (2 * kx + 64) % 16 == 0
                    assert kx == k or (kx % pk == 0 and kx >= pk)            # pages never straddle X blocks
                    if k <= max(dims) and n * (2 * max(dims) + 64) <= xs:
                        assert kx == k


# ---------------------------------------------------------------- the GEMV ring (cuda/step_kernel.cu)
# A CPU reference of the kernel's index math: run_gemv's rounds of up to 8 tiles, the loader's
# (page j, tile i) order, each warp's pages (seq = base + j * na + ti; in rounds of fewer than 5
# tiles, ks warps share each page), the X blocks; then the ring's handshake (full / empty per slot,
# every warp passing every page, the compute warps' barriers) run step by step.
WARPS = 8


def k_split(na: int) -> int:
    return 1 if na >= 5 else WARPS // (4 if na == 3 else na)


def loader_order(ntiles: int, npt: int) -> list[tuple[int, int]]:
    """(tile of the instruction, page j) by ring sequence number (the loader warp's loops)."""
    out = []
    for r0 in range(0, ntiles, WARPS):
        na = min(WARPS, ntiles - r0)
        out += [(r0 + ti, j) for j in range(npt) for ti in range(na)]
    return out


def warp_program(warp: int, ntiles: int, npt: int, ppx: int, nxb: int, base: int) -> list:
    """What one compute warp does in run_gemv, in order: ("bar",) a compute-warp barrier,
    ("page", seq, tile, j, own) a page passed (own: this warp multiplies a part of it), ("out",
    tile) the epilogue of a tile."""
    prog = []
    for r0 in range(0, ntiles, WARPS):
        na = min(WARPS, ntiles - r0)
        ks = k_split(na)
        ti, sub = warp % na, warp // na
        for xb in range(nxb):
            if r0 == 0 or nxb > 1:
                if r0 > 0 or xb > 0:
                    prog.append(("bar",))
                prog.append(("bar",))
            j_end = npt if xb == nxb - 1 else (xb + 1) * ppx
            prog += [("page", base + j * na + t, r0 + t, j, sub < ks and t == ti)
                     for j in range(xb * ppx, j_end) for t in range(na)]
        base += npt * na
        if ks > 1:
            prog.append(("bar",))
        if sub == 0:
            prog.append(("out", r0 + ti))
        if ks > 1:
            prog.append(("bar",))
    prog.append(("bar",))
    return prog


@pytest.mark.parametrize("ntiles", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 61])
@pytest.mark.parametrize("npt", [1, 2, 3, 4, 7, 28])
def test_ring_order_matches_the_loader(ntiles, npt):
    """Every (tile, page) of the instruction multiplied by its tile's ks warps (ti + na s), at the
    ring sequence number the loader filled it with; every warp passing every page once, in
    increasing sequence numbers; each tile's epilogue run once, by one warp."""
    loader = loader_order(ntiles, npt)
    assert sorted(loader) == [(t, j) for t in range(ntiles) for j in range(npt)]
    seen, arrivals, outs = {}, Counter(), Counter()
    for w in range(WARPS):
        prog = warp_program(w, ntiles, npt, ppx=npt, nxb=1, base=0)
        seqs = [e[1] for e in prog if e[0] == "page"]
        assert seqs == list(range(len(loader)))
        for e in prog:
            if e[0] == "page":
                assert loader[e[1]] == (e[2], e[3])
                arrivals[e[1]] += 1
                if e[4]:
                    seen.setdefault(e[1], set()).add(w)
            elif e[0] == "out":
                outs[e[1]] += 1
        # the barriers are the same for every warp (uniform control flow)
        assert prog.count(("bar",)) == warp_program(0, ntiles, npt, npt, 1, 0).count(("bar",))
    assert sorted(seen) == list(range(len(loader)))
    assert set(arrivals.values()) == {WARPS}
    assert outs == Counter(range(ntiles))
    for seq, ws in seen.items():
        t, j = loader[seq]
        r0 = t // WARPS * WARPS
        na = min(WARPS, ntiles - r0)
        assert ws == {(t - r0) + na * s for s in range(k_split(na))}


def run_ring(instrs: list[tuple[int, int, int, int]], npages: int) -> int:
    """The handshake of one block's GEMV instructions [(ntiles, pages a tile, pages an X block,
    X blocks)] through a ring of `npages` slots: the loader fills seq once the slot's previous
    page (seq - npages) has its 8 arrivals, a warp passes seq once filled and arrives, the
    barriers wait for all 8 warps. Whenever a warp looks at the slot of seq (fill f = seq //
    npages), the slot has had f or f + 1 fills: what makes the kernel's parity waits exact.
    Returns the pages moved; raises AssertionError on a deadlock."""
    progs, order, base = [[] for _ in range(WARPS)], [], 0
    for ntiles, npt, ppx, nxb in instrs:
        for w in range(WARPS):
            progs[w] += warp_program(w, ntiles, npt, ppx, nxb, base)
        order += loader_order(ntiles, npt)
        base = len(order)
    fills, arrived = [0] * npages, [0] * len(order)
    nxt, pc = 0, [0] * WARPS
    while True:
        moved = False
        while nxt < len(order) and (nxt < npages or arrived[nxt - npages] == WARPS):
            assert fills[nxt % npages] == nxt // npages
            fills[nxt % npages] += 1
            nxt += 1
            moved = True
        for w in range(WARPS):
            while pc[w] < len(progs[w]) and progs[w][pc[w]][0] != "bar":
                e = progs[w][pc[w]]
                if e[0] == "page":
                    f = e[1] // npages
                    assert fills[e[1] % npages] in (f, f + 1)
                    if fills[e[1] % npages] == f:
                        break
                    arrived[e[1]] += 1
                    assert arrived[e[1]] <= WARPS
                pc[w] += 1
                moved = True
        if all(pc[w] < len(progs[w]) and progs[w][pc[w]][0] == "bar" for w in range(WARPS)):
            for w in range(WARPS):
                pc[w] += 1
            moved = True
        if not moved:
            break
    assert all(pc[w] == len(progs[w]) for w in range(WARPS)), f"ring deadlock at {pc}, loader at {nxt}"
    assert all(a == WARPS for a in arrived)
    return len(order)


@pytest.mark.parametrize("npages", [1, 2, 4, 9, 10])
def test_ring_handshake_cannot_deadlock(npages):
    """A block's instructions of every kind of round (k-split, partial, several rounds), with X
    whole or in blocks, through rings of 1..10 pages: everything is consumed, nothing waits."""
    instrs = [(3, 4, 4, 1), (61, 1, 1, 1), (2, 28, 11, 3), (9, 7, 3, 3), (1, 5, 5, 1), (16, 3, 1, 3),
              (4, 28, 12, 3), (7, 2, 2, 1)]
    assert run_ring(instrs, npages) == sum(t * p for t, p, _, _ in instrs)


def test_x_blocks_cover_each_page_once():
    """X staged in blocks of kx k's: the pages the kernel runs under block xb ([xb * ppx, ...),
    the last block to the end) lie inside it, and together are every page once."""
    from swiftspec_mpi.gpu import step_kernel as sk
    for n in (1, 8, 32):
        for k in (576, 1536, 4096, 8192, 14336, 28672):
            for pk in (sk.PAGE_K_BF16, sk.PAGE_K_Q4):
                if pk == sk.PAGE_K_Q4 and k % 128:
                    continue
                xs, _ = sk.pool_split(n, [k], pk)
                xs = min(xs, sk.pool_split(n, [28672], pk)[0])         # the 70B pool: X in blocks
                kx = sk.x_block_k(xs, n, k, pk)
                npt, nxb = -(-k // pk), -(-k // kx)
                ppx = kx // pk
                pages = []
                for xb in range(nxb):
                    j_end = npt if xb == nxb - 1 else (xb + 1) * ppx
                    for j in range(xb * ppx, j_end):
                        assert xb * kx <= j * pk and min(k, (j + 1) * pk) <= min(k, (xb + 1) * kx)
                        pages.append(j)
                assert pages == list(range(npt))


def test_timeline_summary_accounts_for_the_whole_step():
    """gpu/step_timeline.py: stages are a chain, so their (gap + span) sum to the step; a stage
    whose instructions ran on all blocks side by side is 'busy' by their run time over blocks x span."""
    from swiftspec_mpi.gpu import step_timeline
    shape = ss.Shape(n_layers=2, n=1, n_heads=4, n_kv_heads=2, qkv_rows=64 * 8, hidden=256, inter2=1024,
                     vocab_rows=512)
    s = ss.build(shape, blocks=4)
    order = ss.simulate(s)
    # every stage: its instructions run in parallel for 10 us, after a 2 us gap from the previous stage
    stage_key = {}
    for i in range(len(s.instr)):
        name, layer, _ = step_timeline.stage_of(s, i)
        stage_key[i] = (name, layer)
    t = np.zeros((len(s.instr), 3), dtype=np.int64)
    clock, seen = 1000, {}
    for i in order:
        k = stage_key[i]
        if k not in seen:
            clock += 2000
            seen[k] = clock
            clock += 10000
        t[i] = (seen[k] - 500, seen[k], seen[k] + 10000)
    summ = step_timeline.summarize(s, t, op_bytes=[1000] * len(s.op_kinds))
    st = summ["stages"]
    assert list(st) == ["embed", "norm + qkv", "attention", "o", "norm + gate|up", "down", "norm + lm head"]
    assert st["norm + qkv"]["n"] == 2 and st["norm + lm head"]["n"] == 1
    assert abs(sum(r["share"] for r in st.values()) - 1) < 0.05      # + the first wait's 0.5 us
    assert st["attention"]["span_us"] == 10 and st["attention"]["gap_us"] == 2
    n_qkv = s.op_instr[0]
    assert abs(st["norm + qkv"]["busy"] - n_qkv / s.blocks) < 1e-9
    assert st["norm + qkv"]["gbs"] == 1000 / 10000 and st["attention"]["gbs"] is None
    assert "| attention | 2 | 10.00 | 2.00 |" in step_timeline.format_table(summ)
    t[3] = 0
    with pytest.raises(ValueError, match="every instruction"):
        step_timeline.summarize(s, t)


def test_timeline_phases_are_per_instruction_means():
    """step_timeline.phases: each GEMV / ATTN instruction's 8 words -> the mean µs of its phases per
    stage, and how far ahead of the compute warps the loader began a GEMV's pages."""
    from swiftspec_mpi.gpu import step_timeline as tlm
    shape = ss.Shape(n_layers=1, n=1, n_heads=4, n_kv_heads=2, qkv_rows=64 * 8, hidden=256, inter2=1024,
                     vocab_rows=512)
    s = ss.build(shape, blocks=4)
    t = np.zeros((len(s.instr), tlm.TL_WORDS), dtype=np.int64)
    for i in range(len(s.instr)):
        base = 10_000 * (i + 1)
        # wait 1 us, then phases of 2, 3, 4, 5 us (GEMV: the loader began 6 us before the run, took 7)
        t[i, [tlm.TL_WAIT, tlm.TL_RUN, tlm.TL_MARK1, tlm.TL_MARK2, tlm.TL_EPI, tlm.TL_DONE]] = \
            base + np.array([0, 1000, 3000, 6000, 10000, 15000])
        if s.instr[i, 0] == ss.GEMV:
            t[i, tlm.TL_LOAD0], t[i, tlm.TL_LOAD1] = base + 1000 - 6000, base + 1000 + 1000
    ph = tlm.phases(s, t)
    assert list(ph) == ["norm + qkv", "attention", "o", "norm + gate|up", "down", "norm + lm head"]
    assert ph["attention"] == {"n": 4, "wait": 1, "append + q": 2, "softmax": 3, "merge + store": 4,
                               "fence + signal": 5}
    g = ph["down"]
    assert g["n"] == s.op_instr[3] and (g["stage x"], g["mma"], g["loader ahead"], g["loader issue"]) == (2, 3, 6, 7)
    table = tlm.format_phases(ph)
    assert "| attention | 4 | 1.00 | 2.00 | 3.00 | 4.00 | 5.00 |" in table and "loader ahead" in table
    with pytest.raises(ValueError, match="full timeline"):
        tlm.phases(s, t[:, :3])


def test_weight_shapes_refused_unless_every_k_is_computed():
    """The step kernel floors each page's k's to whole steps (32 k's bf16, 128-k chunks 4-bit):
    gpu.step_kernel.shape_reason takes exactly the shapes whose pages multiply every k, so none is
    silently truncated. SmolLM2-135M's K = 576 (2 full bf16 pages + a partial one of 64 k's) and
    1536 run as bf16; as 4-bit, 576 is refused (its pages would multiply 512 k's)."""
    import torch

    from swiftspec_mpi.gpu import step_kernel as sk
    from swiftspec_mpi.gpu.w4a16 import W4A16Weight
    for k in range(8, 4104, 8):
        for fmt, group in (("bf16", 0), ("4-bit", 32), ("4-bit", 64), ("4-bit", 128)):
            whole = sk.page_k_computed(fmt, k) == k
            assert (sk.shape_reason(fmt, 64, k, group) is None) == whole, (fmt, k)
    assert sk.page_k_computed("bf16", 576) == 576 and sk.shape_reason("bf16", 960, 576) is None
    assert sk.page_k_computed("4-bit", 576) == 512
    assert "multiple of 128" in sk.shape_reason("4-bit", 960, 576, 32)
    assert "group 256" in sk.shape_reason("4-bit", 960, 1024, 256)
    assert "rows" in sk.shape_reason("bf16", 49160, 576)
    w = W4A16Weight(torch.zeros(960, 288, dtype=torch.uint8), torch.zeros(960, 18, dtype=torch.int32), 32)
    assert "o: in 576 (4-bit: the kernel needs a multiple of 128)" == sk.weight_reason("o", w, 576)
    assert "on the GPU" in sk.weight_reason("o", W4A16Weight(w.qweight[:, :256], w.so[:, :16], 32), 512)
    assert "on the GPU" in sk.weight_reason("o", torch.zeros(960, 576, dtype=torch.bfloat16), 576)
    assert "input is 1536" in sk.weight_reason("down", torch.zeros(960, 576, dtype=torch.bfloat16), 1536)


def test_host_layout_mirrors_the_kernel_constants():
    """gpu/step_kernel.py's head_bytes and PARAMS_BYTES equal cuda/step_kernel.cu's HEAD_BYTES and
    PARAMS_BYTES (its `constexpr int` lines evaluated in order) for 8 and 16 compute warps."""
    import re
    from swiftspec_mpi.gpu import step_kernel as sk
    src = (ROOT / "cuda" / "step_kernel.cu").read_text()
    lines = re.findall(r"^constexpr int (\w+) = ([^;]+);", src, re.M)
    for warps in (8, 16):
        env = {"STEP_COMPUTE_WARPS": warps}
        for name, expr in lines:
            env[name] = eval(expr.replace("/", "//"), {}, dict(env))
        assert env["HEAD_BYTES"] == sk.head_bytes(warps), warps
        assert env["PARAMS_BYTES"] == sk.PARAMS_BYTES and env["MAX_PAGES"] == sk.MAX_PAGES
        assert env["PAGE_BYTES"] == sk.PAGE_BYTES and env["SMEM_BYTES"] == sk.SMEM_BYTES
