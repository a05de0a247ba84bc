"""The byte layout of a CUDA-graph step's inputs (swiftspec_mpi.gpu.graphs.step_input_layout /
pack_step_inputs), checked on the CPU with the same tensor views GraphedModel makes of its pinned
and device buffers: the attention kernel reads the context length as an int32 at the int64
word's address, the mask starts 16-byte aligned, and only a step's own columns are written."""
from __future__ import annotations

import numpy as np
import pytest

import torch

from swiftspec_mpi.gpu.graphs import pack_step_inputs, step_input_layout  # noqa: E402


def _views(n: int, S: int):
    """uint8 buffer -> (int64 words, bool mask [n, S], int32 n_valid) as _Static builds them."""
    words, mask_off, nbytes = step_input_layout(n, S)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    ints = buf[:8 * words].view(torch.int64)
    mask = buf[mask_off:].view(torch.bool).view(n, S)
    n_valid = ints[3 * n:].view(torch.int32)[:1]
    return buf, ints, mask, n_valid, mask_off


@pytest.mark.parametrize("n,S", [(1, 1152), (2, 40), (8, 1152), (13, 300), (64, 4096)])
def test_step_inputs_pack_into_the_views_the_graph_reads(n, S):
    buf, ints, mask, n_valid, mask_off = _views(n, S)
    assert mask_off % 16 == 0 and mask_off >= 8 * (3 * n + 1)
    assert buf.numel() == mask_off + n * S
    rng = np.random.default_rng(n * 1000 + S)
    mask.numpy()[:, :] = True                      # a previous, longer step's leftovers
    for start in (S - n - 7, 0, S - n):            # contexts that shrink, then grow
        tokens = torch.from_numpy(rng.integers(0, 150_000, n))
        positions = torch.from_numpy(rng.integers(0, 1 << 20, n).astype(np.int32))   # any int dtype
        step_mask = torch.from_numpy(rng.random((n, start + n)) < 0.5)
        before = mask.numpy()[:, start + n:].copy()
        pack_step_inputs(ints.numpy(), mask.numpy(), tokens, positions, start, step_mask)
        got = ints.numpy()
        assert np.array_equal(got[:n], tokens.numpy())
        assert np.array_equal(got[n:2 * n], positions.numpy())
        assert np.array_equal(got[2 * n:3 * n], np.arange(start, start + n))
        assert got[3 * n] == start + n and int(n_valid[0]) == start + n        # the kernel's int32
        assert np.array_equal(mask.numpy()[:, :start + n], step_mask.numpy())
        assert np.array_equal(mask.numpy()[:, start + n:], before), "columns past the context were written"


def test_pack_takes_numpy_inputs_too():
    buf, ints, mask, n_valid, _ = _views(3, 16)
    pack_step_inputs(ints.numpy(), mask.numpy(), np.array([5, 6, 7]), np.array([9, 10, 10]), 4,
                     np.ones((3, 7), dtype=bool))
    assert ints.tolist() == [5, 6, 7, 9, 10, 10, 4, 5, 6, 7] and int(n_valid[0]) == 7
    assert mask[:, :7].all() and not mask[:, 7:].any()
