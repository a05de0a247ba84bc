"""The persistent step kernel (cuda/step_kernel.cu) on a GPU `Transformer`: one launch per decode
step instead of the chain of ~9 kernels a layer.

    reason = unsupported_reason(model)     # None when the kernel takes this model
    sk = StepKernel(model)                  # tables built once (weights stay where they are)
    logits = sk.forward(tokens, positions, write_slots, mask, n_valid)   # forward_graphable's contract
    sk.check()                              # after a sync: StepKernelError if the watchdog fired

Shapes (N new tokens, 1 <= N <= 32; H hidden, V vocabulary, S = max_slots):
    tokens, positions, write_slots int64 [N]; mask bool [N, S] (columns < n_valid read);
    n_valid int32 [1]; returns float32 logits [N, V] (a static buffer of this N: the next call
    overwrites it), the new tokens' K/V written into the model's cache at write_slots.

The schedule (gpu/step_schedule.py) is built per N, the first time N is asked for; the params
block (pointers + sizes) per N and input buffers, so a CUDA graph captured over one set of input
tensors replays it. Weights: bf16 [out, in] tensors or gpu.w4a16.W4A16Weight (any mix), head bf16
or 4-bit. TP = 1 only (`unsupported_reason` says so for a group).
"""
from __future__ import annotations

import ctypes
import math
import struct

import torch

from swiftspec_mpi.gpu import step_schedule as ss
from swiftspec_mpi.gpu import step_timeline
from swiftspec_mpi.gpu.launch import function, launch, sm_count

_SOURCE = "step_kernel"
WARPS = (8, 16)             # compute warps a block the kernel is built for (STEP_COMPUTE_WARPS)
# cuda/step_kernel.cu's shared memory: a fixed head, then the pool of staged X and weight pages
PAGE_BYTES, MAX_PAGES, MIN_PAGES = 33792, 11, 4    # PAGE_BYTES: the largest page (bf16)
PARAMS_BYTES = 42 * 8      # the Params block (packed in StepKernel._params)
SMEM_BYTES = 227 * 1024


def head_bytes(warps: int) -> int:
    """cuda/step_kernel.cu's HEAD_BYTES: the k-split's partial tiles, 2 mbarriers a page, a flag,
    32 rows' 1 / rms, the Params block, the running instruction's slot (its words and an OpDesc),
    16 partial sums, X's mbarrier."""
    return -(-(warps * 16 * 32 * 4 + 2 * MAX_PAGES * 8 + 16 + 32 * 4 + PARAMS_BYTES + 8 * 4 + 11 * 8 + 16 * 4 + 8)
             // 1024) * 1024


def threads(warps: int) -> int:
    return 32 * warps + 32          # the compute warps and the loader
PAGE_K_BF16, PAGE_K_Q4 = 1024, 2048     # k's of one weight page (16 rows of a tile)


def x_block_k(xs_bytes: int, n: int, k: int, page_k: int) -> int:
    """k's of the GEMV input X [n, k] the kernel stages at a time in xs_bytes (rows of 2 kx + 64
    bytes): all k when they fit, else the largest multiple of page_k that does (x_block_k in
    cuda/step_kernel.cu)."""
    fit = (xs_bytes // n - 64) // 2
    return k if k <= fit else fit // page_k * page_k


def page_bytes(bf16: bool, min_group: int) -> int:
    """Stride of the ring's pages: a bf16 page (16 rows of 1024 k's at a 2112-byte pitch) when any
    streamed weight is bf16, else a 4-bit page: 16 KB of codes, then 16 chunks x 16 rows x
    128 / min_group scale words (17 KB for groups of 128, 20 KB for 32)."""
    return PAGE_BYTES if bf16 else 16384 + 16 * 16 * (128 // min_group) * 4


def attn_scratch_bytes(n: int, head_dim: int, warps: int = 8) -> int:
    """Bytes of the X area an attention instruction uses for its warps' partial O rows
    (run_attn's po: [warps][rows][head_dim] floats, rows <= ATTN_ROWS)."""
    return warps * min(n, ss.ATTN_ROWS) * head_dim * 4


def pool_split(n: int, input_dims: list[int], page_k: int, warps: int = 8,
               page: int = PAGE_BYTES, head_dim: int = 128) -> tuple[int, int]:
    """(bytes of staged X, weight pages of `page` bytes) of the shared-memory pool for n tokens:
    room for the largest op input [n, K] whole when it leaves MIN_PAGES pages, else all the room
    those pages leave (larger inputs are staged in blocks of whole pages' k's), and at least one
    page's k's of X (`page_k`: the largest of the model's weight formats) and attention's partial
    O rows (attn_scratch_bytes); the rest is pages."""
    pool = SMEM_BYTES - head_bytes(warps)
    room = pool - MIN_PAGES * page
    want = n * (2 * max(input_dims) + 64)
    xs = max(min(want, max(room, n * (2 * page_k + 64))), attn_scratch_bytes(n, head_dim, warps))
    xs = -(-xs // 128) * 128
    pages = min(MAX_PAGES, (pool - xs) // page)
    if pages < 1 or any(x_block_k(xs, n, k, page_k) < min(k, page_k) for k in input_dims):
        raise ValueError(f"the step kernel's shared memory cannot hold {n} rows of X beside a weight page")
    return xs, pages


MAX_TOKENS = 32
_TIMELINE_OFFSET = 19 * 8     # Params.timeline: the 20th pointer
TIMEOUT_S = 2.0             # a counter wait longer than this is a stuck schedule (watchdog)
_KIND_NAMES = {ss.K_QKV: "QKV", ss.K_O: "O", ss.K_GU: "gate|up", ss.K_DOWN: "down", ss.K_HEAD: "LM head"}


def _counter_name(c: int, n_layers: int) -> str:
    if c == ss.EMBED_DONE:
        return "embedding done"
    if c >= ss.head_counter(n_layers):
        return ["LM head done", "abort", "exit"][c - ss.head_counter(n_layers)] if c < ss.head_counter(n_layers) + 3 else "?"
    layer, which = divmod(c - 1, ss.CTR_PER_LAYER)
    names = ["QKV done", "attention done", "O done", "gate|up done", "down done"]
    return f"layer {layer} {names[which]}"


class StepKernelError(RuntimeError):
    """The step kernel's watchdog fired (a counter never reached its target) or a page never
    arrived; the message names the instruction."""


def _is_w4(w) -> bool:
    from swiftspec_mpi.gpu.w4a16 import W4A16Weight
    return isinstance(w, W4A16Weight)


def shape_reason(fmt: str, rows: int, k: int, group: int = 0) -> str | None:
    """Why the kernel's pages cannot compute a [rows, k] weight of format `fmt` ("bf16", or "4-bit"
    in groups of `group`), None when they take it whole. cuda/step_kernel.cu multiplies each page's
    k's in whole steps, flooring: 32 k's (bf16, pages of PAGE_K_BF16, the last one partial) or 128-k
    chunks (4-bit, pages of PAGE_K_Q4) with 128 / group scale words each; `page_k_computed` is that
    arithmetic. Tiles are 16 rows."""
    if rows <= 0 or rows % 16:
        return f"{rows} rows (the kernel needs a multiple of 16)"
    if fmt == "bf16":
        return None if k > 0 and k % 32 == 0 else f"in {k} (bf16: the kernel needs a multiple of 32)"
    if group not in (32, 64, 128):
        return f"4-bit group {group} (the kernel takes 32, 64 or 128)"
    return None if k > 0 and k % 128 == 0 else f"in {k} (4-bit: the kernel needs a multiple of 128)"


def page_k_computed(fmt: str, k: int) -> int:
    """k's of a [*, k] weight the kernel's pages multiply (page_of, page_mma of step_kernel.cu):
    per page kspan = min(page k's, k - k0), of which steps of 32 (bf16) or chunks of 128 (4-bit),
    floored. Equal to k exactly when shape_reason takes k."""
    page, step = (PAGE_K_BF16, 32) if fmt == "bf16" else (PAGE_K_Q4, 128)
    return sum(min(page, k - k0) // step * step for k0 in range(0, k, page))


def weight_reason(name: str, w, k: int) -> str | None:
    """Why the kernel cannot take `w` (bf16 [rows, k] CUDA tensor or W4A16Weight) as the weight of
    op `name` with k inputs, None when it can: its shape (shape_reason), then its memory."""
    fmt, group = ("4-bit", w.group) if _is_w4(w) else ("bf16", 0)
    if not (_is_w4(w) or isinstance(w, torch.Tensor) and w.dim() == 2):
        return f"{name}: not a 2-d weight"
    rows, kw = w.shape
    if kw != k:
        return f"{name}: [{rows}, {kw}], the layer's input is {k}"
    r = shape_reason(fmt, rows, k, group)
    if r is not None:
        return f"{name}: {r}"
    if _is_w4(w):
        ok = w.qweight.is_cuda and w.qweight.is_contiguous() and w.so.is_contiguous()
    else:
        ok = w.is_cuda and w.dtype == torch.bfloat16 and w.is_contiguous() and w.data_ptr() % 16 == 0
    return None if ok else f"{name}: not a contiguous, 16-byte aligned {fmt} weight on the GPU"


def unsupported_reason(model) -> str | None:
    """Why the step kernel cannot run `model` (a GPU Transformer), or None when it can."""
    if model.device.type != "cuda" or model.dtype != torch.bfloat16:
        return "the step kernel runs bf16 models on the GPU"
    if model.comm.size > 1:
        return "tensor parallelism (TP > 1) is not built into the step kernel"
    if torch.cuda.get_device_capability(model.device)[0] < 9:
        return "the step kernel needs a Hopper GPU (cp.async.bulk)"
    cfg, sh = model.cfg, model.shard
    hd, H = cfg.head_dim, cfg.hidden_size
    if hd not in (64, 128):
        return f"head_dim {hd} (the step kernel takes 64 or 128)"
    if H % 32 or sh.nh_l % sh.nkv_l:
        return f"hidden {H} / heads {sh.nh_l}:{sh.nkv_l}"
    if not model.loaded or not model.layers:
        return "the model has no weights"
    if not (isinstance(model.embed, torch.Tensor) and model.embed.dtype == torch.bfloat16
            and model.embed.is_contiguous() and model.embed.shape[1] == H):
        return "the embedding is not a bf16 [vocab, hidden] table"
    lay = model.layers[0]
    for name, w, k in (("qkv", lay.wqkv, H), ("o", lay.wo, sh.nh_l * hd), ("gate|up", lay.wgu, H),
                       ("down", lay.wd, sh.inter_l), ("head", model.head, H)):
        r = weight_reason(name, w, k)
        if r is not None:
            return r
    return None


def compile_variant(head_dim: int, warps: int) -> str:
    """The defines the kernel is compiled with for a model (launch.module's variant): its head dim
    (attention's code for that one only) and, unless 8, the compute warps a block."""
    return f"-DSTEP_HEAD_DIM={head_dim}" + ("" if warps == 8 else f" -DSTEP_COMPUTE_WARPS={warps}")


def _ptr(t) -> int:
    return 0 if t is None else int(t.data_ptr())


def _op_words(w, bias, norm_w, kind: int, layer: int, n_instr: int) -> bytes:
    """One OpDesc (cuda/step_kernel.cu): 4 pointers and 7 int64; norm_w: the RMSNorm weight of the
    op's input x (QKV, gate|up, head), else None."""
    if _is_w4(w):
        rows, k = w.shape
        ptrs = (_ptr(w.qweight), _ptr(w.so))
        fmt, group = 1, w.group
    else:
        rows, k = w.shape
        ptrs = (_ptr(w), 0)
        fmt, group = 0, 0
    return struct.pack("<4Q7q", ptrs[0], ptrs[1], _ptr(bias), _ptr(norm_w), rows, k, fmt, group, kind,
                       layer, n_instr)


class _PerN:
    """The schedule, counters, activations and params blocks of one N."""

    def __init__(self, sk: "StepKernel", n: int):
        m, dev = sk.model, sk.model.device
        cfg, sh = m.cfg, m.shard
        hd = cfg.head_dim
        self.n = n
        self.shape = ss.Shape(len(m.layers), n, sh.nh_l, sh.nkv_l, (sh.nh_l + 2 * sh.nkv_l) * hd,
                              cfg.hidden_size, 2 * sh.inter_l, int(m.head.shape[0]))
        self.schedule = ss.build(self.shape, sk.blocks)
        ws = [m.head] + [w for l in m.layers for w in (l.wqkv, l.wo, l.wgu, l.wd)]
        w4 = [w for w in ws if _is_w4(w)]
        self.page_bytes = page_bytes(len(w4) < len(ws), min((w.group for w in w4), default=128))
        self.xs_bytes, self.npages = pool_split(n, [cfg.hidden_size, sh.nh_l * hd, sh.inter_l],
                                                PAGE_K_Q4 if w4 else PAGE_K_BF16, sk.warps, self.page_bytes, hd)
        s = self.schedule
        self.instr = torch.from_numpy(s.instr.copy()).to(dev)
        self.block_start = torch.from_numpy(s.block_start.copy()).to(dev)
        self.counters = torch.zeros(s.n_counters, dtype=torch.int32, device=dev)
        # op table: 4 per layer, then the head
        words = []
        L = len(m.layers)
        for li, lay in enumerate(m.layers):
            words.append(_op_words(lay.wqkv, lay.bqkv, lay.ln1, ss.K_QKV, li, s.op_instr[4 * li]))
            words.append(_op_words(lay.wo, lay.bo, None, ss.K_O, li, s.op_instr[4 * li + 1]))
            words.append(_op_words(lay.wgu, None, lay.ln2, ss.K_GU, li, s.op_instr[4 * li + 2]))
            words.append(_op_words(lay.wd, None, None, ss.K_DOWN, li, s.op_instr[4 * li + 3]))
        words.append(_op_words(m.head, None, m.norm, ss.K_HEAD, L, s.op_instr[4 * L]))
        self.ops = torch.frombuffer(bytearray(b"".join(words)), dtype=torch.uint8).to(dev)
        kw = dict(dtype=torch.bfloat16, device=dev)
        H = cfg.hidden_size
        self.x = torch.empty(n, H, **kw)
        self.qkv = torch.empty(n, self.shape.qkv_rows, **kw)
        self.o = torch.empty(n, sh.nh_l * hd, **kw)
        self.h = torch.empty(n, sh.inter_l, **kw)          # SwiGLU's output, down's input
        self.logits = torch.empty(n, self.shape.vocab_rows, dtype=torch.float32, device=dev)
        # attention split over key ranges: per range, token row and head (max, sum) then O [hd]
        self.attn_splits = ss.attn_splits(n, sh.nh_l, sk.blocks)
        self.attn_part = torch.empty(self.attn_splits * n * sh.nh_l * (hd + 2), dtype=torch.float32, device=dev)
        self.params: dict[tuple, torch.Tensor] = {}
        self.timeline: torch.Tensor | None = None     # int64 [n_instr, TL_WORDS] while profiling (record_timeline)


class StepKernel:
    """The persistent step kernel bound to one GPU Transformer (module docstring)."""

    def __init__(self, model, blocks: int | None = None, timeout_s: float = TIMEOUT_S, warps: int = 8):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        if warps not in WARPS:
            raise ValueError(f"the step kernel is built for {WARPS} compute warps, not {warps}")
        self.model = model
        self.warps = warps
        self.variant = compile_variant(model.cfg.head_dim, warps)    # launch.module's defines
        self.blocks = int(blocks or sm_count())
        self.timeout_ns = int(timeout_s * 1e9)
        dev = model.device
        # host-mapped watchdog record: [0, 8) the first report, then (instr + 1, counter, value,
        # target) of every block left waiting
        self.err = torch.zeros(8 + 4 * self.blocks, dtype=torch.int32, pin_memory=True)
        layer_words = b"".join(struct.pack("<4Q", _ptr(l.ln1), _ptr(l.k_cache), _ptr(l.v_cache), 0)
                               for l in model.layers)
        self.layers = torch.frombuffer(bytearray(layer_words), dtype=torch.uint8).to(dev)
        self.per_n: dict[int, _PerN] = {}

    def takes(self, n: int) -> bool:
        return 1 <= n <= MAX_TOKENS

    def state(self, n: int) -> _PerN:
        st = self.per_n.get(n)
        if st is None:
            st = self.per_n[n] = _PerN(self, n)
        return st

    def _params(self, st: _PerN, tokens, positions, write_slots, mask, n_valid) -> torch.Tensor:
        key = (tokens.data_ptr(), positions.data_ptr(), write_slots.data_ptr(), mask.data_ptr(),
               n_valid.data_ptr(), mask.stride(0))
        p = st.params.get(key)
        if p is not None:
            return p
        m = self.model
        cfg, sh = m.cfg, m.shard
        ptrs = [tokens, positions, write_slots, mask, n_valid, st.x, st.qkv, st.o, st.h, st.logits,
                st.counters, self.err, st.instr, st.block_start, st.ops, self.layers, m.embed,
                m.rope_cos, m.rope_sin, st.timeline, st.attn_part]
        ints = [st.n, cfg.hidden_size, sh.nh_l, sh.nkv_l, cfg.head_dim, sh.inter_l, st.shape.vocab_rows,
                len(m.layers), m.max_slots, m.rope_cos.shape[0], mask.stride(0), st.shape.qkv_rows,
                m.embed.shape[0], st.schedule.n_counters, self.timeout_ns, st.npages, st.xs_bytes, st.attn_splits,
                st.page_bytes]
        dbl = [float(cfg.rms_norm_eps), 1.0 / math.sqrt(cfg.head_dim) * math.log2(math.e)]
        raw = struct.pack(f"<{len(ptrs)}Q{len(ints)}q{len(dbl)}d", *[_ptr(t) for t in ptrs], *ints, *dbl)
        assert len(raw) == PARAMS_BYTES, "cuda/step_kernel.cu's Params"
        p = st.params[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(m.device)
        return p

    def record_timeline(self, n: int, on: bool = True) -> torch.Tensor | None:
        """Profile the schedule of N = n: from the next launch (graph replays included) every
        instruction writes (wait from, run from, done at, two marks inside it, the epilogue's end,
        the loader's first and last page issued), globaltimer ns, into the returned int64
        [n_instr, TL_WORDS] (instruction order of `state(n).schedule`; gpu/step_timeline.py reads
        it; cuda/step_kernel.cu's enum Timeline). on=False stops it (the launches then write nothing)."""
        st = self.state(n)
        st.timeline = torch.zeros(len(st.schedule.instr), step_timeline.TL_WORDS, dtype=torch.int64,
                                  device=self.model.device) if on else None
        word = torch.frombuffer(bytearray(struct.pack("<Q", _ptr(st.timeline))), dtype=torch.uint8)
        for p in st.params.values():      # the params blocks graphs hold: rewritten in place
            p[_TIMELINE_OFFSET:_TIMELINE_OFFSET + 8].copy_(word)
        return st.timeline

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                mask: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        """Transformer.forward_graphable's contract (module docstring); one kernel launch."""
        n = int(tokens.shape[0])
        if not self.takes(n):
            raise ValueError(f"the step kernel takes 1..{MAX_TOKENS} tokens, not {n}")
        if mask.dtype not in (torch.bool, torch.uint8) or mask.stride(1) != 1 or mask.shape[0] != n:
            raise ValueError(f"mask must be bool/uint8 [{n}, S] with contiguous rows")
        st = self.state(n)
        params = self._params(st, tokens, positions, write_slots, mask, n_valid)
        mb = 1 if n <= 8 else 2 if n <= 16 else 4
        dev = self.model.device
        f = function(_SOURCE, self.variant, f"step_kernel_mb{mb}", dev.index if dev.index is not None else
                     torch.cuda.current_device(), dyn_smem=SMEM_BYTES)
        launch(f, (self.blocks, 1, 1), threads(self.warps), SMEM_BYTES, torch.cuda.current_stream().cuda_stream,
               [ctypes.c_uint64(params.data_ptr())])
        vocab = self.model.cfg.vocab_size
        return st.logits if st.logits.shape[1] == vocab else st.logits[:, :vocab]

    def check(self, sync: bool = True) -> None:
        """Raise StepKernelError if the watchdog fired since the last check (and clear it)."""
        fault = None
        if sync:
            try:
                torch.cuda.synchronize(self.model.device)
            except RuntimeError as ex:      # a trap (code 2): the record is in host memory
                fault = ex
        e = self.err.numpy()
        if fault is not None and e[0] == 0:
            raise fault
        if e[0] == 0:
            return
        code, instr, block, ctr, value, target = (int(v) for v in e[:6])
        waits = e[8:].reshape(-1, 4).copy()
        e[:] = 0
        if code == 1:      # the earliest stuck wait (the smallest counter: the earliest stage)
            stuck = [(int(w[1]), int(w[0]) - 1, b, int(w[2]), int(w[3])) for b, w in enumerate(waits) if w[0] > 0]
            if stuck:
                ctr, instr, block, value, target = min(stuck)
        raise StepKernelError(self.describe_failure(code, instr, block, ctr, value, target))

    def describe_failure(self, code: int, instr: int, block: int, ctr: int, value: int, target: int) -> str:
        what = self.describe(instr)
        if code == 2:
            return f"step kernel: the weight pages of instruction {instr} ({what}) never arrived (block {block})"
        return (f"step kernel watchdog: instruction {instr} ({what}) on block {block} waited over "
                f"{self.timeout_ns / 1e9:g} s for counter {ctr} ({_counter_name(ctr, len(self.model.layers))}) "
                f"= {value} to reach {target}")

    def describe(self, instr: int) -> str:
        """Human words for global instruction `instr` of the last schedule that holds it."""
        for st in self.per_n.values():
            s = st.schedule
            if 0 <= instr < len(s.instr):
                w = s.instr[instr]
                if w[0] == ss.EMBED:
                    return f"N={st.n} embedding"
                if w[0] == ss.ATTN:
                    rows, split, splits = ss.attn_fields(int(w[7]))
                    return (f"N={st.n} layer {w[1]} attention, head {w[2]}, rows {w[3]}..{w[3] + rows - 1}"
                            + (f", keys {split + 1} of {splits}" if splits > 1 else ""))
                kind, layer = s.op_kinds[w[1]]
                if kind == ss.K_GU:
                    return f"N={st.n} layer {layer} gate|up tile pairs {w[2]}..{w[2] + w[3] // 2 - 1}"
                return f"N={st.n} layer {layer} {_KIND_NAMES[kind]} tiles {w[2]}..{w[2] + w[3] - 1}"
        return "unknown"

    def break_wait(self, n: int, instr: int) -> None:
        """Testing the watchdog: make instruction `instr` of N = n wait for a counter value that
        never comes (in the device's instruction table; `repair(n)` puts the schedule back)."""
        self.state(n).instr[instr, 5] = 1 << 30

    def repair(self, n: int) -> None:
        st = self.state(n)
        st.instr.copy_(torch.from_numpy(st.schedule.instr.copy()))


def attach(model, mode: str, chain_reason: str | None = None) -> tuple[str, str | None]:
    """`--step-kernel` on a GPU Transformer: mode "persistent" sets `model.step_kernel` when the
    kernel runs the model, "chain" never. -> (what runs: "persistent" or "chain", why the chain
    when persistent was asked, else None). `chain_reason`: a caller's reason for the chain (GPU
    shared under MPS)."""
    if mode == "chain":
        return "chain", None
    from swiftspec_mpi.gpu import launch
    reason = chain_reason or unsupported_reason(model)
    if reason is None and not launch.available():
        reason = "CuPy, nvcc or a Hopper GPU is missing"
    if reason is not None:
        return "chain", reason
    model.step_kernel = StepKernel(model)
    return "persistent", None
