"""Packed 4-/8-bit weights on the CPU: GGUF blocks -> PackedInt4 / PackedInt8 (bit-exact against
gguf.quants.dequantize), the AVX2 packed GEMM (csrc/gemm_q_avx2.h) against a float64 product of
the dequantized weights, tiny packed models (GGUF, AWQ, GPTQ, random int4) against their
dequantized twins, bad input through the CLI, the tiny AWQ pair greedy ar == async packed through
`swiftspec run`, and greedy ar == sync == async on the real SmolLM2 (Q4_1) in 4-bit.

The opt-in tests (`pytest -m slow`) check the real Qwen2.5-Coder Q4_K_M pair: logits against
transformers' GGUF loader (which dequantizes to float32) and ar == sync == async (1+1, 1+2).
"""
from __future__ import annotations

import json
import os

import gguf
import h5py
import numpy as np
import pytest
import torch

from conftest import max_rel_diff, need_registry_model, skip_or_fail
from swiftspec_mpi.checkpoints import gguf_quant
from swiftspec_mpi.packed import cpu_linear, cpu_quant, int4, int8

Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def _cpu_runs_the_kernel():
    """A machine condition: the packed kernels need AVX2 + FMA (the extension always imports)."""
    if not cpu_linear.has_avx2():
        skip_or_fail("this CPU lacks AVX2 + FMA, the packed CPU kernel's instructions")

# the kernel's error bound, relative to sum_k |x_k| |W_kj| (+ |b_j|): activations split in two
# int16 parts leave <= max|x| / 2^31 per input; the rest is float32 rounding of the per-group
# scale and offset terms, which cancel partly (measured <= 1.2e-6 with an outlier channel)
KERNEL_RTOL = 4e-6
# the AVX2 byte path (4- and 6-bit records without AVX-512 VNNI): two int8 parts leave
# <= max|x| / (4 127^2) ~ 1.6e-5 max|x| per input of a group, so a group whose max is a 300x
# outlier channel puts up to ~5e-3 of its other inputs' |x| on each (measured <= 1.1e-3 of
# sum |x| |W| on the outputs with groups of 64 and 128)
KERNEL_RTOL_BYTES = 2e-3
# a packed model's logits against its dequantized twin's (relative to the largest): the int16
# parts leave float32-level differences; the byte path's two int8 parts measured <= 2.0e-4 on
# the tiny models below (the real Qwen2.5-Coder 1.5B: 2.1e-4 against transformers)
MODEL_RTOL, MODEL_RTOL_BYTES = 1e-5, 5e-4


def _byte_path(kind: str = "int4") -> bool:
    """Whether records of `kind` ('int4/...', 'int6/...', 'int8/...') run the AVX2 byte path on the
    instruction set the packed GEMM runs now (4- and 6-bit records on AVX2 without AVX-512 VNNI)."""
    from swiftspec_mpi.packed import _cpu_gemm
    return _cpu_gemm.quant_isa() == "avx2" and not kind.startswith("int8")


def _rtol(kind: str) -> float:
    """The bound for a GEMM of `kind` on the instruction set the packed GEMM runs now."""
    return KERNEL_RTOL_BYTES if _byte_path(kind) else KERNEL_RTOL


def _model_rtol() -> float:
    """The bound for a packed model's logits against its dequantized twin (4-bit layers) on the
    instruction set the packed GEMM runs now."""
    return MODEL_RTOL_BYTES if _byte_path() else MODEL_RTOL


def _deq(w) -> torch.Tensor:
    return int4.dequantize(w) if isinstance(w, int4.PackedInt4) else int8.dequantize(w)


def _blocks_by_layout(qtype, rows: int, k: int, rng) -> np.ndarray:
    """Random valid blocks of a type gguf cannot quantize (Q4_K, Q6_K), finite fp16 scales."""
    bw, bb = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // bw, bb), dtype=np.uint8)
    d = (rng.uniform(0.2, 2.0, (rows, k // bw, 2)) * 1e-2).astype(np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, :, 0:2], raw[:, :, 2:4] = d[:, :, 0:2], d[:, :, 2:4]
    else:                                            # Q6_K: d at the end
        raw[:, :, 208:210] = d[:, :, 0:2]
    return raw.reshape(rows, -1)


ALL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q6_K]


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory):
    """A GGUF file written by gguf.GGUFWriter with one [48, 512] tensor per type: quantized by
    gguf.quants where it can, blocks built by the published layout for Q4_K and Q6_K."""
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("q") / "types.gguf"
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    raws = {}
    for t in ALL_TYPES:
        if t in (Q.Q4_K, Q.Q6_K):
            raw = _blocks_by_layout(t, 48, 512, rng)
        else:
            raw = gguf.quants.quantize(rng.standard_normal((48, 512)).astype(np.float32), t)
        w.add_tensor(f"t_{t.name}", raw, raw_dtype=t)
        raws[t.name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, raws


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_gguf_blocks_pack_bit_exactly(typed_gguf, qtype):
    path, _ = typed_gguf
    reader = gguf.GGUFReader(os.fspath(path))
    tensor = next(t for t in reader.tensors if t.name == f"t_{qtype.name}")
    raw = np.asarray(tensor.data).reshape(48, -1)
    ref = gguf.quants.dequantize(raw, qtype).reshape(48, 512)
    packed = gguf_quant.to_packed(raw, qtype.name, 512)
    packed.check()
    kind = int4.PackedInt4 if qtype.name in gguf_quant.INT4_TYPES else int8.PackedInt8
    assert isinstance(packed, kind)
    assert packed.group == (16 if qtype == Q.Q6_K else 32)
    ours = _deq(packed).numpy()
    # identical values (the only bit difference allowed is the sign of a zero: Q4_0's
    # (q - 8) * d gives -0.0 where q * d - 8 d gives +0.0)
    assert np.array_equal(ours, ref)
    nz = ref != 0
    assert np.array_equal(ours.view(np.uint32)[nz], ref.view(np.uint32)[nz])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_levels_are_the_float32_scales(typed_gguf, qtype):
    """The two levels to_packed keeps for Q4_K / Q6_K multiply out to the very float32 scale
    and offset, so the kernel's two-level records (4.75 / 6.625 bits a weight) hold the same
    weights: Q4_K's give bit-identical GEMM results to the one-level records, Q6_K's (codes
    q + 32 with offset -32 scale) match a float64 product within the kernel's bound."""
    _, raws = typed_gguf
    packed = gguf_quant.to_packed(raws[qtype.name], qtype.name, 512)
    sup = packed.sup
    rep = 256 // packed.group
    assert torch.equal(sup.d.repeat_interleave(rep, 1) * sup.sc.float(), packed.scale)
    if qtype == Q.Q4_K:
        assert torch.equal(-(sup.dmin.repeat_interleave(rep, 1) * sup.m.float()), packed.offset)
    else:
        assert sup.dmin is None and packed.offset is None
    two, one = cpu_quant.QuantLinear(48, 512), cpu_quant.QuantLinear(48, 512)
    two.load(0, 48, [(0, packed)])
    flat = type(packed)(packed.qweight, packed.scale, packed.offset, packed.group)   # no levels
    one.load(0, 48, [(0, flat)])
    assert two.kinds()[0].endswith("/sb256") and not one.kinds()[0].endswith("/sb256")
    assert two.nbytes() < 0.8 * one.nbytes()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 512, generator=gen)
    if qtype == Q.Q4_K:
        assert torch.equal(cpu_quant.linear(x, two), cpu_quant.linear(x, one))
    wd = _deq(packed).double()
    ref, scale = x.double() @ wd.t(), x.double().abs() @ wd.abs().t()
    assert ((cpu_quant.linear(x, two).double() - ref).abs() / scale).max() <= _rtol(two.kinds()[0])
    cut = gguf_quant.take_columns(packed, 0, 256)        # a whole super-block keeps the levels
    assert cut.sup is not None and cut.sup.d.shape == (48, 1)
    assert gguf_quant.take_columns(packed, 0, 128).sup is None


def test_column_slices_on_group_boundaries(typed_gguf):
    path, raws = typed_gguf
    p = gguf_quant.to_packed(raws["Q4_K"], "Q4_K", 512)
    part = gguf_quant.take_columns(p, 256, 512)
    assert torch.equal(_deq(part), _deq(p)[:, 256:])
    with pytest.raises(ValueError, match="split groups"):
        gguf_quant.take_columns(p, 16, 512)


# ------------------------------------------------------------------------------ kernel

def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _rand_packed(kind: str, n: int, k: int, gen) -> object:
    """Random packed weights of `kind`: 'int4/g32/o' (scale, offset), 'int8/g16/-' (no offset),
    'int4/g32/k' and 'int6/g16/k' (GGUF Q4_K / Q6_K: two-level scales, products as gguf forms
    them; K a multiple of 256)."""
    bits, group, off = kind.split("/")
    g = int(group[1:])
    if off == "k":
        d = _fp16(torch.rand(n, k // 256, generator=gen) * 1e-3 + 1e-5)
        if bits == "int4":
            sc = torch.randint(0, 64, (n, k // g), dtype=torch.int8, generator=gen)
            m = torch.randint(0, 64, (n, k // g), dtype=torch.int8, generator=gen)
            dmin = _fp16(torch.rand(n, k // 256, generator=gen) * 1e-3)
            rep = 256 // g
            return int4.PackedInt4(
                torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                d.repeat_interleave(rep, 1) * sc.float(), -(dmin.repeat_interleave(rep, 1) * m.float()),
                g, int4.SuperScales(d, sc, dmin, m))
        sc = torch.randint(-128, 128, (n, k // g), dtype=torch.int8, generator=gen)
        return int8.PackedInt8(
            torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen),
            d.repeat_interleave(256 // g, 1) * sc.float(), None, g, int4.SuperScales(d, sc))
    if bits == "int4":
        return int4.PackedInt4(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen),
                                torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3,
                                torch.randn(n, k // g, generator=gen) * 0.01, g)
    return int8.PackedInt8(torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen),
                                 torch.rand(n, k // g, generator=gen) * 2e-3 + 1e-5,
                                 torch.randn(n, k // g, generator=gen) * 0.01 if off == "o" else None,
                                 g)


KINDS = ["int4/g32/o", "int4/g64/o", "int4/g128/o", "int8/g16/-", "int8/g32/-", "int8/g32/o",
         "int4/g32/k", "int6/g16/k"]


def _isas() -> list[str]:
    """The packed GEMM's instruction sets this CPU runs (AVX2 always; AVX-512 VNNI where present)."""
    from swiftspec_mpi.packed import _cpu_gemm
    try:
        _cpu_gemm.set_quant_isa("avx512vnni")
        return ["avx2", "avx512vnni"]
    except ValueError:
        return ["avx2"]
    finally:
        _cpu_gemm.set_quant_isa(None)


@pytest.fixture
def quant_isa(request):
    """Run the packed GEMM with the instruction set request.param, the CPU's best after."""
    from swiftspec_mpi.packed import _cpu_gemm
    if request.param not in _isas():
        pytest.skip(f"this CPU has no {request.param}")
    _cpu_gemm.set_quant_isa(request.param)
    yield request.param
    _cpu_gemm.set_quant_isa(None)


@pytest.mark.parametrize("quant_isa", ["avx2", "avx512vnni"], indirect=True)
@pytest.mark.parametrize("kind,n,k", [(kind, n, k) for kind in KINDS
                                      for n, k in ((37, 256), (16, 128), (203, 384), (40, 512))
                                      if k % int(kind.split("/")[1][1:]) == 0
                                      and kind.endswith("k") == (k == 512)])
def test_packed_gemm_matches_float64_every_m(kind, n, k, quant_isa):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = _rand_packed(kind, n, k, gen)
    lin = cpu_quant.QuantLinear(n, k)
    lin.load(0, n, [(0, w)])
    assert lin.kinds()[0].endswith("/sb256") == kind.endswith("k"), lin.kinds()
    wd = _deq(w).double()
    b = torch.randn(n, generator=gen)
    for m in range(1, 17):
        x = torch.randn(m, k, generator=gen) * torch.rand(1, k, generator=gen) * 4
        x[:, 3] *= 300.0                                  # an outlier channel, as real models have
        ref = x.double() @ wd.t() + b.double()
        scale = x.double().abs() @ wd.abs().t() + b.double().abs()
        for nt in (1, 2):
            y = cpu_quant.linear(x, lin, b, n_threads=nt)
            err = ((y.double() - ref).abs() / scale).max().item()
            assert err <= _rtol(kind), (m, nt, err)


def test_packed_gemm_across_instruction_sets():
    """8-bit records give the same bits on AVX2 and AVX-512 VNNI (exact integer sums, the same
    float32 steps per output); 4- and 6-bit records run the AVX2 byte path (two int8 parts of
    the activations) there and the int16 path on AVX-512 VNNI, so they agree within its bound."""
    from swiftspec_mpi.packed import _cpu_gemm
    if len(_isas()) < 2:
        pytest.skip("this CPU has no AVX-512 VNNI: one instruction set only")
    gen = torch.Generator().manual_seed(11)
    for kind in KINDS:
        n, k = 203, 512
        w = _rand_packed(kind, n, k, gen)
        lin = cpu_quant.QuantLinear(n, k)
        lin.load(0, n, [(0, w)])
        wd = _deq(w).double()
        b = torch.randn(n, generator=gen)
        for m in (1, 2, 3, 5, 8, 16, 19):
            x = torch.randn(m, k, generator=gen)
            x[:, 7] *= 500.0
            got = {}
            for isa in ("avx2", "avx512vnni"):
                _cpu_gemm.set_quant_isa(isa)
                got[isa] = cpu_quant.linear(x, lin, b, n_threads=2)
            _cpu_gemm.set_quant_isa(None)
            if kind.startswith("int8"):
                assert torch.equal(got["avx2"], got["avx512vnni"]), (kind, m)
            else:
                scale = x.double().abs() @ wd.abs().t() + b.double().abs()
                err = ((got["avx2"].double() - got["avx512vnni"].double()).abs() / scale).max()
                assert err <= KERNEL_RTOL_BYTES + KERNEL_RTOL, (kind, m, err)
    with pytest.raises(ValueError, match="cannot run"):
        _cpu_gemm.set_quant_isa("sse2")


def test_packed_gemm_rows_do_not_depend_on_batch_or_threads():
    """Deterministic: a row's result is the same bits whatever M, its neighbours, the threads."""
    gen = torch.Generator().manual_seed(3)
    n, k = 100, 256
    lin = cpu_quant.QuantLinear(n, k)
    lin.load(0, 48, [(0, _rand_packed("int4/g32/o", 48, k, gen))])      # two segments of
    lin.load(48, n, [(0, _rand_packed("int8/g16/-", n - 48, k, gen))])  # different kinds
    x = torch.randn(16, k, generator=gen)
    full = cpu_quant.linear(x, lin, n_threads=2)
    for i in range(16):
        assert torch.equal(cpu_quant.linear(x[i:i + 1], lin, n_threads=1)[0], full[i])
    assert torch.equal(cpu_quant.linear(x[:7], lin, n_threads=1), full[:7])


def test_quant_linear_rejects_gaps_and_mismatches():
    gen = torch.Generator().manual_seed(0)
    lin = cpu_quant.QuantLinear(64, 128)
    with pytest.raises(ValueError):
        lin.load(0, 64, [(0, _rand_packed("int4/g32/o", 32, 128, gen))])      # too few rows
    with pytest.raises(ValueError):
        lin.load(0, 32, [(0, _rand_packed("int4/g32/o", 32, 64, gen))])       # wrong K


# ------------------------------------------------------------------------------ tiny model

def test_tiny_model_packed_equals_dequantized(tmp_path):
    from test_gguf import write_tiny_gguf

    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    path = tmp_path / "tiny-q.gguf"
    write_tiny_gguf(path, "qwen2", tied=False,
                    qtypes={"embd": Q.Q4_1, "attn": Q.Q4_0, "ffn": Q.Q4_1, "output": Q.Q8_0})
    packed, _ = load_model(path, max_slots=64)                 # auto: runs packed
    dense, _ = load_model(path, max_slots=64, quant="none")
    assert packed.quant_cpu and not dense.quant_cpu
    assert packed.weight_bytes() < dense.weight_bytes() / 2
    assert packed.layers[0][1].kinds() == ["int4/g32"] * 3          # q, k, v segments
    assert packed.head.kinds() == ["int8/g32"]
    ids = torch.tensor([5, 77, 256, 3, 200, 100, 42, 259, 7])
    mask = chain_mask(0, len(ids))
    a = packed(ids, torch.arange(len(ids)), 0, mask)
    b = dense(ids, torch.arange(len(ids)), 0, mask)
    assert max_rel_diff(a, b) <= _model_rtol()


def test_gguf_packed_chunks_column_shards_on_group_boundaries(tmp_path):
    """A row-parallel shard (dim 1) of a packed GGUF matrix: whole groups of 32 give the exact
    columns of the dequantized matrix; a cut inside a group is refused by name. packed_group
    reports the file's group (what rank 0 checks tensor-parallel degrees against)."""
    from test_gguf import write_tiny_gguf

    from swiftspec_mpi.checkpoints import gguf_loader, load
    from swiftspec_mpi.core.errors import CheckpointError

    path = tmp_path / "tiny-q.gguf"
    write_tiny_gguf(path, "qwen2", tied=True, qtypes={"attn": Q.Q4_0, "ffn": Q.Q4_1})
    assert load.packed_group(path, "auto") == 32 and load.packed_group(path, "none") is None
    with gguf_loader.GGUFSource(path) as src:
        name = "model.layers.0.mlp.down_proj.weight"
        k = src.shape(name)[1]
        whole = src.get(name)
        for a, b in ((0, 32), (32, k), (64, k - 32)):
            (off, w), = list(src.packed_chunks(name, 1, a, b))
            assert off == 0 and isinstance(w, int4.PackedInt4)
            assert torch.equal(int4.dequantize(w), whole[:, a:b])
        with pytest.raises(CheckpointError, match="groups of 32"):
            list(src.packed_chunks(name, 1, 16, 48))


@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq-v2"])
def test_tiny_hf_4bit_model_packed_equals_dequantized(tmp_path, layout):
    """An AWQ / GPTQ folder (--quant auto on the CPU) keeps its layers packed 4-bit in groups of
    32, read through SafetensorsSource.packed_chunks, and gives the logits of its dequantized
    twin (--quant none) up to the kernel's activation rounding."""
    from swiftspec_mpi.checkpoints import tiny
    from swiftspec_mpi.checkpoints.load import load_model, packed_group
    from swiftspec_mpi.network.transformer import chain_mask

    target, _ = tiny.write_tiny_pair(str(tmp_path / layout), intermediate=192, quantize=layout)
    assert packed_group(target, "auto") == 32
    packed, _ = load_model(target, max_slots=64)
    dense, _ = load_model(target, max_slots=64, quant="none")
    assert packed.quant_cpu and not dense.quant_cpu
    assert packed.layers[0][1].kinds() == ["int4/g32"] * 3          # q, k, v segments
    assert packed.layers[0][7].kinds() == ["int4/g32"]              # down_proj
    assert packed.weight_bytes() < dense.weight_bytes()
    ids = torch.tensor([5, 300, 17, 1999, 42, 7, 123, 1024])
    mask = chain_mask(0, len(ids))
    a = packed(ids, torch.arange(len(ids)), 0, mask)
    b = dense(ids, torch.arange(len(ids)), 0, mask)
    assert max_rel_diff(a, b) <= _model_rtol()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_dummy_int4_runs_packed_on_the_cpu():
    """--load-format dummy --quant int4 on the CPU: random packed projections (group 128) in the
    packed CPU layers, the same weights the dequantized twin holds."""
    from model_configs import small_config
    from swiftspec_mpi.checkpoints import dummy
    from swiftspec_mpi.network.transformer import Transformer, chain_mask

    cfg = small_config("llama", vocab_size=512, hidden_size=256, intermediate_size=384, num_layers=2,
                       head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=256)
    packed = Transformer(cfg, max_slots=32, quant="int4")
    packed.load_weights(dummy.RandomPackedSource(cfg))
    assert packed.quant_cpu and packed.layers[0][1].kinds() == ["int4/g128"] * 3

    class Dequantized(dummy.RandomPackedSource):      # the same weights, dense
        def get(self, name, dim=None, start=0, stop=None):
            if self.is_packed(name):
                return int4.dequantize(self.get_packed(name, dim, start, stop))
            return super().get(name, dim, start, stop)

    dense = Transformer(cfg, max_slots=32)
    dense.load_weights(Dequantized(cfg))
    ids = torch.tensor([3, 100, 7, 400, 42])
    mask = chain_mask(0, len(ids))
    a = packed(ids, torch.arange(len(ids)), 0, mask)
    b = dense(ids, torch.arange(len(ids)), 0, mask)
    assert max_rel_diff(a, b) <= _model_rtol()


@pytest.mark.mpi
def test_tiny_awq_pair_greedy_ar_equals_async_packed(tmp_path):
    """`swiftspec tiny-checkpoint --quantize awq` pair through `swiftspec run --device cpu`:
    --quant auto resolves to int4 (recorded in the trace's config) and greedy ar == async."""
    from engine_helpers import read_outputs, run_swiftspec

    from swiftspec_mpi.cli import main as cli
    assert cli.main(["tiny-checkpoint", "--quantize", "awq", str(tmp_path / "awq")]) == 0
    target, draft = str(tmp_path / "awq" / "target"), str(tmp_path / "awq" / "draft")
    outs = {}
    for mode, n in (("ar", 1), ("async", 2)):
        out = tmp_path / f"{mode}.h5"
        run_swiftspec(n, ["--target", target, "--draft", draft, "--mode", mode, "--device", "cpu",
                          "--prompt", "def fibonacci(n):", "--max-new-tokens", "24",
                          "--ignore-eos", "--out", str(out), "--quiet"])
        with h5py.File(out, "r") as f:
            assert json.loads(f.attrs["config_json"])["quant"] == "int4"
        outs[mode] = read_outputs(out)
    assert len(outs["ar"][0]) == 24
    assert outs["ar"] == outs["async"], outs


# ------------------------------------------------------------------------------ bad input

def _run_cli(tmp_path, args):
    from engine_helpers import run_swiftspec
    return run_swiftspec(1, ["--mode", "ar", "--max-new-tokens", "4", "--prompt", "hi",
                             "--out", str(tmp_path / "bad.h5"), "--quiet", *args], check=False,
                         timeout=300)


def _one_clean_error(proc, pattern: str) -> None:
    import re
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and re.search(pattern, errors[0]), proc.stderr[-2000:]


@pytest.mark.mpi
def test_bad_packed_checkpoints_fail_cleanly(tmp_path):
    from test_gguf import write_tiny_gguf

    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, "qwen2", tied=True, qtypes={"attn": Q.Q4_0, "ffn": Q.Q4_1})
    data = good.read_bytes()
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(data[:len(data) - 100])           # the last packed tensor cut short
    _one_clean_error(_run_cli(tmp_path, ["--target", str(truncated)]), "truncated")
    unknown = tmp_path / "iq.gguf"
    write_tiny_gguf(unknown, "qwen2", raw_zero={"blk.0.ffn_up.weight": Q.IQ4_NL})
    _one_clean_error(_run_cli(tmp_path, ["--target", str(unknown)]), "IQ4_NL.*not supported")
    dense = tmp_path / "dense.gguf"
    write_tiny_gguf(dense, "qwen2", qtypes={"embd": Q.F16, "attn": Q.F16, "ffn": Q.F16})
    _one_clean_error(_run_cli(tmp_path, ["--target", str(dense), "--quant", "int4"]),
                     "holds dense weights")


@pytest.mark.mpi
def test_dummy_int4_on_a_shape_without_whole_groups_fails_cleanly(tmp_path, tiny_pair):
    """Random packed weights come in groups of 128: the tiny pair's shape (hidden 64) is refused
    by rank 0 in one line, before any rank generates weights."""
    _one_clean_error(_run_cli(tmp_path, ["--load-format", "dummy", "--target", tiny_pair[0],
                                         "--quant", "int4", "--device", "cpu"]),
                     r"groups of 128 inputs, which the target's hidden size 64")


# ------------------------------------------------------------------------------ real models

def _registry_gguf(name: str):
    from swiftspec_mpi.checkpoints import registry
    need_registry_model(name)
    return str(registry.ensure_gguf(name))


def _greedy_outputs(tmp_path, runs, common, timeout):
    from engine_helpers import read_outputs, run_swiftspec
    outs = {}
    for label, n, args in runs:
        out = tmp_path / f"{label}.h5"
        run_swiftspec(n, [*common, *args, "--out", str(out), "--quiet"], timeout=timeout)
        with h5py.File(out, "r") as f:
            assert json.loads(f.attrs["config_json"])["quant"] == "int4"
        outs[label] = read_outputs(out)
    return outs


@pytest.mark.mpi
def test_smollm2_packed_ar_sync_async_equal(tmp_path):
    """The fast real check: SmolLM2-135M Q4_1 (packed), self-speculation with 12 layers."""
    from engine_helpers import write_prompts
    target = _registry_gguf("smollm2-135m")
    prompts = write_prompts(tmp_path / "p.jsonl", ["def fibonacci(n):"])
    common = ["--target", target, "--draft-layers", "12", "--prompts", prompts,
              "--max-new-tokens", "32"]
    outs = _greedy_outputs(tmp_path, [("ar", 1, ["--mode", "ar"]), ("sync", 1, ["--mode", "sync"]),
                                      ("async", 2, ["--mode", "async"])], common, 600)
    assert outs["ar"] == outs["sync"] == outs["async"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_qwen_packed_logits_match_transformers(name):
    import accelerate  # noqa: F401  (transformers loads GGUF files through it)
    import transformers
    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask

    path = _registry_gguf(name)
    model, tok = load_model(path, max_slots=256)
    assert model.quant_cpu
    ids = tok.encode(tok.apply_chat_template("Write a Python function that reverses a list."))
    n = len(ids)
    ours = model(torch.tensor(ids), torch.arange(n), 0, chain_mask(0, n))
    del model
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    rel = max_rel_diff(ours, ref)
    assert rel <= 1e-3, rel
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
@pytest.mark.mpi
def test_qwen_pair_packed_modes_equal(tmp_path):
    from engine_helpers import write_prompts
    target = _registry_gguf("qwen2.5-coder-1.5b")
    draft = _registry_gguf("qwen2.5-coder-0.5b")
    prompts = write_prompts(tmp_path / "p.jsonl", ["Write a Python function that merges two sorted lists."])
    common = ["--target", target, "--draft", draft, "--chat", "--prompts", prompts,
              "--max-new-tokens", "48"]
    outs = _greedy_outputs(tmp_path, [
        ("ar", 1, ["--mode", "ar"]), ("sync", 1, ["--mode", "sync"]),
        ("async11", 2, ["--mode", "async"]), ("async12", 3, ["--mode", "async"])], common, 1800)
    assert outs["ar"] == outs["sync"] == outs["async11"] == outs["async12"]
