"""The persistent step kernel's schedule (cuda/step_kernel.cu): which block runs which instruction,
and which counter each one waits on and signals. Pure Python + numpy (no GPU): built once per
model shape and N, checked by the CPU tests (`simulate`).

Instruction words (int32 x INSTR_WORDS):
    [op, a, b, c, wait_counter, wait_target, signal_counter, d]
    EMBED (op 0): nothing else (block 0).
    GEMV  (op 1): a = op index (ops table: 4 a layer, QKV, O, gate|up, down, then the head),
                  b = first 16-row tile, c = tiles; gate|up: b = first pair of tiles (gate
                  tile b + i and up tile inter2 / 32 + b + i, the same rows), c = tiles (2 a pair),
                  so that its epilogue writes SwiGLU's h (round_tile in cuda/step_kernel.cu).
    ATTN  (op 2): a = layer, b = query head, c = first row, d = attn_word(rows <= ATTN_ROWS, key
                  split, splits): this instruction's share of the keys [0, n_valid) is range
                  `split` of `splits` equal ones (splits > 1 when the (head, rows) pairs alone would
                  leave blocks idle, i.e. small N: the partial softmax sums meet in O's X staging).

Counters (int32, zero at launch, zeroed again by the last block out): 0 the embedding written;
layer l at 1 + 5 l: +0 QKV instructions done, +1 attention done, +2 O done, +3 gate|up done,
+4 down done; 1 + 5 L the head's instructions done; then the abort flag and the exit count.
QKV, gate|up and the head normalize x themselves while staging it, so they wait on the whole
previous down (the embedding) or O op.

Every instruction waits only on counters of earlier stages (stage order: embed, then per layer
QKV, attention, O, gate|up, down, then the head), each block's list is in stage order and all
blocks are resident, so the schedule cannot deadlock: the unfinished instructions of the
earliest unfinished stage always have what they wait for (`simulate` checks it).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INSTR_WORDS = 8
EMBED, GEMV, ATTN = 0, 1, 2
K_QKV, K_O, K_GU, K_DOWN, K_HEAD = 0, 1, 2, 3, 4
CTR_PER_LAYER = 5
QKV_DONE, ATTN_DONE, O_DONE, GU_DONE, DOWN_DONE = range(5)
EMBED_DONE = 0
ATTN_ROWS = 8          # token rows of one attention instruction at most (a warp per row and key split)
TILE = 16              # output rows of one GEMV tile


@dataclass(frozen=True)
class Shape:
    """What the schedule depends on: layers, N tokens, heads, the projections' output rows."""
    n_layers: int
    n: int
    n_heads: int
    n_kv_heads: int
    qkv_rows: int          # (nh + 2 nkv) * head_dim
    hidden: int
    inter2: int            # 2 * intermediate (gate | up rows)
    vocab_rows: int        # the head's rows


@dataclass
class Schedule:
    instr: np.ndarray          # int32 [n_instr, INSTR_WORDS]
    block_start: np.ndarray    # int32 [blocks + 1]: block b runs instr[block_start[b]:block_start[b+1]]
    n_counters: int
    op_instr: list             # per op index: how many instructions it has (its consumers' wait target)
    op_kinds: list             # per op index: (kind, layer)

    @property
    def blocks(self) -> int:
        return len(self.block_start) - 1


def ctr(layer: int, which: int) -> int:
    return 1 + CTR_PER_LAYER * layer + which


def head_counter(n_layers: int) -> int:
    return 1 + CTR_PER_LAYER * n_layers


def n_counters(n_layers: int) -> int:
    return CTR_PER_LAYER * n_layers + 4


def split_tiles(tiles: int, blocks: int, offset: int) -> list[tuple[int, int, int]]:
    """tiles 16-row tiles over `blocks` blocks as contiguous runs: [(block, first tile, count)],
    the blocks that get one more tile than the others starting at `offset` (rotating the spare
    work between ops)."""
    base, extra = divmod(tiles, blocks)
    out, t = [], 0
    for i in range(blocks):
        b = (offset + i) % blocks
        c = base + (1 if i < extra else 0)
        if c:
            out.append((b, t, c))
            t += c
    return out


def attn_rows(n: int, n_heads: int, blocks: int) -> int:
    """Token rows of one attention instruction: few enough that the (head, rows) instructions
    fill the blocks (the 8 warps of one then split the keys of its rows), at most ATTN_ROWS."""
    return max(1, min(ATTN_ROWS, -(-n * n_heads // blocks)))


MAX_SPLITS = 16         # key ranges of one (head, rows) attention pair at most


def attn_splits(n: int, n_heads: int, blocks: int) -> int:
    """Key ranges each (head, rows) pair of attention is split into: as many as keep every block
    busy (Llama-3.2-1B at N = 1: 32 heads x 4 = 128 instructions on 132 blocks), at least 1."""
    pairs = n_heads * -(-n // attn_rows(n, n_heads, blocks))
    return max(1, min(MAX_SPLITS, blocks // pairs))


def attn_word(rows: int, split: int, splits: int) -> int:
    """Word d of an ATTN instruction: rows | split << 8 | splits << 16 (attn_fields reads it)."""
    return rows | split << 8 | splits << 16


def attn_fields(d: int) -> tuple[int, int, int]:
    """(rows, split, splits) of an ATTN instruction's word d."""
    return d & 0xFF, (d >> 8) & 0xFF, d >> 16


def instr_tiles(kind: int, rows: int, b: int, c: int, warps: int = 8) -> list[list[int]]:
    """The op tiles a GEMV instruction (words b, c) computes, round by round (rounds of up to
    `warps` tiles, one a warp; round_tile in cuda/step_kernel.cu): the run b .. b + c - 1, except
    gate|up (rows = its 2 I rows), whose round holds the gate tiles of its pairs, then the up tiles
    of the same rows (I / 16 tiles further)."""
    out = []
    for r0 in range(0, c, warps):
        na = min(warps, c - r0)
        if kind != K_GU:
            out.append([b + r0 + i for i in range(na)])
        else:
            p0 = b + r0 // 2
            gate = [p0 + i for i in range(na // 2)]
            out.append(gate + [rows // (2 * TILE) + t for t in gate])
    return out


def build(shape: Shape, blocks: int) -> Schedule:
    """The schedule of one step of `shape` over `blocks` resident blocks."""
    if shape.n < 1 or shape.n > 32:
        raise ValueError(f"the step kernel takes 1..32 tokens, not {shape.n}")
    for name, rows, unit in (("qkv", shape.qkv_rows, TILE), ("hidden", shape.hidden, TILE),
                             ("gate|up", shape.inter2, 2 * TILE), ("head", shape.vocab_rows, TILE)):
        if rows % unit:
            raise ValueError(f"the step kernel needs {name} rows a multiple of {unit}, not {rows}")
    per_block: list[list[list[int]]] = [[] for _ in range(blocks)]
    L = shape.n_layers
    ops_instr, op_kinds = [], []
    rot = 0

    def gemv(op_index: int, rows: int, wait: tuple[int, int], sig: int, pairs: bool = False) -> int:
        nonlocal rot
        per = 2 if pairs else 1                 # tiles a unit of work
        runs = split_tiles(rows // (TILE * per), blocks, rot)
        rot = (rot + len(runs)) % blocks
        for b, t0, c in runs:
            per_block[b].append([GEMV, op_index, t0, c * per, wait[0], wait[1], sig, 0])
        return len(runs)

    per_block[0].append([EMBED, 0, 0, 0, -1, 0, EMBED_DONE, 0])
    x_ready = (EMBED_DONE, 1)                  # x as the next QKV (the head) normalizes it
    for l in range(L):
        base = 4 * l
        n_qkv = gemv(base + 0, shape.qkv_rows, x_ready, ctr(l, QKV_DONE))
        n_attn = 0
        rows = attn_rows(shape.n, shape.n_heads, blocks)
        splits = attn_splits(shape.n, shape.n_heads, blocks)
        for hq in range(shape.n_heads):
            for r0 in range(0, shape.n, rows):
                for sp in range(splits):
                    b = rot % blocks
                    rot += 1
                    per_block[b].append([ATTN, l, hq, r0, ctr(l, QKV_DONE), n_qkv, ctr(l, ATTN_DONE),
                                         attn_word(min(rows, shape.n - r0), sp, splits)])
                    n_attn += 1
        n_o = gemv(base + 1, shape.hidden, (ctr(l, ATTN_DONE), n_attn), ctr(l, O_DONE))
        n_gu = gemv(base + 2, shape.inter2, (ctr(l, O_DONE), n_o), ctr(l, GU_DONE), pairs=True)
        n_down = gemv(base + 3, shape.hidden, (ctr(l, GU_DONE), n_gu), ctr(l, DOWN_DONE))
        x_ready = (ctr(l, DOWN_DONE), n_down)
        ops_instr += [n_qkv, n_o, n_gu, n_down]
        op_kinds += [(K_QKV, l), (K_O, l), (K_GU, l), (K_DOWN, l)]
    n_head = gemv(4 * L, shape.vocab_rows, x_ready, head_counter(L))
    ops_instr.append(n_head)
    op_kinds.append((K_HEAD, L))
    starts = np.zeros(blocks + 1, dtype=np.int32)
    starts[1:] = np.cumsum([len(x) for x in per_block])
    rows = [w for lst in per_block for w in lst]
    instr = np.asarray(rows, dtype=np.int32).reshape(-1, INSTR_WORDS)
    return Schedule(instr, starts, n_counters(L), ops_instr, op_kinds)


def simulate(s: Schedule) -> list[int]:
    """Run the schedule on the host as the kernel would (each block in list order, an instruction
    starting once its counter reached the target) and return the order in which the instructions finished. Raises RuntimeError on a
    deadlock (blocks left waiting with nothing able to run) or a wait that could never be met."""
    counters = [0] * s.n_counters
    pos = [int(s.block_start[b]) for b in range(s.blocks)]
    ends = [int(s.block_start[b + 1]) for b in range(s.blocks)]
    done: list[int] = []
    progress = True
    while progress:
        progress = False
        for b in range(s.blocks):
            while pos[b] < ends[b]:
                w = s.instr[pos[b]]
                if w[4] >= 0 and counters[w[4]] < w[5]:
                    break
                counters[w[6]] += 1
                done.append(pos[b])
                pos[b] += 1
                progress = True
    stuck = [(b, pos[b]) for b in range(s.blocks) if pos[b] < ends[b]]
    if stuck:
        b, i = stuck[0]
        w = s.instr[i]
        raise RuntimeError(f"schedule deadlock: block {b} waits at instruction {i} on counter {w[4]} "
                           f"= {counters[w[4]]} < {w[5]}")
    return done
