"""The C layer ops of the CPU decode path (packed/cpu_ops.py, csrc/layer_ops.h) against torch."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import skip_or_fail
from swiftspec_mpi.packed import cpu_linear, cpu_ops


@pytest.fixture(autouse=True)
def _cpu_runs_the_kernel():
    if not cpu_linear.has_avx2():
        skip_or_fail("this CPU lacks AVX2 + FMA, the layer ops' instructions")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("M", [1, 3, 16])
def test_add_rmsnorm_matches_torch(M):
    gen = torch.Generator().manual_seed(M)
    H = 264
    x = torch.randn(M, H, generator=gen) * 3
    a = torch.randn(M, H, generator=gen)
    w = torch.randn(H, generator=gen)
    ref_x = x + a
    ref = F.rms_norm(ref_x, (H,), w, 1e-6)
    h = cpu_ops.add_rmsnorm(x, a, w, 1e-6)
    assert torch.equal(x, ref_x)                          # the residual add, in place
    assert _rel(h, ref) < 1e-6
    assert _rel(cpu_ops.add_rmsnorm(x, None, w, 1e-6), ref) < 1e-6


def test_rope_kv_matches_torch_and_writes_the_cache():
    gen = torch.Generator().manual_seed(1)
    M, nh, nkv, hd, half = 5, 4, 2, 32, 16
    qkv = torch.randn(M, (nh + 2 * nkv) * hd, generator=gen)
    ang = torch.rand(50, hd, generator=gen) * 6
    cos, sin = ang.cos(), ang.sin()
    sin[:, :half] = -sin[:, :half]
    pos = torch.tensor([7, 3, 40, 41, 0])
    qk = qkv[:, :(nh + nkv) * hd].view(M, nh + nkv, hd)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    ref = qk * c + torch.roll(qk, half, -1) * s
    v_ref = qkv[:, (nh + nkv) * hd:].view(M, nkv, hd).clone()
    kc, vc = torch.zeros(20, nkv, hd), torch.zeros(20, nkv, hd)
    cpu_ops.rope_kv(qkv, pos, cos, sin, nh, nkv, kc, vc, 9)
    assert _rel(qkv[:, :(nh + nkv) * hd].view(M, nh + nkv, hd), ref) < 1e-6
    assert torch.equal(kc[9:14], qkv[:, nh * hd:(nh + nkv) * hd].view(M, nkv, hd))
    assert torch.equal(vc[9:14], v_ref)
    assert kc[:9].abs().sum() == 0 and kc[14:].abs().sum() == 0
    with pytest.raises(ValueError, match="outside the tables"):
        cpu_ops.rope_kv(qkv, torch.tensor([0, 1, 2, 3, 50]), cos, sin, nh, nkv, kc, vc, 0)
    with pytest.raises(ValueError, match="past the cache"):
        cpu_ops.rope_kv(qkv, pos, cos, sin, nh, nkv, kc, vc, 16)


@pytest.mark.parametrize("M,S,nh,nkv,hd", [(1, 1, 2, 1, 16), (1, 301, 12, 2, 128),
                                           (8, 100, 14, 2, 64), (16, 37, 9, 3, 64)])
def test_attention_matches_sdpa(M, S, nh, nkv, hd):
    gen = torch.Generator().manual_seed(S)
    q = torch.randn(M, nh * hd, generator=gen)
    kc, vc = torch.randn(S + 5, nkv, hd, generator=gen), torch.randn(S + 5, nkv, hd, generator=gen)
    mask = torch.rand(M, S, generator=gen) < 0.7
    mask[:, 0] = True
    got = cpu_ops.attention(q, kc, vc, mask, nh)
    ref = F.scaled_dot_product_attention(
        q.view(M, nh, hd).transpose(0, 1).unsqueeze(0), kc[:S].transpose(0, 1).unsqueeze(0),
        vc[:S].transpose(0, 1).unsqueeze(0), attn_mask=mask, enable_gqa=nh != nkv)
    ref = ref[0].transpose(0, 1).reshape(M, nh * hd)
    assert _rel(got, ref) < 2e-6
    with pytest.raises(ValueError, match="must be bool"):
        cpu_ops.attention(q, kc, vc, mask.float(), nh)


def test_attention_row_depends_on_its_visible_slots_only():
    """A token's output is the same bits in a one-token step and inside a tree verify, where its
    visible slots lie elsewhere and other rows (and threads) share the call."""
    gen = torch.Generator().manual_seed(2)
    nh, nkv, hd = 6, 2, 64
    kc, vc = torch.randn(64, nkv, hd, generator=gen), torch.randn(64, nkv, hd, generator=gen)
    q = torch.randn(4, nh * hd, generator=gen)
    vis = torch.tensor([0, 1, 2, 5, 6, 9, 10, 11, 12, 13, 20])        # 11 visible slots
    tree = torch.zeros(4, 30, dtype=torch.bool)
    tree[:, :3] = True
    tree[2, vis] = True
    full = cpu_ops.attention(q, kc, vc, tree, nh, n_threads=2)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)             # the same values, compacted
    kc2[:len(vis)], vc2[:len(vis)] = kc[vis], vc[vis]
    one = cpu_ops.attention(q[2:3], kc2, vc2, torch.ones(1, len(vis), dtype=torch.bool), nh,
                            n_threads=1)
    assert torch.equal(one[0], full[2])


@pytest.mark.parametrize("I", [96, 45, 3])
def test_silu_mul_matches_torch(I):
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(3, 2 * I, generator=gen) * 6
    gu[0, :3] = torch.tensor([-100.0, -87.0, 60.0])
    ref = F.silu(gu[:, :I]) * gu[:, I:]
    got = cpu_ops.silu_mul(gu)
    assert got.shape == (3, I) and _rel(got, ref) < 1e-6
    assert torch.equal(cpu_ops.silu_mul(gu[1:2]), got[1:2])       # rows independent of M


def test_usable_sizes():
    assert cpu_ops.usable(torch.float32, 64, 128, 1536)
    assert not cpu_ops.usable(torch.float32, 65, 128, 1536)
    assert not cpu_ops.usable(torch.bfloat16, 1, 128, 1536)
    assert not cpu_ops.usable(torch.float32, 1, 256, 1536)
    assert not cpu_ops.usable(torch.float32, 1, math.gcd(24, 40), 1536)
