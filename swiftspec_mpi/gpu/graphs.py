"""CUDA graphs for the decode-sized forwards (the verify tree, the draft's w leaves, one token).

`GraphedModel` wraps a GPU `Transformer` and keeps its interface (forward, compact_kv, cfg,
max_slots, device, comm). A forward of N new tokens (N <= max_graph_tokens) replays a graph of
`Transformer.forward_graphable` captured once for that N: the inputs are written into one
pinned host buffer, which the graph itself copies to its static device twin as its first node
(`_Static`), the context length reaches the fused tree-attention kernel as a device scalar, and
nothing is allocated. Larger N runs eagerly. Prompts have their own graphs (`_PromptGraph`, one
per padded prompt length that the warm-up prepared, `forward_prompt`), or run eagerly.

What the engine reads back can be reduced inside the same graph, so that a step costs one
launch and one sync, the result copied into pinned host memory by the graph's last node:
  - `forward_argmax`: the argmax token of each row (greedy verification), 8 bytes a row;
  - `forward_topk_logprobs`: the top-k of log_softmax(logits) of each row (the draft's tree
    expansion), values and indices.
The same functions as the eager read of the logits (`_argmax`, `_topk_logprobs`: one pass of
fused_ops.logits_topk on a GPU), so the same results.
"""
from __future__ import annotations

import numpy as np
import torch


def _host(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (a device tensor is copied to the host first)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


IN_GRAPH_COPY_MAX = 1 << 20      # bytes of inputs a graph copies itself (n x max_slots mask + ints)


def step_input_layout(n: int, max_slots: int) -> tuple[int, int, int]:
    """Byte layout of one step's inputs for n tokens: (int64 words, mask offset, total bytes).
    Words [0, n) tokens, [n, 2n) positions, [2n, 3n) write slots, 3n the context length; the
    bool mask [n, max_slots] starts at the next 16-byte boundary."""
    words = 3 * n + 1
    mask_off = -(-8 * words // 16) * 16
    return words, mask_off, mask_off + n * max_slots


def pack_step_inputs(ints: np.ndarray, mask: np.ndarray, tokens, positions, start: int, step_mask) -> None:
    """Write one step's inputs into the int64 words and the bool mask of step_input_layout:
    tokens / positions [n] (CPU tensors or arrays), write slots start .. start + n - 1, context
    length S = start + n (read by the attention kernel as the int64's low 32 bits), mask rows
    [n, S] into mask[:, :S] (columns >= S are left as they are: the kernels read < S only)."""
    n = mask.shape[0]
    S = start + n
    ints[:n] = _host(tokens) if isinstance(tokens, torch.Tensor) else tokens
    ints[n:2 * n] = _host(positions) if isinstance(positions, torch.Tensor) else positions
    ints[2 * n:3 * n] = np.arange(start, S)
    ints[3 * n] = S
    mask[:, :S] = _host(step_mask) if isinstance(step_mask, torch.Tensor) else step_mask


class _Static:
    """Static buffers and the captured graph for one N and one read-back (`reduce`: None for
    the logits, ("argmax",) or ("topk", k)).

    The inputs live in one pinned host buffer and its device twin: tokens [0, n), positions
    [n, 2n), write slots [2n, 3n) and the context length (3n) as int64 (the attention kernel
    reads the length as the int64's low 32 bits; both sides are little-endian), then the mask
    [n, max_slots] as bytes. Up to IN_GRAPH_COPY_MAX bytes, the graph itself begins with the copy
    of the whole buffer and ends with the copy of the reduction's result into pinned host memory,
    so a step is: numpy writes, one graph launch, one sync. Larger buffers (long contexts, many
    tokens) are copied from the host before the launch, the mask only up to the context length."""

    def __init__(self, model, n: int, reduce: tuple | None):
        dev, S = model.device, model.max_slots
        self.n, self.S, self.reduce = n, S, reduce
        words, self.mask_off, self.nbytes = step_input_layout(n, S)
        ni = 8 * words
        self.in_graph_copy = self.nbytes <= IN_GRAPH_COPY_MAX
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=dev)
        self.ints_host = self.host[:ni].view(torch.int64)
        self.mask_host = self.host[self.mask_off:].view(torch.bool).view(n, S)
        self.ints_np, self.mask_np = self.ints_host.numpy(), self.mask_host.numpy()
        self.ints = self.dev[:ni].view(torch.int64)
        self.mask = self.dev[self.mask_off:].view(torch.bool).view(n, S)
        self.n_valid = self.ints[3 * n:].view(torch.int32)[:1]
        self.graph = torch.cuda.CUDAGraph()
        self.done = torch.cuda.Event()             # the last replay (and its copies) finished
        self.logits = None
        self.outs: list[torch.Tensor] = []         # the reduction's results (graph outputs)
        self.out_host: list[torch.Tensor] = []     # their pinned host copies

    def run_eager(self, model):
        n = self.n
        logits = model.forward_graphable(self.ints[:n], self.ints[n:2 * n], self.ints[2 * n:3 * n],
                                         self.mask, self.n_valid)
        if self.reduce is None:
            return logits, []
        if self.reduce[0] == "argmax":
            return logits, [_argmax(logits)]
        return logits, list(_topk_logprobs(logits, self.reduce[1]))

    def copy_in(self, stream: int) -> None:
        """The whole input buffer, host -> device (inside the graph, or before it)."""
        from swiftspec_mpi.gpu.kernels import memcpy_async
        memcpy_async(self.dev.data_ptr(), self.host.data_ptr(), self.nbytes, stream)

    def copy_out(self, stream: int) -> None:
        from swiftspec_mpi.gpu.kernels import memcpy_async
        for h, t in zip(self.out_host, self.outs):
            memcpy_async(h.data_ptr(), t.data_ptr(), t.numel() * t.element_size(), stream)

    def fill(self, tokens, positions, start: int, mask) -> None:
        """The inputs of one step into the pinned buffer (after the previous replay read it)."""
        self.done.synchronize()
        pack_step_inputs(self.ints_np, self.mask_np, tokens, positions, start, mask)

    def run(self, start: int) -> None:
        """Replay (copies included when in the graph); the host copy and the read-back when not."""
        stream = torch.cuda.current_stream()
        if not self.in_graph_copy:
            S = start + self.n
            self.ints.copy_(self.ints_host, non_blocking=True)
            self.mask[:, :S].copy_(self.mask_host[:, :S], non_blocking=True)
        self.graph.replay()
        if not self.in_graph_copy:
            self.copy_out(stream.cuda_stream)
        self.done.record(stream)


class _PromptGraph:
    """A captured prompt forward of m tokens into slots [0, m): `Transformer.forward` with
    causal=True (SDPA's causal kernel) and one logits row, which is not read. The tokens and
    that row's index live in one pinned int64 buffer [m + 1] copied to its device twin before
    each replay. Prompt graphs share one memory pool: nothing a replay leaves in it is read
    afterwards (the logits are discarded; the KV goes to the model's own cache), and replays
    run one at a time on one stream, so any order is safe."""

    def __init__(self, model, m: int, pool):
        dev = model.device
        self.m = m
        self.host = torch.zeros(m + 1, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(m + 1, dtype=torch.int64, device=dev)
        self.positions = torch.arange(m, dtype=torch.int64, device=dev)
        self.done = torch.cuda.Event()
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                 # warm up (cuBLAS / SDPA choices, workspaces)
                self._forward(model)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.current_stream().synchronize()
        with torch.cuda.graph(self.graph, pool=pool):
            self._forward(model)

    def _forward(self, model):
        model.forward(self.dev[:self.m], self.positions, 0, None, logits_rows=self.dev[self.m:], causal=True)

    def run(self, ids, row: int) -> None:
        """ids: m token ids (the prompt, padded); row: the logits row computed (not read)."""
        self.done.synchronize()                # the previous replay's copy read the buffer
        self.host_np[:self.m] = ids
        self.host_np[self.m] = row
        self.dev.copy_(self.host, non_blocking=True)
        self.graph.replay()
        self.done.record(torch.cuda.current_stream())


# prompt lengths up to which the warm-up captures a prompt graph per bucket (above: eager; the
# 8B prompt forward is host-bound below ~300 tokens and GPU-bound from ~1k)
PROMPT_GRAPH_MAX = 1024


class GraphedModel:
    """A GPU `Transformer` whose decode-sized forwards replay CUDA graphs, one per (N, read-back).

    A graph is captured the first time its (N, read-back) is asked for. The engine asks for
    every shape its loops can use while it warms up (`cli.loading.warm_graphs`), then calls `freeze()`:
    a capture after that happened inside a request, which it should not (a capture costs tens
    of milliseconds and allocates), so it is counted in `late_captures` (the trace's ranks
    table reports it). Prompts (`forward_prompt`) replay a prompt graph of their padded length
    when the warm-up captured one (`capture_prompt`), else run eagerly; never captured in a request."""

    def __init__(self, model, max_graph_tokens: int = 64):
        self.model = model
        self.max_graph_tokens = max_graph_tokens
        self.static: dict[tuple, _Static] = {}
        self.prompt_graphs: dict[int, _PromptGraph] = {}
        self.prompt_pool = None
        self.frozen = False
        self.late_captures = 0

    def freeze(self) -> None:
        """Warm-up is over: from now on a capture is counted as late (it still happens)."""
        self.frozen = True

    @torch.inference_mode()
    def capture_prompt(self, m: int) -> None:
        """Capture the prompt graph of m tokens (warm-up only; it writes KV slots [0, m))."""
        if m not in self.prompt_graphs:
            if self.prompt_pool is None:
                self.prompt_pool = torch.cuda.graph_pool_handle()
            self.prompt_graphs[m] = _PromptGraph(self.model, m, self.prompt_pool)

    @torch.inference_mode()
    def forward_prompt(self, ids, row: int) -> None:
        """Transformer.forward_prompt, replayed from the prompt graph of len(ids) tokens when
        the warm-up captured one."""
        pg = self.prompt_graphs.get(len(ids))
        if pg is None:
            self.model.forward_prompt(ids, row)
        else:
            pg.run(ids, row)

    def __getattr__(self, name):          # cfg, max_slots, device, comm, dtype, compact_kv ...
        return getattr(self.model, name)

    def _capture(self, n: int, reduce: tuple | None) -> _Static:
        st = _Static(self.model, n, reduce)
        S = self.model.max_slots
        # capture with harmless inputs: the last n slots are scratch at capture time
        st.ints_np[2 * n:3 * n] = np.arange(S - n, S)
        st.ints_np[3 * n] = S
        st.mask_np[:, :] = True
        st.dev.copy_(st.host)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                 # warm up (kernel compile, cuBLAS handles)
                _, outs = st.run_eager(self.model)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.current_stream().synchronize()
        st.out_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outs]
        with torch.cuda.graph(st.graph):
            stream = torch.cuda.current_stream().cuda_stream
            if st.in_graph_copy:
                st.copy_in(stream)
            st.logits, st.outs = st.run_eager(self.model)
            if st.in_graph_copy:
                st.copy_out(stream)
        return st

    def _replay(self, tokens, positions, start: int, mask, reduce: tuple | None) -> _Static:
        n = int(tokens.shape[0])
        st = self.static.get((n, reduce))
        if st is None:
            st = self.static[(n, reduce)] = self._capture(n, reduce)
            self.late_captures += self.frozen
        st.fill(tokens, positions, start, mask)
        st.run(start)
        if st.out_host:
            st.done.synchronize()
        return st

    @torch.inference_mode()
    def forward(self, tokens, positions, start: int, mask, logits_rows=None):
        """Same contract as Transformer.forward (mask [N, start+N] on the host or device)."""
        if int(tokens.shape[0]) > self.max_graph_tokens:
            return self.model.forward(tokens, positions, start, mask, logits_rows)
        logits = self._replay(tokens, positions, start, mask, None).logits
        if logits_rows is not None:
            logits = logits.index_select(0, logits_rows.to(logits.device))
        return logits

    @torch.inference_mode()
    def forward_argmax(self, tokens, positions, start: int, mask) -> np.ndarray:
        """Transformer.forward's arguments -> int64 [N]: the argmax token of each row's logits,
        computed inside the graph (one launch, one sync, 8 bytes a row read back)."""
        if int(tokens.shape[0]) > self.max_graph_tokens:
            return logits_argmax(self.model.forward(tokens, positions, start, mask))
        st = self._replay(tokens, positions, start, mask, ("argmax",))
        return st.out_host[0].numpy().copy()

    @torch.inference_mode()
    def forward_topk_logprobs(self, tokens, positions, start: int, mask, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Transformer.forward's arguments -> (ids int64 [N, k], log-probs float32 [N, k]): the
        top-k of log_softmax of each row's logits, computed inside the graph."""
        if int(tokens.shape[0]) > self.max_graph_tokens:
            return logits_topk_logprobs(self.model.forward(tokens, positions, start, mask), k)
        st = self._replay(tokens, positions, start, mask, ("topk", int(k)))
        return st.out_host[0].numpy().copy(), st.out_host[1].numpy().astype(np.float32)


def logits_argmax(logits: torch.Tensor) -> np.ndarray:
    """float logits [N, V] (any device) -> int64 [N] argmax, as GraphedModel.forward_argmax."""
    return _argmax(logits).cpu().numpy().astype(np.int64)


FUSED_READS = True      # benchmarks set False to time torch's log_softmax + topk / argmax instead


def _fused_read(logits: torch.Tensor, k: int) -> bool:
    """Whether the one-pass kernel (fused_ops.logits_topk) reads these logits (CUDA float32)."""
    if not (FUSED_READS and logits.is_cuda):
        return False
    from swiftspec_mpi.gpu import fused_ops
    return fused_ops.topk_ok(logits, k)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> int64 [N], the first index of each row's maximum (torch.argmax's), on the
    logits' device (the one definition both the graph and the eager path use)."""
    if _fused_read(logits, 1):
        from swiftspec_mpi.gpu import fused_ops
        return fused_ops.logits_topk(logits, 1, logprobs=False)[0].view(-1)
    return torch.argmax(logits, dim=-1)


def _topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (ids [N, k], log-probs [N, k]): top-k of log_softmax, on the logits' device
    (the one definition both the graph and the eager path use): on a GPU one pass of
    fused_ops.logits_topk (ties: the lower index first), else torch's log_softmax and topk."""
    if _fused_read(logits, k):
        from swiftspec_mpi.gpu import fused_ops
        return fused_ops.logits_topk(logits, k)
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.indices, top.values


def logits_topk_logprobs(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float logits [N, V] -> (ids int64 [N, k], log-probs float32 [N, k]) of log_softmax, as
    GraphedModel.forward_topk_logprobs."""
    ids, lps = _topk_logprobs(logits, k)
    return ids.cpu().numpy().astype(np.int64), lps.cpu().numpy().astype(np.float32)


def graphs_supported(model) -> bool:
    """Graphs need a CUDA bf16 model, head_dim 64 or 128 and the fused kernels (CuPy + nvcc
    at run time)."""
    if model.device.type != "cuda" or model.dtype != torch.bfloat16 or model.cfg.head_dim not in (64, 128):
        return False
    from swiftspec_mpi.gpu import kernels
    return kernels.available()
