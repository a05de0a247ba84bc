"""CUDA graphs for the decode-sized forwards (the verify tree, the draft's w leaves, one token).

`GraphedModel` wraps a GPU `Transformer` and keeps its interface (forward, compact_kv, cfg,
max_slots, device, comm). A forward of N new tokens (N <= max_graph_tokens) replays a graph of
`Transformer.forward_graphable` captured once for that N: the inputs go through one pinned host
buffer and two asynchronous copies into static device buffers, the context length reaches the
fused tree-attention kernel as a device scalar, and nothing is allocated. Larger N (prefill)
runs eagerly. The engine's one device sync per step is its read of the logits.
"""
from __future__ import annotations

import torch


class _Static:
    """Static buffers and the captured graph for one N."""

    def __init__(self, model, n: int):
        dev, S = model.device, model.max_slots
        self.n = n
        self.ints_host = torch.zeros(3, n, dtype=torch.long, pin_memory=True)   # tokens, positions, slots
        self.mask_host = torch.zeros(n, S, dtype=torch.bool, pin_memory=True)
        self.nvalid_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.ints = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.mask = torch.zeros(n, S, dtype=torch.bool, device=dev)
        self.n_valid = torch.ones(1, dtype=torch.int32, device=dev)
        self.graph = torch.cuda.CUDAGraph()
        self.logits = None

    def run_eager(self, model):
        return model.forward_graphable(self.ints[0], self.ints[1], self.ints[2], self.mask, self.n_valid)


class GraphedModel:
    def __init__(self, model, max_graph_tokens: int = 64):
        self.model = model
        self.max_graph_tokens = max_graph_tokens
        self.static: dict[int, _Static] = {}

    def __getattr__(self, name):          # cfg, max_slots, device, comm, dtype, compact_kv ...
        return getattr(self.model, name)

    def _capture(self, n: int) -> _Static:
        st = _Static(self.model, n)
        S = self.model.max_slots
        # capture with harmless inputs: the last n slots are scratch at capture time
        st.ints[2] = torch.arange(S - n, S, device=st.ints.device)
        st.mask[:, :] = True
        st.n_valid.fill_(S)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):                 # warm up (kernel compile, cuBLAS handles)
                st.run_eager(self.model)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(st.graph):
            st.logits = st.run_eager(self.model)
        return st

    @torch.inference_mode()
    def forward(self, tokens, positions, start: int, mask, logits_rows=None):
        """Same contract as Transformer.forward (mask [N, start+N] on the host or device)."""
        n = int(tokens.shape[0])
        if n > self.max_graph_tokens:
            return self.model.forward(tokens, positions, start, mask, logits_rows)
        st = self.static.get(n)
        if st is None:
            st = self.static[n] = self._capture(n)
        S = start + n
        st.ints_host[0].copy_(tokens)
        st.ints_host[1].copy_(positions)
        torch.arange(start, S, out=st.ints_host[2])
        st.mask_host[:, :S].copy_(mask)
        st.nvalid_host[0] = S
        st.ints.copy_(st.ints_host, non_blocking=True)
        st.mask[:, :S].copy_(st.mask_host[:, :S], non_blocking=True)
        st.n_valid.copy_(st.nvalid_host, non_blocking=True)
        st.graph.replay()
        logits = st.logits
        if logits_rows is not None:
            logits = logits.index_select(0, logits_rows.to(logits.device))
        return logits


def graphs_supported(model) -> bool:
    """Graphs need a CUDA bf16 model, head_dim 64 or 128 and the fused kernels (CuPy + nvcc
    at run time)."""
    if model.device.type != "cuda" or model.dtype != torch.bfloat16 or model.cfg.head_dim not in (64, 128):
        return False
    from swiftspec_mpi import kernels
    return kernels.available()
