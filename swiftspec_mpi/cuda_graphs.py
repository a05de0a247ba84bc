"""CUDA graphs for the decode-sized forwards (the verify tree, the draft's w leaves, one token).

`GraphedModel` wraps a GPU `Transformer` and keeps its interface (forward, compact_kv, cfg,
max_slots, device, comm). A forward of N new tokens (N <= max_graph_tokens) replays a graph of
`Transformer.forward_graphable` captured once for that N: the inputs go through two pinned host
buffers (tokens, positions, slots and the context length in one int64 buffer; the mask) and two
asynchronous copies into static device buffers, the context length reaches the fused
tree-attention kernel as a device scalar, and nothing is allocated. Larger N (prefill) runs
eagerly.

What the engine reads back can be reduced inside the same graph, so that a step costs one
replay, one small copy into pinned host memory and one stream sync, with no kernel launched
from the host after the replay:
  - `forward_argmax`: the argmax token of each row (greedy verification), 8 bytes a row;
  - `forward_topk_logprobs`: the top-k of log_softmax(logits) of each row (the draft's tree
    expansion), values and indices.
The same torch ops as the eager path, so the same results.
"""
from __future__ import annotations

import numpy as np
import torch


def _host(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (a device tensor is copied to the host first)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


class _Static:
    """Static buffers and the captured graph for one N and one read-back (`reduce`: None for
    the logits, ("argmax",) or ("topk", k))."""

    def __init__(self, model, n: int, reduce: tuple | None):
        dev, S = model.device, model.max_slots
        self.n, self.reduce = n, reduce
        # tokens [0, n), positions [n, 2n), write slots [2n, 3n), context length (3n: int64 whose
        # low 32 bits are the int32 the attention kernel reads; both sides are little-endian)
        self.ints_host = torch.zeros(3 * n + 1, dtype=torch.long, pin_memory=True)
        self.ints_np = self.ints_host.numpy()
        self.mask_host = torch.zeros(n, S, dtype=torch.bool, pin_memory=True)
        self.mask_np = self.mask_host.numpy()
        self.ints = torch.zeros(3 * n + 1, dtype=torch.long, device=dev)
        self.mask = torch.zeros(n, S, dtype=torch.bool, device=dev)
        self.n_valid = self.ints[3 * n:].view(torch.int32)[:1]
        self.graph = torch.cuda.CUDAGraph()
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
            outs = [torch.argmax(logits, dim=-1)]
        else:
            top = torch.topk(torch.log_softmax(logits, dim=-1), self.reduce[1], dim=-1)
            outs = [top.indices, top.values]
        return logits, outs

    def fill(self, tokens, positions, start: int, mask) -> None:
        """The inputs of one step into the pinned buffers, then into the device buffers."""
        n, S = self.n, start + self.n
        a = self.ints_np
        a[:n] = _host(tokens)
        a[n:2 * n] = _host(positions)
        a[2 * n:3 * n] = np.arange(start, S)
        a[3 * n] = S
        if isinstance(mask, torch.Tensor) and mask.device.type != "cpu":
            self.mask_host[:, :S].copy_(mask)
        else:
            self.mask_np[:, :S] = _host(mask) if isinstance(mask, torch.Tensor) else mask
        self.ints.copy_(self.ints_host, non_blocking=True)
        self.mask[:, :S].copy_(self.mask_host[:, :S], non_blocking=True)


class GraphedModel:
    def __init__(self, model, max_graph_tokens: int = 64):
        self.model = model
        self.max_graph_tokens = max_graph_tokens
        self.static: dict[tuple, _Static] = {}

    def __getattr__(self, name):          # cfg, max_slots, device, comm, dtype, compact_kv ...
        return getattr(self.model, name)

    def _capture(self, n: int, reduce: tuple | None) -> _Static:
        st = _Static(self.model, n, reduce)
        S = self.model.max_slots
        # capture with harmless inputs: the last n slots are scratch at capture time
        st.ints[2 * n:3 * n] = torch.arange(S - n, S, device=st.ints.device)
        st.ints[3 * n] = S
        st.mask[:, :] = True
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                 # warm up (kernel compile, cuBLAS handles)
                st.run_eager(self.model)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(st.graph):
            st.logits, st.outs = st.run_eager(self.model)
        st.out_host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in st.outs]
        return st

    def _replay(self, tokens, positions, start: int, mask, reduce: tuple | None) -> _Static:
        n = int(tokens.shape[0])
        st = self.static.get((n, reduce))
        if st is None:
            st = self.static[(n, reduce)] = self._capture(n, reduce)
        st.fill(tokens, positions, start, mask)
        st.graph.replay()
        if st.out_host:                        # one D2H copy per result (a few bytes), then sync
            for h, t in zip(st.out_host, st.outs):
                h.copy_(t, non_blocking=True)
            torch.cuda.current_stream().synchronize()
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
        computed inside the graph (one replay, one 8-byte-a-row copy, one stream sync)."""
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
    return torch.argmax(logits, dim=-1).cpu().numpy().astype(np.int64)


def logits_topk_logprobs(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float logits [N, V] -> (ids int64 [N, k], log-probs float32 [N, k]) of log_softmax, as
    GraphedModel.forward_topk_logprobs."""
    top = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
    return top.indices.cpu().numpy().astype(np.int64), top.values.cpu().numpy().astype(np.float32)


def graphs_supported(model) -> bool:
    """Graphs need a CUDA bf16 model, head_dim 64 or 128 and the fused kernels (CuPy + nvcc
    at run time)."""
    if model.device.type != "cuda" or model.dtype != torch.bfloat16 or model.cfg.head_dim not in (64, 128):
        return False
    from swiftspec_mpi import kernels
    return kernels.available()
