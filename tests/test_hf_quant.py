"""AWQ and GPTQ checkpoints into the packed 4-bit kind (checkpoints/hf_quant.py, the 4-bit side of
checkpoints/hf_loader.py), their tensor-parallel shards, and random 4-bit dummy weights.

The reference dequantization here is written from the formats' published formulas, element by
element over the raw int32 words, and fed random words (every bit pattern), so it checks the
reader independently of our writers; the writers are then checked by a round trip."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from swiftspec_mpi.checkpoints import dummy, hf_quant, load, tiny
from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource, logical_shapes
from swiftspec_mpi.core.errors import CheckpointError, UserError
from swiftspec_mpi.network.transformer import chain_mask
from swiftspec_mpi.packed import int4

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]       # AutoAWQ: nibble i of a word <- column order[i]


# ------------------------------------------------------------------------------ the reference
def ref_awq(qweight, qzeros, scales, g) -> np.ndarray:
    """W [N, K] float32 of an AutoAWQ gemm layer: W[n, k] = (q[k, n] - z[k // g, n]) * s."""
    qw, qz = qweight.numpy().astype(np.int64) & 0xFFFFFFFF, qzeros.numpy().astype(np.int64) & 0xFFFFFFFF
    s = scales.numpy().astype(np.float32)
    K, N = qw.shape[0], s.shape[1]
    nib = np.array([AWQ_PACK_ORDER.index(c) for c in range(8)])   # the nibble of column c
    n = np.arange(N)
    k = np.arange(K)
    q = (qw[:, n // 8] >> (4 * nib[n % 8])) & 0xF                  # [K, N]
    z = (qz[k // g][:, n // 8] >> (4 * nib[n % 8])) & 0xF
    return ((q - z).astype(np.float32) * s[k // g]).T


def ref_gptq(qweight, qzeros, scales, g_idx, plus_one: bool) -> np.ndarray:
    """W [N, K] float32 of a GPTQ layer: W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n],
    z = stored + 1 in the classic format."""
    qw, qz = qweight.numpy().astype(np.int64) & 0xFFFFFFFF, qzeros.numpy().astype(np.int64) & 0xFFFFFFFF
    s = scales.numpy().astype(np.float32)
    K, N = qw.shape[0] * 8, s.shape[1]
    k, n = np.arange(K), np.arange(N)
    gi = g_idx.numpy().astype(np.int64)
    q = (qw[k // 8] >> (4 * (k % 8))[:, None]) & 0xF
    z = ((qz[gi][:, n // 8] >> (4 * (n % 8))) & 0xF) + (1 if plus_one else 0)
    return ((q - z).astype(np.float32) * s[gi]).T


def random_words(*shape, gen):
    return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int64, generator=gen).to(torch.int32)


def random_scales(*shape, gen):
    """float16 scales of every magnitude the formats meet (1e-4 .. 1), random signs."""
    mag = torch.exp(torch.empty(shape).uniform_(-9.2, 0, generator=gen))
    sign = torch.where(torch.rand(shape, generator=gen) < 0.1, -1.0, 1.0)
    return (mag * sign).half()


# ------------------------------------------------------------------------------ formats
def test_awq_word_layout_by_hand():
    """Columns 0..7 holding codes 1..8 pack into 0x86427531 (nibble i <- column order[i])."""
    codes = torch.arange(1, 9, dtype=torch.uint8).repeat_interleave(32).view(8, 32)
    t = hf_quant.pack_awq(codes, torch.full((8, 1), 3, dtype=torch.uint8), torch.ones(8, 1).half())
    assert t["qweight"].shape == (32, 1) and (t["qweight"].view(-1) & 0xFFFFFFFF == 0x86427531).all()
    assert int(t["qzeros"][0, 0]) == 0x33333333


@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("n", [8, 40, 136])
def test_awq_random_words_dequantize_bit_exactly(group, n):
    gen = torch.Generator().manual_seed(group * 1000 + n)
    k = 2 * group + (group if n == 40 else 0)
    qw, qz = random_words(k, n // 8, gen=gen), random_words(k // group, n // 8, gen=gen)
    s = random_scales(k // group, n, gen=gen)
    w = hf_quant.to_packed(hf_quant.HFQuant("awq", group, False, False), qw, qz, s)
    assert w.shape == (n, k) and w.nbytes() == n * k // 2 + 8 * n * k // group
    got = int4.dequantize(w).numpy()
    want = ref_awq(qw, qz, s, group)
    assert np.array_equal(got, want)      # every value (a zero may differ in sign only)


@pytest.mark.parametrize("plus_one", [True, False], ids=["gptq", "gptq_v2"])
@pytest.mark.parametrize("group", int4.GROUP_SIZES)
@pytest.mark.parametrize("n", [8, 44, 136])
def test_gptq_random_words_dequantize_bit_exactly(plus_one, group, n):
    gen = torch.Generator().manual_seed(group * 1000 + n + plus_one)
    k = 3 * group
    qw = random_words(k // 8, n, gen=gen)
    qz = random_words(k // group, -(-n // 8), gen=gen)
    s = random_scales(k // group, n, gen=gen)
    g_idx = (torch.arange(k) // group).to(torch.int32)
    w = hf_quant.to_packed(hf_quant.HFQuant("gptq", group, plus_one, False), qw, qz, s, g_idx)
    got = int4.dequantize(w).numpy()
    want = ref_gptq(qw, qz, s, g_idx, plus_one)
    assert np.array_equal(got, want)      # every value (a zero may differ in sign only)


def test_gptq_act_order_is_refused_packed_and_dequantized_exactly():
    gen = torch.Generator().manual_seed(7)
    k, n, g = 128, 24, 32
    qw, qz = random_words(k // 8, n, gen=gen), random_words(k // g, n // 8, gen=gen)
    s = random_scales(k // g, n, gen=gen)
    g_idx = ((torch.randperm(k, generator=gen)) // g).to(torch.int32)     # act order
    q = hf_quant.HFQuant("gptq", g, True, True)
    with pytest.raises(ValueError, match="desc_act=True.*--quant none"):
        hf_quant.to_packed(q, qw, qz, s, g_idx)
    got = hf_quant.dequantize_gptq(qw, qz, s, g_idx, True).numpy()
    assert np.array_equal(got, ref_gptq(qw, qz, s, g_idx, True))


@pytest.mark.parametrize("layout", list(tiny.QUANT_LAYOUTS))
def test_writers_round_trip_through_the_reader(layout):
    """Round to nearest, pack, read back: exactly (codes - zeros) * scales, close to W."""
    method, sym, plus_one = tiny.QUANT_LAYOUTS[layout]
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    codes, zeros, scales = int4.quantize_rtn(w, 64, sym=sym)
    t = (hf_quant.pack_awq(codes, zeros, scales) if method == "awq" else
         hf_quant.pack_gptq(codes, zeros, scales, zero_plus_one=plus_one))
    back = hf_quant.to_packed(hf_quant.HFQuant(method, 64, plus_one, False), t["qweight"],
                              t["qzeros"], t["scales"], t.get("g_idx"))
    want = (codes.float() - zeros.float().repeat_interleave(64, 1)) * \
        scales.float().repeat_interleave(64, 1)
    assert torch.equal(int4.dequantize(back), want)
    step = scales.float().repeat_interleave(64, 1)
    # round to nearest (symmetric: the largest weight of a group may clamp, one step)
    assert ((int4.dequantize(back) - w).abs() <= step * (1.0 if sym else 0.5) + 1e-6).all()


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "bitsandbytes", "bits": 4}, r"quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"bits=8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, r"group_size=-1 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 256}, r"group_size=256"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     r"checkpoint_format 'marlin'"),
])
def test_unsupported_quantization_configs_are_named(qc, needle):
    with pytest.raises(ValueError, match=needle):
        hf_quant.parse_config(qc, "config.json")


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def quantized_pairs(tmp_path_factory):
    """{layout: (target, draft)} of the tiny pair (seed 0, MLP 192) in each 4-bit layout, and
    "dense": the same pair in float32."""
    out = tmp_path_factory.mktemp("q4pairs")
    pairs = {"dense": tiny.write_tiny_pair(str(out / "dense"), intermediate=192)}
    for layout in tiny.QUANT_LAYOUTS:
        pairs[layout] = tiny.write_tiny_pair(str(out / layout), intermediate=192, quantize=layout)
    return pairs


def test_tiny_checkpoint_cli_writes_each_4bit_layout(tmp_path):
    from swiftspec_mpi.cli import main as cli
    assert cli.main(["tiny-checkpoint", "--quantize", "gptq-sym", "--group-size", "64",
                     "--layers", "2", "--draft-layers", "1", str(tmp_path / "g")]) == 0
    src = SafetensorsSource(str(tmp_path / "g" / "target"))
    assert (src.quant.method, src.quant.group, src.quant.zero_plus_one) == ("gptq", 64, True)
    qc = json.load(open(tmp_path / "g" / "draft" / "config.json"))["quantization_config"]
    assert qc["sym"] is True and qc["checkpoint_format"] == "gptq"
    # the default MLP (176) is no multiple of a group: --quantize takes 192 unless told
    assert cli.main(["tiny-checkpoint", "--quantize", "awq", "--intermediate", "176",
                     str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_source_shards_equal_slices_of_the_whole(quantized_pairs, layout):
    src = SafetensorsSource(quantized_pairs[layout][0])
    assert src.quant.method == tiny.QUANT_LAYOUTS[layout][0]
    name = "model.layers.1.mlp.down_proj.weight"
    assert src.is_packed(name) and name in src.names() and src.shape(name) == (64, 192)
    whole = src.get_packed(name)
    dense = int4.dequantize(whole)
    assert torch.equal(src.get(name), dense)
    for a, b in [(0, 64), (3, 17), (8, 40), (61, 64)]:        # outputs: any rows
        part = src.get_packed(name, 0, a, b)
        assert torch.equal(int4.dequantize(part), dense[a:b])
        assert torch.equal(src.get(name, 0, a, b), dense[a:b])
    for a, b in [(0, 96), (96, 192), (32, 64)]:                # inputs: whole groups
        assert torch.equal(int4.dequantize(src.get_packed(name, 1, a, b)), dense[:, a:b])
    assert torch.equal(src.get(name, 1, 40, 100), dense[:, 40:100])   # dequantized: anywhere
    with pytest.raises(UserError, match=r"inputs \[16:96\) of model\.layers\.1\.mlp\.down_proj "
                                        r"cut its 4-bit groups of 32"):
        src.get_packed(name, 1, 16, 96)
    # the column-parallel fused QKV of a rank, stacked from its shards
    qkv = int4.cat_rows([src.get_packed(f"model.layers.0.self_attn.{p}_proj.weight", 0, 0, 16)
                          for p in ("q", "k", "v")])
    assert qkv.shape == (48, 64) and qkv.group == 32


@pytest.mark.parametrize("layout", list(tiny.QUANT_LAYOUTS))
def test_dequantized_model_equals_dense_model_of_the_reference_weights(quantized_pairs, layout,
                                                                      tmp_path):
    """The 4-bit checkpoint loaded dequantized gives the very logits of a float32 checkpoint
    holding the reference dequantization, and stays near the unquantized model."""
    target = quantized_pairs[layout][0]
    src = SafetensorsSource(target)
    ref = {}
    for name in src.names():
        if name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
            continue
        if src.is_packed(name):
            p = name[:-len(".weight")]
            parts = {x: src.get(f"{p}.{x}") for x in ("qweight", "qzeros", "scales", "g_idx")
                     if f"{p}.{x}" in src._where}
            method, _, plus_one = tiny.QUANT_LAYOUTS[layout]
            g = src.quant.group
            ref[name] = torch.from_numpy(
                ref_awq(parts["qweight"], parts["qzeros"], parts["scales"], g) if method == "awq"
                else ref_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"],
                              plus_one))
        else:
            ref[name] = src.get(name)
    dense_ref = tiny.write_hf_folder(str(tmp_path / "ref"), src.config, ref)
    ids = torch.tensor([5, 300, 17, 1999, 42, 7, 123, 1024])
    logits = {}
    for key, folder in (("4bit", target), ("ref", dense_ref), ("orig", quantized_pairs["dense"][0])):
        m, _ = load.load_model(folder, max_slots=32, quant="none")
        logits[key] = m.forward(ids, torch.arange(8), 0, chain_mask(0, 8))
    assert torch.equal(logits["4bit"], logits["ref"])
    rel = (logits["4bit"] - logits["orig"]).norm() / logits["orig"].norm()
    assert rel < 0.3, rel           # 4-bit round to nearest of a random model: ~0.17


@pytest.mark.parametrize("layout", ["awq", "gptq-v2"])
def test_tensor_parallel_shards_cover_each_layer_on_group_boundaries(quantized_pairs, layout):
    """Every rank of a group of 2 takes its shards as the Transformer cuts them (column-parallel
    rows of q/k/v and gate/up, row-parallel inputs of o_proj and down_proj in whole groups);
    put back together they are the whole layer, bit for bit."""
    from swiftspec_mpi.network.shard import TPShard
    src = SafetensorsSource(quantized_pairs[layout][0])
    cfg, hd = src.config, src.config.head_dim
    shards = [TPShard(cfg, r, 2) for r in range(2)]
    p = "model.layers.2."
    for proj, dim, ranges in (
            ("self_attn.q_proj", 0, [sh.q_rows for sh in shards]),
            ("mlp.gate_proj", 0, [sh.ff for sh in shards]),
            ("self_attn.o_proj", 1, [sh.q_rows for sh in shards]),
            ("mlp.down_proj", 1, [sh.ff for sh in shards])):
        name = p + proj + ".weight"
        whole = int4.dequantize(src.get_packed(name))
        parts = [int4.dequantize(src.get_packed(name, dim, a, b)) for a, b in ranges]
        assert torch.equal(torch.cat(parts, dim), whole), proj
    for sh in shards:                                   # this rank's KV heads, run by run
        for a, b in sh.kv_runs(hd):
            w = src.get_packed(p + "self_attn.k_proj.weight", 0, a, b)
            assert torch.equal(int4.dequantize(w),
                               src.get(p + "self_attn.k_proj.weight")[a:b])


def test_packed_chunks_cover_the_slice_in_row_order(quantized_pairs, monkeypatch):
    from swiftspec_mpi.checkpoints import hf_loader
    monkeypatch.setattr(hf_loader, "_CHUNK_BYTES", 16 * 96)         # 16-32 rows a block
    src = SafetensorsSource(quantized_pairs["gptq"][0])
    for proj, dim, a, b in (("up", None, 0, None), ("up", 0, 16, 180), ("down", 1, 64, 192)):
        name = f"model.layers.0.mlp.{proj}_proj.weight"
        whole = src.get(name)
        chunks = list(src.packed_chunks(name, dim, a, b))
        assert all(isinstance(w, int4.PackedInt4) for _, w in chunks)
        assert [off for off, _ in chunks] == list(np.cumsum([0] + [w.shape[0] for _, w in chunks])[:-1])
        assert all(off % 16 == 0 for off, _ in chunks)
        got = torch.cat([int4.dequantize(w) for _, w in chunks])
        want = whole if dim is None else whole[a:b] if dim == 0 else whole[:, a:b]
        assert torch.equal(got, want)
    emb = list(src.packed_chunks("model.embed_tokens.weight", 0, 0, 100))    # dense rows
    assert len(emb) > 1 and all(w.dtype == torch.float32 for _, w in emb)
    assert torch.equal(torch.cat([w for _, w in emb]), src.get("model.embed_tokens.weight")[:100])


def test_truncated_and_mismatched_packed_tensors_are_named(quantized_pairs, tmp_path):
    from safetensors.torch import load_file, save_file
    target = quantized_pairs["awq"][0]
    shapes = {k: tuple(v.shape) for k, v in load_file(os.path.join(target, "model.safetensors")).items()}
    folded = logical_shapes(target, shapes)
    assert folded["model.layers.0.self_attn.o_proj.weight"] == (64, 64)
    assert not any(k.endswith(".qweight") for k in folded)
    cut = dict(shapes, **{"model.layers.2.mlp.up_proj.qweight": (60, 24)})
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.2\.mlp\.up_proj\.qweight has "
                                              r"shape \[60, 24\].*truncated"):
        logical_shapes(target, cut)
    cfg = json.load(open(os.path.join(target, "config.json")))
    folder = tmp_path / "g128"
    folder.mkdir()
    cfg["quantization_config"]["group_size"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"group_size 128 does not divide the input "
                                              r"dimension (64|192) of model\.layers\.\d\..*groups of 32"):
        logical_shapes(str(folder), shapes)
    # the loader itself names a truncated tensor too
    t = load_file(os.path.join(target, "model.safetensors"))
    t["model.layers.0.mlp.gate_proj.qweight"] = t["model.layers.0.mlp.gate_proj.qweight"][:-8].clone()
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(target):
        if f != "model.safetensors":
            (bad / f).write_bytes(open(os.path.join(target, f), "rb").read())
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_proj\.qweight has shape \[56, 24\]"):
        SafetensorsSource(str(bad)).get_packed("model.layers.0.mlp.gate_proj.weight")


def test_tensor_parallel_degrees_that_cut_a_group_are_refused():
    cfg = tiny.tiny_config(intermediate=192)              # 4 heads of 16, MLP 192
    int4.check_tp_groups(cfg, 32, 2, "the target")        # o_proj 32 | down 96 per rank: whole
    with pytest.raises(UserError, match=r"groups of 32 inputs.*group of 4 ranks would cut its "
                                        r"o_proj at input 16.*use a group of 2 ranks, or run it with --quant none"):
        int4.check_tp_groups(cfg, 32, 4, "the target")
    big = dummy.SHAPES["qwen2.5-1.5b"]                     # 12 heads of 128, MLP 8960
    int4.check_tp_groups(big, 128, 2, "the target")
    with pytest.raises(UserError, match=r"down_proj at input 2240"):
        int4.check_tp_groups(big, 128, 4, "the target")


def test_packed_group_follows_the_quant_flag(quantized_pairs, tmp_path):
    awq, dense = quantized_pairs["awq"][0], quantized_pairs["dense"][0]
    assert load.packed_group(awq, "auto") == 32 and load.packed_group(awq, "none") is None
    assert load.packed_group(dense, "auto") is None
    with pytest.raises(UserError, match=r"--quant int4: .* holds dense weights"):
        load.packed_group(dense, "int4")
    assert load.packed_group("llama-3-8b", "int4", "dummy") == dummy.RandomPackedSource.GROUP
    assert load.packed_group("llama-3-8b", "auto", "dummy") is None


# ------------------------------------------------------------------------------ dummy int4
def test_dummy_int4_weights():
    """--load-format dummy --quant int4: random packed projections at the named shape, shards
    on group boundaries (the GPU's W4A16 step runs them, tests/test_w4a16_gpu.py; the CPU's
    packed layers too, tests/test_quant_cpu.py)."""
    cfg = dummy.SHAPES["qwen2.5-0.5b"]
    src = dummy.RandomPackedSource(cfg)
    name = "model.layers.3.mlp.down_proj.weight"
    w = src.get_packed(name, 1, 0, 2432)
    w.check()
    assert w.shape == (896, 2432) and w.group == dummy.RandomPackedSource.GROUP == 128
    assert torch.equal(w.qweight, src.get_packed(name, 1, 0, 2432).qweight)   # deterministic
    d = int4.dequantize(w)
    assert 0.015 < d.std() < 0.03 and abs(d.mean()) < 0.01
    assert torch.equal(w.scale, w.scale.half().float())          # float16 values, as in AWQ
    with pytest.raises(UserError, match=r"groups of 128"):
        src.get_packed("model.layers.0.self_attn.o_proj.weight", 1, 0, 448)   # 7 heads of 64


# ------------------------------------------------------------------------------ memory
_RSS_SCRIPT = r"""
import os, sys, json
import torch
from swiftspec_mpi.checkpoints.hf_loader import SafetensorsSource

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

src = SafetensorsSource(sys.argv[1])
names = [n for n in src.names() if src.is_packed(n)]
src.get_packed(names[0])                                  # warm the code paths
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                          # VmHWM := VmRSS
kept = [src.get_packed(n) for n in names]
print(json.dumps({"peak": status("VmHWM") - base, "packed": sum(w.nbytes() for w in kept),
                  "file": os.path.getsize(os.path.join(sys.argv[1], "model.safetensors"))}))
"""


def test_loading_peak_rss_stays_near_the_packed_bytes(tmp_path):
    """A mid-size AWQ checkpoint (12 layers of hidden 1024, MLP 4096, groups of 128: ~110 MiB
    packed) loads into PackedInt4 with the process's peak RSS growing at most 1.2x the packed
    bytes."""
    from model_configs import small_config
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(0)
    H, I, L, g = 1024, 4096, 12, 128
    cfg = small_config("llama", vocab_size=256, hidden_size=H, intermediate_size=I, num_layers=L,
                       num_heads=8, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                       tie_word_embeddings=True)
    tensors = {}
    for i in range(L):
        for proj, (n, k) in {"self_attn.q_proj": (H, H), "self_attn.k_proj": (H, H),
                             "self_attn.v_proj": (H, H), "self_attn.o_proj": (H, H),
                             "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
                             "mlp.down_proj": (H, I)}.items():
            p = f"model.layers.{i}.{proj}"
            tensors[p + ".qweight"] = random_words(k, n // 8, gen=gen)
            tensors[p + ".qzeros"] = random_words(k // g, n // 8, gen=gen)
            tensors[p + ".scales"] = random_scales(k // g, n, gen=gen)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    hf = cfg.to_hf_dict()
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": g,
                                 "version": "gemm", "zero_point": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["packed"] > 100 << 20
    print(f"peak RSS growth {r['peak'] / 2 ** 20:.1f} MiB for {r['packed'] / 2 ** 20:.1f} MiB packed")
    assert r["peak"] <= 1.2 * r["packed"], r
