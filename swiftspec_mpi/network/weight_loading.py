"""Loading a checkpoint's weights into a Transformer: this rank's shard of every tensor, read one
at a time from a TensorSource (hf_loader.SafetensorsSource, gguf_loader.GGUFSource, dummy) straight
into the model's fused per-layer buffers (one network.layer.Layer per decoder layer)."""
from __future__ import annotations

import torch

from swiftspec_mpi.core.errors import CheckpointError
from swiftspec_mpi.network import packed_layers
from swiftspec_mpi.network.layer import Layer
from swiftspec_mpi.packed import cpu_linear, cpu_quant

# elements per block when loading a large matrix (bounds the loader's temporaries to ~32 MiB)
_FETCH_CHUNK = 8 << 20


def load_weights(self: torch.nn.Module, source) -> None:
    """Fill Transformer `self` (network.transformer) from a TensorSource: read this rank's shard
    (`get(name, dim, start, stop)`), one tensor
    at a time, straight into the fused per-layer buffers. Shapes are checked against the
    config; a mismatch raises CheckpointError naming the tensor."""
    cfg, sh, hd, H = self.cfg, self.shard, self.cfg.head_dim, self.cfg.hidden_size
    kw = dict(dtype=self.dtype, device=self.device)
    src_cfg = getattr(source, "config", None)
    if src_cfg is not None:
        for field in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                      "intermediate_size"):
            if getattr(src_cfg, field) != getattr(cfg, field):
                raise CheckpointError(f"checkpoint {field}={getattr(src_cfg, field)} differs "
                                      f"from the model's {field}={getattr(cfg, field)}")
        if src_cfg.num_layers < cfg.num_layers:
            raise CheckpointError(f"checkpoint has {src_cfg.num_layers} layers, the model "
                                  f"wants {cfg.num_layers}")

    get_into = getattr(source, "get_into", None)   # GGUF: dequantized a few MiB at a time

    def fetch(dst: torch.Tensor, name: str, dim=None, start=0, stop=None, expect=None):
        if isinstance(dst, (cpu_quant.QuantRows, cpu_quant.QuantTable)):   # CPU int4: chunk by chunk
            try:
                dst.load(source.packed_chunks(name, dim, start, stop))
            except ValueError as exc:
                raise CheckpointError(f"tensor {name!r}: {exc}") from None
            return
        if get_into is not None and expect is None:
            get_into(dst, name, dim, start, stop)     # checks the shape itself
            return
        rows = dst.shape[0] if len(dst.shape) == 2 else 0
        if expect is None and dim in (None, 0) and rows * dst.shape[-1] > _FETCH_CHUNK:
            # big matrices (the embedding) in row blocks: no full-size temporaries
            a0 = start if dim == 0 else 0
            if (stop if dim == 0 and stop is not None else a0 + rows) != a0 + rows:
                raise CheckpointError(f"tensor {name!r}: slice [{start}:{stop}) does not "
                                      f"give the {rows} rows the config implies")
            step = max(1, _FETCH_CHUNK // dst.shape[-1])
            for r in range(0, rows, step):
                fetch(dst[r:r + step], name, 0, a0 + r, a0 + min(r + step, rows))
            return
        t = source.get(name, dim, start, stop)
        want = tuple(dst.shape) if expect is None else expect
        if tuple(t.shape) != want:
            raise CheckpointError(f"tensor {name!r}: shape {list(t.shape)} (slice "
                                  f"[{start}:{stop}) along dim {dim}) but the config implies "
                                  f"{list(want)}; the checkpoint and its config.json disagree")
        dst.copy_(t.reshape(dst.shape))
        del t

    def mat(rows: int, cols: int):
        """-> (stored tensor in weight_layout, its [rows, cols] = [out, in] view)."""
        if self.quant_cpu:
            ql = cpu_quant.QuantLinear(rows, cols)
            return ql, ql.rows()
        if self.packed:
            pw = cpu_linear.PackedWeight(rows, cols, self.weight_dtype)
            return pw, pw.rows()
        if self.transposed:
            store = torch.empty(cols, rows, **kw)
            return store, store.t()
        store = torch.empty(rows, cols, **kw)
        return store, store

    v0, v1 = sh.vocab
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in set(_names(source))
    if tied and not cfg.tie_word_embeddings:
        raise CheckpointError("the checkpoint has no 'lm_head.weight' but config says "
                              "tie_word_embeddings=false; the checkpoint is incomplete")
    wkw = dict(dtype=self.weight_dtype, device=self.device)
    packed_tied = self.packed and not self.quant_cpu and tied and v1 - v0 == cfg.vocab_size
    with torch.no_grad():
        if packed_tied:                # the packed head serves the lookup too (gather_rows)
            self.head, head_rows = mat(cfg.vocab_size, H)
            self.embed = None
            fetch(head_rows, "model.embed_tokens.weight")
        elif self.quant_cpu:                 # packed rows, dequantized per looked-up token
            self.embed = emb_store = cpu_quant.QuantTable(cfg.vocab_size, H)
        elif tied and self.transposed:   # one [hidden, vocab] store serves lookup and head
            emb_store, self.embed = mat(cfg.vocab_size, H)
        else:
            self.embed = emb_store = torch.empty(cfg.vocab_size, H, **wkw)
        if not packed_tied:
            fetch(self.embed, "model.embed_tokens.weight")
        layers = []
        q_rows = sh.q_rows[1] - sh.q_rows[0]
        kv_rows = sh.nkv_l * hd
        runs = sh.kv_runs(hd)

        def fetch_qkv(dst, prefix: str, what: str) -> None:
            """dst [q_rows + 2 kv_rows, ...]: this rank's q rows, then its runs of the k and
            v rows, from the checkpoint's q_proj / k_proj / v_proj `what` (weight or bias)."""
            fetch(dst[:q_rows], prefix + f"self_attn.q_proj.{what}", 0, *sh.q_rows)
            for j, proj in enumerate(("k_proj", "v_proj")):
                off = q_rows + j * kv_rows
                for a, b in runs:
                    fetch(dst[off:off + b - a], prefix + f"self_attn.{proj}.{what}", 0, a, b)
                    off += b - a

        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            ln1 = torch.empty(H, **kw)
            fetch(ln1, p + "input_layernorm.weight")
            ln2 = torch.empty(H, **kw)
            fetch(ln2, p + "post_attention_layernorm.weight")
            if not self.quant4:
                wqkv, wqkv_v = mat(q_rows + 2 * kv_rows, H)
                fetch_qkv(wqkv_v, p, "weight")
            bqkv = None
            if cfg.attention_bias:
                bqkv = torch.empty(q_rows + 2 * kv_rows, **kw)
                fetch_qkv(bqkv, p, "bias")
            if not self.quant4:
                wo, wo_v = mat(H, q_rows)
                fetch(wo_v, p + "self_attn.o_proj.weight", 1, *sh.q_rows)
            bo = None
            if cfg.o_bias and self.comm.rank == 0:   # added once, before the all-reduce
                bo = torch.empty(H, **kw)
                fetch(bo, p + "self_attn.o_proj.bias")
            il = sh.inter_l
            if self.quant4:                            # the four projections packed 4-bit
                wqkv, wo, wgu, wd = packed_layers.load_projections(source, p, sh, hd, self.device)
            else:
                wgu, wgu_v = mat(2 * il, H)
                fetch(wgu_v[:il], p + "mlp.gate_proj.weight", 0, *sh.ff)
                fetch(wgu_v[il:], p + "mlp.up_proj.weight", 0, *sh.ff)
                wd, wd_v = mat(H, il)
                fetch(wd_v, p + "mlp.down_proj.weight", 1, *sh.ff)
            layers.append(Layer(ln1, wqkv, bqkv, wo, bo, ln2, wgu, wd,
                                 self._k_layers[i], self._v_layers[i]))
        self.norm = torch.empty(H, **kw)
        fetch(self.norm, "model.norm.weight")
        if packed_tied:
            pass
        elif tied and v1 - v0 == sh.v_chunk and not self.packed:   # a view: no extra memory
            self.head = emb_store[:, v0:v1] if self.transposed else emb_store[v0:v1]
        else:                                      # zero-padded to v_chunk rows
            self.head, head_v = mat(sh.v_chunk, H)
            if not self.packed:                    # (packed weights start zeroed)
                self.head.zero_()
            if self.quant_cpu and v1 - v0 < sh.v_chunk:   # zero padding rows, float32
                head_v[v1 - v0:].load([(0, torch.zeros(sh.v_chunk - (v1 - v0), H))])
            if v1 > v0:
                if tied and self.quant_cpu:
                    fetch(head_v[:v1 - v0], "model.embed_tokens.weight", 0, v0, v1)
                elif tied:
                    head_v[:v1 - v0].copy_(self.embed[v0:v1])
                else:
                    fetch(head_v[:v1 - v0], "lm_head.weight", 0, v0, v1)
        self.layers = layers


def _names(source) -> list[str]:
    names = getattr(source, "names", None)
    return list(names()) if callable(names) else []
