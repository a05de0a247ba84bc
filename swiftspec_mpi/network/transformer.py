"""`Transformer`: one Llama-family decoder (Llama 3 and Qwen2/2.5, told apart by config flags)
with tree attention over static KV slots and tensor parallelism inside its group.

Tensor shapes (N new tokens, S = start + N visible slots, R logits rows, TP degree T):
    tokens    LongTensor [N]            token ids
    positions LongTensor [N]            RoPE position ids (P + depth for tree nodes)
    mask      BoolTensor [N, S]         True = column slot visible to that row
    logits    FloatTensor [R, vocab]    float32, full vocabulary, identical on every rank
    KV        [n_layers, max_slots, n_kv_local, head_dim] (one K and one V buffer, static)
    weights   weight_layout "packed" (CPU default where AVX2 runs: 16-column panels read by
              csrc/gemm_avx2.h, see cpu_linear.py; stored in `dtype`, float32 or bfloat16, while
              activations, KV and norms stay float32), "in_out" ([in, out], x @ W; the CPU fallback)
              or "out_in" (GPU default: nn.Linear's [out, in], for cuBLAS and the CUDA kernels);
              the math is the same, only the GEMV speed differs. quant="int4" on the CPU: every
              matrix in its packed 4-/8-bit kind (cpu_quant: QuantLinear, QuantTable embedding)

Tensor parallelism (comm.size = T > 1):
    column-parallel: fused QKV (this rank's query heads and their KV heads) and fused gate|up;
    row-parallel: O and down, each followed by ONE all_reduce_ of [N, hidden];
    vocab-parallel head ([ceil(V/T), hidden] per rank, zero-padded) then one all_gather_lastdim;
    the embedding is replicated (a tied head is a view of it: no extra memory).
    Query heads are split evenly (T must divide num_heads). KV heads are split when T divides
    them, and replicated when T > num_kv_heads (each rank keeps the KV heads its query heads
    use). In the rare layouts where a rank's query heads do not map evenly onto its KV heads,
    the rank keeps one KV head copy per query head (plain MHA locally), which stays exact.

No per-step tensor growth: KV buffers and RoPE tables are allocated once; forward runs under
torch.inference_mode with a handful of torch ops per layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from swiftspec_mpi.core.comm import SingleComm
from swiftspec_mpi.network.config import ModelConfig
from swiftspec_mpi.network.layer import Layer
from swiftspec_mpi.network.rope import rope_inv_freq
from swiftspec_mpi.network.shard import TPShard
from swiftspec_mpi.network.weight_loading import load_weights
from swiftspec_mpi.packed import cpu_linear, cpu_ops, cpu_quant

# (n_new * group) at or below which GQA is folded into the query-length dimension (no KV copy,
# additive float mask shared by all layers); above it SDPA's own GQA path with the bool mask.
_FOLD_MAX_ROWS = 256


def chain_mask(start: int, n: int) -> torch.Tensor:
    """BoolTensor [n, start+n]: the whole prefix [0, start) visible, causal over the n new."""
    return torch.ones(n, start + n, dtype=torch.bool).tril_(diagonal=start)


class Transformer(torch.nn.Module):
    """Llama/Qwen2 decoder over static KV slots; see the module doc for shapes and sharding.

    Build, then `load_weights(source)`; `forward(tokens, positions, start, mask, logits_rows)`
    writes the N new tokens' K/V into slots [start, start+N) and returns float32 logits.
    `weight_layout` (keyword, optional): "packed" | "in_out" | "out_in", see the module doc.
    `dtype` is the weights' dtype; with "packed" the activations, KV and norms are float32
    (`self.dtype`), elsewhere everything is `dtype`. `self.weight_dtype` keeps the request.
    `quant` (keyword): "none" or "int4". int4 on CUDA (bf16, `self.quant4`): the four projections
    are packed `gpu.w4a16.W4A16Weight`s (source's `get_packed`, packed_layers.py), the rest bf16.
    int4 on the CPU ("packed" layout, `self.quant_cpu`): every matrix in the source's packed kind
    (module doc; source's `packed_chunks`, as GGUF, safetensors and dummy sources give them)."""

    def __init__(self, cfg: ModelConfig, comm=None, max_slots: int = 4096,
                 dtype: torch.dtype = torch.float32, device="cpu", weight_layout: str | None = None,
                 quant: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.comm = SingleComm() if comm is None else comm
        self.max_slots = int(max_slots)
        self.device = torch.device(device)
        cpu = self.device.type == "cpu"
        # CPU: packed panels for our AVX2 kernel (a tree of 8 tokens costs ~2x one token, MKL's
        # sgemm ~4x; bf16 weights halve the bytes). Fallback without AVX2: [in, out] for float32
        # (MKL's M=1 GEMV is 15-30 % faster on x @ W than on nn.Linear's layout), [out, in] for
        # bf16 (x @ W[in, out] is ~10x slower there). GPU: [out, in] (cuBLAS, CUDA kernels).
        if weight_layout is None:
            if cpu and cpu_linear.has_avx2() and (dtype in (torch.float32, torch.bfloat16)
                                                  or quant == "int4"):
                weight_layout = "packed"
            else:
                weight_layout = "in_out" if cpu and dtype == torch.float32 else "out_in"
        if weight_layout not in ("packed", "in_out", "out_in"):
            raise ValueError("weight_layout must be 'packed', 'in_out' or 'out_in', not "
                             f"{weight_layout!r}")
        if weight_layout == "packed" and not (cpu and cpu_linear.has_avx2()):
            raise ValueError("weight_layout 'packed' needs the CPU and a CPU with AVX2 + FMA")
        if quant not in ("none", "int4"):
            raise ValueError(f"quant must be 'none' or 'int4', not {quant!r}")
        self.quant4 = quant == "int4" and not cpu         # W4A16 GPU kernels
        self.quant_cpu = quant == "int4" and cpu          # packed records, csrc/gemm_q.h
        if self.quant_cpu and weight_layout != "packed":
            raise ValueError("packed 4-bit weights run on the CPU with AVX2 + FMA (layout 'packed')")
        self.weight_layout = weight_layout
        self.weight_dtype = dtype
        self.packed = weight_layout == "packed"
        self.dtype = torch.float32 if self.packed else dtype
        self.transposed = weight_layout == "in_out"
        self._linear = (cpu_quant.dense_linear if self.quant_cpu else
                        cpu_linear.linear if self.packed else
                        _linear_in_out if self.transposed else F.linear)
        if self.quant4:
            if self.device.type != "cuda" or dtype != torch.bfloat16 or weight_layout != "out_in":
                raise ValueError("quant 'int4' needs a CUDA bfloat16 model ([out, in] layout)")
            from swiftspec_mpi.gpu import w4a16
            self._linear = w4a16.linear
        self.shard = sh = TPShard(cfg, self.comm.rank, self.comm.size)
        hd = cfg.head_dim
        self.n_kv_local = sh.nkv_l
        self._half = hd // 2
        kw = dict(dtype=self.dtype, device=self.device)
        with torch.no_grad():
            # static KV: [n_layers, max_slots, n_kv_local, head_dim]
            self.k_cache = torch.zeros(cfg.num_layers, self.max_slots, sh.nkv_l, hd, **kw)
            self.v_cache = torch.zeros(cfg.num_layers, self.max_slots, sh.nkv_l, hd, **kw)
            self._k_layers = list(self.k_cache.unbind(0))  # views, made once
            self._v_layers = list(self.v_cache.unbind(0))
            # RoPE tables [rope_len, head_dim], rotate_half folded into a signed sin table:
            # rot(x) = roll(x, half) * [-sin_lo, sin_hi]
            inv, scale = rope_inv_freq(cfg)
            self.rope_len = self.max_slots + 256
            pos = torch.arange(self.rope_len, dtype=torch.int64).float()
            freqs = pos[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * scale, emb.sin() * scale
            sin[:, :self._half] = -sin[:, :self._half]
            self.rope_cos = cos.to(**kw)
            self.rope_sin = sin.to(**kw)
        # one Layer per decoder layer (network/layer.py), filled by load_weights
        self.layers: list[Layer] = []
        self.embed = None   # [vocab, hidden] (a transposed view of a [hidden, vocab] store when
        self.norm = None    # the head is tied on CPU; None when a tied packed head serves the
        #                     lookup); head: [v_chunk, hidden], [hidden, v_chunk] or PackedWeight
        self.head = None
        self.loaded = False
        self.step_kernel = None     # gpu/step_kernel.StepKernel: forward_graphable's one-launch path

    # ------------------------------------------------------------------------------ loading
    def load_weights(self, source) -> None:
        """Read this rank's shard from a TensorSource (`get(name, dim, start, stop)`), one tensor
        at a time, straight into the fused per-layer buffers (network/weight_loading.py). Shapes
        are checked against the config; a mismatch raises CheckpointError naming the tensor."""
        load_weights(self, source)
        self.loaded = True

    def quantize_head(self) -> None:
        """Pack the LM head 4-bit (`--head-bits 4`; 4-bit models on the GPU only): a step then
        streams a quarter of its bytes through the W4A16 GEMV (packed_layers.quantize_head). The
        embedding table stays as loaded (a tied head's bf16 table still serves the lookup)."""
        if not self.quant4:
            raise ValueError("a 4-bit LM head runs with the GPU's 4-bit projections (quant 'int4' on CUDA)")
        from swiftspec_mpi.network import packed_layers
        self.head = packed_layers.quantize_head(self.head, self.device)
        self._forget_gemm_choices()                 # the head's kernel is chosen anew

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (shared/tied storage counted once)."""
        return self._storage_bytes([self.embed, self.norm, self.head])

    def step_read_bytes(self) -> int:
        """Bytes of weights one decode step streams on this rank: every layer's weights, the
        final norm and the LM head (a tied head reads the embedding table in full), but not an
        untied embedding table, of which a step reads only its tokens' rows. The bandwidth
        floor of a step is this over the device's read bandwidth (Llama-3-8B: 15.01 of its
        16.06 GB)."""
        return self._storage_bytes([self.norm, self.head])

    def _storage_bytes(self, tensors: list) -> int:
        """Bytes of the storages behind `tensors` and every layer's weights, each counted once."""
        seen, total = set(), 0
        tensors = list(tensors)
        for lay in self.layers:
            tensors.extend(lay.weights())
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, (cpu_quant.QuantLinear, cpu_quant.QuantTable)):
                total += t.nbytes()
                continue
            if isinstance(t, cpu_linear.PackedWeight):
                t = t.data
            for part in (t.tensors() if hasattr(t, "tensors") else [t]):   # W4A16Weight: its parts
                key = part.untyped_storage().data_ptr()
                if key in seen:
                    continue
                seen.add(key)
                total += part.untyped_storage().nbytes()
        return total

    # ------------------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, start: int,
                mask: torch.Tensor | None, logits_rows: torch.Tensor | None = None,
                causal: bool = False, between_layers=None) -> torch.Tensor | None:
        """Run N new tokens over the KV prefix [0, start).

        tokens [N] long, positions [N] long, mask [N, start+N] bool (True = visible),
        logits_rows [R] long or None (all N rows). Writes K/V of the new tokens into slots
        [start, start+N); returns float32 logits [R or N, vocab_size] on every rank.
        causal: the caller promises mask == chain_mask(start, N) (a prompt); at start 0 the
        attention then runs SDPA's causal kernel (flash on a GPU) without a mask, and `mask`
        may be None.
        between_layers: None, or a callable (done: int, total: int) -> bool called after each
        decoder layer (done = layers run so far, 1..total); True stops the forward there and it
        returns None. Slots [start, start+N) then hold the new tokens' K/V in the first `done`
        layers only: the caller must treat them as unwritten (a later forward into those slots
        rewrites every layer before anything attends to them). Every rank of a tensor-parallel
        group must get the same answers at the same layers (the all-reduces pair up).
        """
        N = tokens.shape[0]
        S = start + N
        if S > self.max_slots:
            raise ValueError(f"KV overflow: start {start} + {N} new tokens > max_slots "
                             f"{self.max_slots}")
        sh = self.shard
        hd = self.cfg.head_dim
        nh_l, nkv_l, g = sh.nh_l, sh.nkv_l, sh.group
        dev = self.device
        if causal and start == 0:           # a prompt from slot 0: SDPA's causal kernel, no mask
            mask = None
        elif mask is None:
            raise ValueError("mask is required unless causal and start == 0")
        if tokens.device != dev:
            tokens, positions = tokens.to(dev), positions.to(dev)
        if mask is not None and mask.device != dev:
            mask = mask.to(dev)

        if (mask is not None and self.packed
                and cpu_ops.usable(self.dtype, N, hd, self.cfg.hidden_size)):
            return self._rows_logits(self._layers_small(tokens, positions, start, mask, between_layers),
                                     logits_rows)

        fold = N * g <= _FOLD_MAX_ROWS and mask is not None
        if fold:
            # GQA folded into the query-length dim: q [nkv_l, g*N, hd], additive mask [g*N, S]
            am = torch.zeros(N, S, dtype=self.dtype, device=dev).masked_fill_(~mask, -math.inf)
            if g > 1:
                am = am.repeat(g, 1)

        def write_kv(kc, vc, k, v):
            kc[start:S].copy_(k)
            vc[start:S].copy_(v)

        def attend(q, kc, vc):                                             # q [N, nh_l, hd]
            k = kc[:S].transpose(0, 1)                                     # [nkv_l, S, hd]
            v = vc[:S].transpose(0, 1)
            if mask is None:                                               # causal from slot 0
                o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                                   v.unsqueeze(0), is_causal=N > 1,
                                                   enable_gqa=g > 1)
                return o[0].transpose(0, 1).reshape(N, nh_l * hd)
            if fold:
                q = q.reshape(N, nkv_l, g, hd).permute(1, 2, 0, 3).reshape(nkv_l, g * N, hd)
                o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0),
                                                   v.unsqueeze(0), attn_mask=am)
                return o.view(nkv_l, g, N, hd).permute(2, 0, 1, 3).reshape(N, nh_l * hd)
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                               v.unsqueeze(0), attn_mask=mask, enable_gqa=g > 1)
            return o[0].transpose(0, 1).reshape(N, nh_l * hd)

        return self._rows_logits(self._layers(tokens, positions, write_kv, attend, between_layers),
                                 logits_rows)

    def forward_prompt(self, ids: list[int], row: int) -> None:
        """A prompt at slot 0: ids (m token ids, padded or not) -> their KV in slots [0, m), with
        SDPA's causal kernel; the logits of row `row` are computed and dropped (the CUDA-graph
        wrapper replays a captured prompt graph instead: GraphedModel.forward_prompt)."""
        dev = self.device
        self.forward(torch.tensor(ids, dtype=torch.long, device=dev), torch.arange(len(ids), device=dev), 0,
                     None, logits_rows=torch.tensor([row], device=dev), causal=True)

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, write_kv, attend,
                between_layers=None) -> torch.Tensor | None:
        """Embedding + every decoder layer -> hidden states [N, hidden] (before the final norm).
        `write_kv(kc, vc, k [N, nkv_l, hd], v)` stores the new tokens' KV in one layer's buffers;
        `attend(q [N, nh_l, hd], kc, vc) -> [N, nh_l*hd]` is the (tree) attention.
        `between_layers(done, total) -> bool`: see `forward` (True: stop, return None)."""
        cfg, sh, comm = self.cfg, self.shard, self.comm
        N = tokens.shape[0]
        eps = cfg.rms_norm_eps
        hshape = (cfg.hidden_size,)
        hd, half = cfg.head_dim, self._half
        nh_l, nkv_l = sh.nh_l, sh.nkv_l
        qk_cols = (nh_l + nkv_l) * hd
        il = sh.inter_l
        lin = self._linear
        x = self._embed(tokens)                                            # [N, hidden]
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)   # [N, 1, hd]
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        total = len(self.layers)
        for i, lay in enumerate(self.layers):
            h = F.rms_norm(x, hshape, lay.ln1, eps)
            qkv = lin(h, lay.wqkv, lay.bqkv)                                # [N, (nh+2kv)*hd]
            qk = qkv[:, :qk_cols].view(N, nh_l + nkv_l, hd)
            qk = torch.addcmul(qk * cos, torch.roll(qk, half, -1), sin)     # RoPE on q and k
            write_kv(lay.k_cache, lay.v_cache, qk[:, nh_l:], qkv[:, qk_cols:].view(N, nkv_l, hd))
            o = attend(qk[:, :nh_l], lay.k_cache, lay.v_cache)
            a = lin(o, lay.wo, lay.bo)
            comm.all_reduce_(a)
            x.add_(a)
            h = F.rms_norm(x, hshape, lay.ln2, eps)
            gu = lin(h, lay.wgu)                                           # [N, 2*inter_l]
            m = F.silu(gu[:, :il]).mul_(gu[:, il:])
            d = lin(m, lay.wd)
            comm.all_reduce_(d)
            x.add_(d)
            if between_layers is not None and between_layers(i + 1, total):
                return None
        return x

    def _layers_small(self, tokens: torch.Tensor, positions: torch.Tensor, start: int,
                      mask: torch.Tensor, between_layers=None) -> torch.Tensor | None:
        """`_layers` for a decode-sized batch on the CPU (packed layout, float32): the same
        layer with the C ops of packed/cpu_ops.py between the GEMMs (each residual add folded
        into the next RMSNorm). tokens, positions [N] long; mask [N, start + N] bool;
        `between_layers` as in `forward` (True: stop, return None)."""
        cfg, sh, comm = self.cfg, self.shard, self.comm
        eps = cfg.rms_norm_eps
        nh_l, nkv_l = sh.nh_l, sh.nkv_l
        lin = self._linear
        positions = positions.contiguous()
        x = self._embed(tokens).contiguous()                               # [N, hidden]
        pending = None                                                     # the last add
        total = len(self.layers)
        for i, lay in enumerate(self.layers):
            h = cpu_ops.add_rmsnorm(x, pending, lay.ln1, eps)
            qkv = lin(h, lay.wqkv, lay.bqkv)                                # [N, (nh+2kv)*hd]
            cpu_ops.rope_kv(qkv, positions, self.rope_cos, self.rope_sin, nh_l, nkv_l,
                            lay.k_cache, lay.v_cache, start)
            o = cpu_ops.attention(qkv, lay.k_cache, lay.v_cache, mask, nh_l)   # [N, nh*hd]
            a = lin(o, lay.wo, lay.bo)
            comm.all_reduce_(a)
            h = cpu_ops.add_rmsnorm(x, a, lay.ln2, eps)
            d = lin(cpu_ops.silu_mul(lin(h, lay.wgu)), lay.wd)
            comm.all_reduce_(d)
            pending = d
            if between_layers is not None and between_layers(i + 1, total):
                return None
        return x if pending is None else x.add_(pending)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> [N, hidden] in self.dtype (a tied packed head is gathered from)."""
        if self.embed is None or isinstance(self.embed, cpu_quant.QuantTable):
            return (self.head if self.embed is None else self.embed).gather_rows(tokens, self.dtype)
        x = F.embedding(tokens, self.embed)
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def _rows_logits(self, x: torch.Tensor | None, logits_rows: torch.Tensor | None):
        """forward's result from the last layer's x [N, hidden]: the logits of rows `logits_rows`
        (all rows when None), or None when the layers stopped early (between_layers)."""
        if x is None:
            return None
        if logits_rows is not None:
            x = x.index_select(0, logits_rows.to(self.device))
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + (vocab-parallel) head: [R, hidden] -> float32 [R, vocab_size]."""
        x = F.rms_norm(x, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        logits = self._linear(x, self.head)                                # [R, v_chunk]
        if self.comm.size > 1:
            logits = self.comm.all_gather_lastdim(logits)
            if logits.shape[1] != self.cfg.vocab_size:
                logits = logits[:, :self.cfg.vocab_size]
        return logits.float()

    @torch.inference_mode()
    def forward_graphable(self, tokens: torch.Tensor, positions: torch.Tensor,
                          write_slots: torch.Tensor, mask: torch.Tensor,
                          n_valid: torch.Tensor) -> torch.Tensor:
        """The CUDA-graph-safe forward: no shape depends on the context length.

        tokens [N] long, positions [N] long, write_slots [N] long (KV slots of the new tokens),
        mask [N, max_slots] bool/uint8 (only columns < L matter), n_valid int32 [1] = L, the
        slots attended, read on the device by the fused tree-attention kernel. All on the GPU,
        bf16 model. Returns float32 logits [N, vocab_size]. Same math as `forward`.

        With `step_kernel` set (gpu/step_kernel.py, `--step-kernel persistent`), N <= 32 runs as
        one launch of the persistent step kernel (its logits: a static buffer of that N).

        Uses the fused elementwise kernels (swiftspec_mpi.gpu.fused_ops: residual add + RMSNorm,
        RoPE + KV write, SiLU * up) when `fused_ops.enabled()`, else the torch ops of `_layers`;
        with them, the projections follow `fused_ops.gemm_mode()` (default "pdl": our GEMV for
        every bias-free projection, every kernel launched with programmatic dependent launch).
        """
        from swiftspec_mpi.gpu import fused_ops, kernels

        if self.step_kernel is not None and self.step_kernel.takes(int(tokens.shape[0])):
            return self.step_kernel.forward(tokens, positions, write_slots, mask, n_valid)
        if fused_ops.enabled():
            return self._graphable_fused(tokens, positions, write_slots, mask, n_valid)

        def write_kv(kc, vc, k, v):
            kc.index_copy_(0, write_slots, k)
            vc.index_copy_(0, write_slots, v)

        def attend(q, kc, vc):
            return kernels.tree_attention(q, kc, vc, mask, n_valid).view(q.shape[0], -1)

        return self._logits(self._layers(tokens, positions, write_kv, attend))

    def _fused_workspace(self, n: int) -> dict:
        """Static bf16 buffers of the fused forward for n tokens, made once per n (a captured CUDA
        graph keeps pointing at them): x, h [n, hidden]; o [n, nh_l, hd]; m [n, inter_l];
        qkv [n, (nh_l + 2 nkv_l) hd] (the output of kernels.gemm_qkv_rope)."""
        ws_all = self.__dict__.get("_fused_ws")
        if ws_all is None:
            ws_all = self.__dict__["_fused_ws"] = {}
        ws = ws_all.get(n)
        if ws is None:
            H, sh, hd = self.cfg.hidden_size, self.shard, self.cfg.head_dim
            kw = dict(dtype=self.dtype, device=self.device)
            ws = ws_all[n] = {"x": torch.empty(n, H, **kw), "h": torch.empty(n, H, **kw),
                              "o": torch.empty(n, sh.nh_l, hd, **kw),
                              "m": torch.empty(n, sh.inter_l, **kw),
                              "qkv": torch.empty(n, (sh.nh_l + 2 * sh.nkv_l) * hd, **kw)}
        return ws

    def _forget_gemm_choices(self) -> None:
        """Drop every workspace's cached `_fused_gemm_choice` (a weight changed its kind)."""
        for ws in self.__dict__.get("_fused_ws", {}).values():
            for key in [k for k in ws if isinstance(k, tuple) and k[0] == "gemm"]:
                del ws[key]

    def _fused_gemm_choice(self, n: int, ws: dict) -> dict:
        """Per projection ("qkv", "o", "gu", "down", "head"): True = kernels.gemm_rowparallel,
        False = cuBLAS, for n tokens, decided once per (n, fused_ops.gemm_mode()): in "pdl" mode
        every projection the GEMV kernel takes (fused_ops.pdl_gemm_ok), in "cublas" mode none.
        Projections with a bias, and weights stored [in, out], stay on cuBLAS."""
        from swiftspec_mpi.gpu import fused_ops

        mode = fused_ops.gemm_mode()
        key = ("gemm", mode)
        rp = ws.get(key)
        if rp is None:
            lays = self.layers
            kinds = {"qkv": ("wqkv", "bqkv"), "o": ("wo", "bo"), "gu": ("wgu", None), "down": ("wd", None)}
            on_gemv = self.weight_layout == "out_in" and mode == "pdl"
            rp = {}
            for kind, (weight, bias) in kinds.items():     # (4-bit weights: their own kernels, in lin)
                ok = on_gemv and not self.quant4 and all(bias is None or getattr(lay, bias) is None for lay in lays)
                rp[kind] = ok and fused_ops.pdl_gemm_ok([getattr(lay, weight) for lay in lays], n)
            rp["head"] = on_gemv and fused_ops.pdl_gemm_ok([self.head], n)
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return rp
            ws[key] = rp
        return rp

    def _graphable_fused(self, tokens, positions, write_slots, mask, n_valid) -> torch.Tensor:
        """`forward_graphable` with the fused kernels (same arguments and result). Per layer:
        add_rmsnorm (the previous layer's down output + ln1; plain RMSNorm in layer 0), QKV GEMM,
        rope_kv_write, tree attention, O GEMM, all-reduce, add_rmsnorm (+ ln2), gate|up GEMM,
        silu_mul, down GEMM, all-reduce (each GEMM + all-reduce one kernel, kernels.gemm_allreduce,
        when the comm has a fused_allreduce); the last residual add is fused with the final norm. In
        "pdl" mode QKV GEMM + rope_kv_write is one kernel (kernels.gemm_qkv_rope), and so is
        gate|up GEMM + silu_mul (kernels.gemm_swiglu): 7 kernels per layer. 4-bit weights: gate|up
        GEMM + silu_mul is one kernel (w4a16.gemm_swiglu), 8 kernels per layer."""
        from swiftspec_mpi.gpu import fused_ops, kernels, w4a16

        cfg, sh, comm = self.cfg, self.shard, self.comm
        N = tokens.shape[0]
        eps = cfg.rms_norm_eps
        hd, nh_l = cfg.head_dim, sh.nh_l
        ws = self._fused_workspace(N)
        x, h, o, m = ws["x"], ws["h"], ws["o"], ws["m"]
        rp = self._fused_gemm_choice(N, ws)
        gemm = kernels.gemm_rowparallel
        # "pdl" mode: every kernel launched with programmatic dependent launch (a kernel after a
        # cuBLAS GEMM or an all-reduce simply waits for it; results are the same bits either way).
        pdl = fused_ops.gemm_mode() == "pdl"

        def lin(use_rp, inp, w, b=None):
            if use_rp:
                return gemm(inp, w, pdl=pdl)
            return w4a16.linear(inp, w, b, pdl=pdl) if self.quant4 else self._linear(inp, w, b)

        far = getattr(comm, "fused_allreduce", None)      # nccl_shim.DeviceAllReduce or None

        def lin_reduce(use_rp, inp, w, b=None):
            """Row-parallel projection summed over the TP group: one fused GEMM + all-reduce
            kernel when the group set one up (NcclGroupComm.enable_fused_allreduce), else the
            GEMM then the group's all-reduce."""
            if far is not None and use_rp and b is None and w.shape[0] <= far.max_n:
                return kernels.gemm_allreduce(inp, w, far)
            if (far is not None and self.quant4 and b is None and w.shape[0] <= far.max_n
                    and inp.shape[0] <= w4a16.MAX_ALLREDUCE_ROWS):
                return w4a16.gemm_allreduce(inp, w, far)
            out = lin(use_rp, inp, w, b)
            comm.all_reduce_(out)
            return out

        torch.index_select(self.embed, 0, tokens, out=x)
        pending = None                      # the previous layer's MLP output, not yet added to x
        for (ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd, kc, vc) in self.layers:     # Layer's fields
            fused_ops.add_rmsnorm(x, pending, ln1, eps, out=h, pdl=pdl)
            if pdl and rp["qkv"] and hd % 16 == 0:                         # QKV GEMM + RoPE + KV write
                qkv = ws["qkv"]
                kernels.gemm_qkv_rope(h, wqkv, qkv, positions, write_slots, self.rope_cos, self.rope_sin,
                                      kc, vc, nh_l, pdl=True)
            else:
                qkv = lin(rp["qkv"], h, wqkv, bqkv)                        # [N, (nh+2kv)*hd]
                fused_ops.rope_kv_write(qkv, positions, write_slots, self.rope_cos, self.rope_sin,
                                        kc, vc, nh_l, pdl=pdl)
            kernels.tree_attention(qkv[:, :nh_l * hd].view(N, nh_l, hd), kc, vc, mask, n_valid, out=o,
                                   pdl=pdl)
            a = lin_reduce(rp["o"], o.view(N, nh_l * hd), wo, bo)
            fused_ops.add_rmsnorm(x, a, ln2, eps, out=h, pdl=pdl)
            if pdl and rp["gu"] and wgu.shape[0] % 16 == 0:
                kernels.gemm_swiglu(h, wgu, out=m, pdl=True)               # gate|up GEMM + SwiGLU
            elif self.quant4 and w4a16.swiglu_ok(h, wgu):
                w4a16.gemm_swiglu(h, wgu, out=m, pdl=pdl)                  # the same, 4-bit weights
            else:
                fused_ops.silu_mul(lin(rp["gu"], h, wgu), out=m, pdl=pdl)
            pending = lin_reduce(rp["down"], m, wd)
        fused_ops.add_rmsnorm(x, pending, self.norm, eps, out=h, pdl=pdl)
        logits = lin(rp["head"], h, self.head)                             # [N, v_chunk]
        if comm.size > 1:
            logits = comm.all_gather_lastdim(logits)
            if logits.shape[1] != cfg.vocab_size:
                logits = logits[:, :cfg.vocab_size]
        return logits.float()

    # ------------------------------------------------------------------------------ KV plan
    @torch.inference_mode()
    def compact_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move KV slots src[i] -> dst[i] in every layer (src, dst LongTensor [M]). Overlap-safe:
        all sources are read before any destination is written."""
        if src.numel() == 0:
            return
        src = src.to(self.device)
        dst = dst.to(self.device)
        for buf in (self.k_cache, self.v_cache):
            buf.index_copy_(1, dst, buf.index_select(1, src))


def _linear_in_out(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    """x [M, in] @ w [in, out] (+ b [out]): nn.Linear for weights stored transposed."""
    return torch.mm(x, w) if b is None else torch.addmm(b, x, w)
