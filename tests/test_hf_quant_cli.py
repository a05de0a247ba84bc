"""AWQ and GPTQ checkpoints through `swiftspec run` under mpiexec: the tiny 4-bit pairs decode
greedy with ar, sync and async alike, and bad 4-bit input is refused by rank 0 with one line
(exit 2, no traceback, every rank gone)."""
from __future__ import annotations

import json
import os
import re

import pytest

from engine_helpers import read_outputs, run_swiftspec
from reliability_helpers import copy_model, edit_config, error_lines, run_job
from swiftspec_mpi.checkpoints import tiny
from swiftspec_mpi.core.errors import EXIT_USER_ERROR

WALL_S = 30.0


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """{"awq": (target, draft), "gptq": (target, draft)}: the tiny pair, 4-bit, groups of 32;
    "awq64": groups of 64."""
    out = tmp_path_factory.mktemp("q4cli")
    pairs = {layout: tiny.write_tiny_pair(str(out / layout), intermediate=192, quantize=layout)
             for layout in ("awq", "gptq")}
    pairs["awq64"] = tiny.write_tiny_pair(str(out / "awq64"), intermediate=192, quantize="awq",
                                          group=64)
    return pairs


@pytest.mark.parametrize("layout,modes", [("awq", ("ar", "sync", "async")), ("gptq", ("ar", "async"))])
def test_greedy_modes_agree_on_4bit_checkpoints(q4, layout, modes, tmp_path):
    target, draft = q4[layout]
    got = {}
    for mode in modes:
        n = 2 if mode == "async" else 1
        out = tmp_path / f"{mode}.h5"
        run_swiftspec(n, ["--target", target, "--draft", draft, "--mode", mode, "--prompt",
                          "def fibonacci(n):", "--max-new-tokens", "16", "--ignore-eos",
                          "--out", str(out), "--quiet"])
        got[mode] = read_outputs(out)
    assert len(got["ar"][0]) == 16
    assert all(got[m] == got["ar"] for m in modes), got


def _truncated(folder, tmp_path) -> str:
    """A copy whose layer-1 up_proj.qweight lost its last 8 input rows."""
    from safetensors.torch import load_file, save_file
    bad = copy_model(folder, tmp_path / "truncated")
    path = os.path.join(bad, "model.safetensors")
    t = load_file(path)
    t["model.layers.1.mlp.up_proj.qweight"] = t["model.layers.1.mlp.up_proj.qweight"][:-8].clone()
    save_file(t, path)
    return bad


def _with_quant(folder, tmp_path, **changes) -> str:
    bad = copy_model(folder, tmp_path / "edited")
    with open(os.path.join(bad, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    qc.update(changes)
    edit_config(bad, quantization_config=qc)
    return bad


# (id, ranks, args(q4, tmp_path) -> list, expected message)
BAD = [
    ("truncated-packed-tensor", 2,
     lambda q, t: ["--target", _truncated(q["awq"][0], t), "--mode", "ar"],
     r"truncated.*tensor model\.layers\.1\.mlp\.up_proj\.qweight has shape \[56, 24\] but .* "
     r"imply \[64, 24\].*truncated"),
    ("group-does-not-divide-input", 2,
     lambda q, t: ["--target", _with_quant(q["gptq"][0], t, group_size=128), "--mode", "ar"],
     r"group_size 128 does not divide the input dimension \d+ of model\.layers\.0\."),
    ("unknown-quant-method", 2,
     lambda q, t: ["--target", _with_quant(q["awq"][0], t, quant_method="hqq"), "--mode", "ar"],
     r"quant_method 'hqq' is not supported; supported: awq .* and gptq"),
    ("gptq-act-order-packed", 2,
     lambda q, t: ["--target", _with_quant(q["gptq"][0], t, desc_act=True), "--mode", "ar"],
     r"GPTQ checkpoint in act order \(desc_act=true\).*--quant none"),
    ("tp-cuts-a-group", 2,                 # 4 heads of 16: o_proj cut at input 32 of 64
     lambda q, t: ["--target", q["awq64"][0], "--mode", "ar"],
     r"the target's 4-bit weights come in groups of 64 inputs, and a tensor-parallel group of 2 "
     r"ranks would cut its o_proj at input 32, inside a group; no tensor-parallel degree keeps "
     r"them whole: give it one rank, or run it with --quant none"),
]


@pytest.mark.parametrize("name,n,make_args,pattern", BAD, ids=[c[0] for c in BAD])
def test_bad_4bit_input_is_one_line_from_rank0(q4, tmp_path, name, n, make_args, pattern):
    out = tmp_path / "out" / "run.h5"
    job = run_job(n, [*make_args(q4, tmp_path), "--prompt", "hi", "--max-new-tokens", "4",
                      "--out", str(out), "--quiet"], timeout=120)
    report = job.report()
    assert job.proc.returncode == EXIT_USER_ERROR, report
    lines = error_lines(job.stderr)
    assert len(lines) == 1, report
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"
    assert "Traceback" not in job.stderr and job.seconds < WALL_S, report
    assert not out.exists()
