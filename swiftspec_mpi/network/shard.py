"""`TPShard`: the slice of every weight that one tensor-parallel rank holds (see
transformer.py's docstring for the layout: column-parallel QKV and gate|up, row-parallel O and
down, vocab-parallel head)."""
from __future__ import annotations

from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.network.config import ModelConfig


class TPShard:
    """Which part of each weight tensor-parallel rank `rank` of `size` holds (index arithmetic
    only, no tensors): query heads [q0, q0 + nh_l) as q_rows, the KV heads they use (kv_heads,
    nkv_l, group query heads per local KV head), MLP columns ff = [f0, f1), vocab rows."""

    def __init__(self, cfg: ModelConfig, rank: int, size: int):
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if nh % size:
            raise UserError(f"tensor-parallel degree {size} does not divide the model's "
                            f"{nh} attention heads; use a group size that divides {nh}")
        self.nh_l = nh // size
        q0 = rank * self.nh_l
        self.q_rows = (q0 * hd, (q0 + self.nh_l) * hd)
        group = nh // nkv
        kv_of_q = [(q0 + j) // group for j in range(self.nh_l)]
        distinct = sorted(set(kv_of_q))
        per = self.nh_l // len(distinct)
        if self.nh_l % len(distinct) == 0 and all(kv_of_q.count(h) == per for h in distinct):
            self.kv_heads = distinct             # each local KV head serves `per` query heads
            self.group = per
        else:                                   # uneven: one KV copy per local query head
            self.kv_heads = kv_of_q
            self.group = 1
        self.nkv_l = len(self.kv_heads)
        inter = cfg.intermediate_size
        chunk = -(-inter // size)
        self.ff = (min(inter, rank * chunk), min(inter, (rank + 1) * chunk))
        self.inter_l = self.ff[1] - self.ff[0]
        V = cfg.vocab_size
        self.v_chunk = -(-V // size)
        self.vocab = (min(V, rank * self.v_chunk), min(V, (rank + 1) * self.v_chunk))

    def kv_runs(self, hd: int) -> list[tuple[int, int]]:
        """Row ranges of k_proj/v_proj for the local KV heads, contiguous runs merged."""
        runs: list[list[int]] = []
        for h in self.kv_heads:
            if runs and runs[-1][1] == h * hd:
                runs[-1][1] = (h + 1) * hd
            else:
                runs.append([h * hd, (h + 1) * hd])
        return [tuple(r) for r in runs]
