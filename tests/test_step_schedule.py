"""The persistent step kernel's schedule (swiftspec_mpi/gpu/step_schedule.py) on the CPU: every
dependency met in a run of the schedule (no deadlock), every weight tile of every projection
covered exactly once, every (layer, head, row) attended exactly once, each block's list in stage
order; and cuda/step_kernel.cu compiles for sm_90 (tools/compile_cuda.sh compiles every .cu)."""
from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import skip_or_fail
from swiftspec_mpi.gpu import step_schedule as ss

ROOT = Path(__file__).resolve().parent.parent

# (layers, heads, kv heads, head_dim, hidden, intermediate, vocab)
SHAPES = {
    "llama-1b": (16, 32, 8, 64, 2048, 8192, 128256),
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
         + [("llama-8b", n, 132) for n in (1, 8)] + [("llama-70b", 8, 132)]
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
            tiles[int(w[1])].update(range(int(w[2]), int(w[2] + w[3])))
        elif w[0] == ss.ATTN:
            assert 1 <= w[7] <= ss.ATTN_ROWS
            attn.update((int(w[1]), int(w[2]), r) for r in range(int(w[3]), int(w[3] + w[7])))
    for i, (kind, _layer) in enumerate(s.op_kinds):
        assert sorted(tiles[i]) == list(range(rows[kind] // ss.TILE)) and set(tiles[i].values()) == {1}
        assert s.op_instr[i] == sum(1 for w in s.instr if w[0] == ss.GEMV and w[1] == i)
    assert len(attn) == shape.n_layers * shape.n_heads * n and set(attn.values()) == {1}
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
    """cuda/step_kernel.cu compiles (the static_asserts check the host-packed struct sizes) and
    is among the files tools/compile_cuda.sh compiles (its cuda/*.cu glob)."""
    if shutil.which("nvcc") is None:
        skip_or_fail("nvcc (the CUDA compiler) is not on PATH")
    assert 'for cu in "$ROOT"/cuda/*.cu' in (ROOT / "tools" / "compile_cuda.sh").read_text()
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-O3", "--cubin", "-I", str(ROOT / "cuda"),
                        str(ROOT / "cuda" / "step_kernel.cu"), "-o", str(tmp_path / "s.cubin")],
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
    """The staged input and the weight pages share the pool: at least 4 pages, never more than
    the pool, the largest input that fits staged (Llama-3.2-1B at N = 1: the down projection's
    8192 inputs, 9 pages)."""
    from swiftspec_mpi.gpu import step_kernel as sk
    assert sk.pool_split(1, [2048, 2048, 8192]) == (16512, 9)
    for n in (1, 2, 5, 8, 16, 32):
        for dims in ([2048, 2048, 8192], [4096, 4096, 14336], [8192, 8192, 28672], [576, 576, 1536]):
            xs, pages = sk.pool_split(n, dims)
            assert sk.MIN_PAGES <= pages <= sk.MAX_PAGES and xs % 128 == 0
            assert xs + pages * sk.PAGE_BYTES <= sk.POOL_BYTES
