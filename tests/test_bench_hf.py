"""`swiftspec bench` pieces: HF baselines on a tiny random pair, prompt sampling, subprocess
handling of our modes, and the Markdown table (on synthetic inputs)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import pytest

from conftest import skip_or_fail
from swiftspec_mpi.bench import compare as bench
from swiftspec_mpi.core.errors import UserError
from swiftspec_mpi.trace.read import read_trace

MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from swiftspec_mpi.checkpoints import tiny
    return tiny.write_tiny_pair(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def hf_run(pair, tmp_path_factory):
    from swiftspec_mpi.bench import hf_baselines as hfb
    out = tmp_path_factory.mktemp("hf")
    prompts = [hfb.Prompt(0, "Write a haiku about the sea.", "writing"),
               hfb.Prompt(1, "What is the capital of France?", "qa"),
               hfb.Prompt(2, "ignored: ids given", "coding", prompt_ids=[5, 17, 300, 42, 9])]
    results = hfb.run_systems(["hf-greedy", "hf-assisted"], target=pair[0], draft=pair[1], prompts=prompts,
                              out_dir=str(out), dtype="float32", threads=1, max_new_tokens=MAX_NEW, chat=True)
    return results, prompts


def _greedy_reference(folder, prompt_ids, n, eos):
    """Plain argmax loop with a full forward per token (no cache, no generate)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
            out.append(tok)
            if tok in eos:
                break
    return out


def test_hf_traces_read_back(hf_run, pair):
    from tokenizers import Tokenizer
    results, prompts = hf_run
    assert [r.status for r in results] == ["ok", "ok"], [r.error for r in results]
    greedy, assisted = (read_trace(r.path) for r in results)
    tok = Tokenizer.from_file(os.path.join(pair[0], "tokenizer.json"))
    eos = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    for trace, mode in ((greedy, "hf-greedy"), (assisted, "hf-assisted")):
        assert trace.mode == mode and trace.complete and trace.exit_status == "ok"
        assert [w for w in trace.warnings if "events" not in w] == []
        assert len(trace.events) == 0 and trace.config["dtype"] == "float32"
        assert [r.index for r in trace.requests] == [0, 1, 2]
        assert [r.category for r in trace.requests] == ["writing", "qa", "coding"]
        for r in trace.requests:
            assert r.new_tokens == len(r.output_ids) <= MAX_NEW
            assert r.seconds > 0 and 0 < r.ttft_s <= r.seconds
            assert r.tokens_per_s == pytest.approx(r.new_tokens / r.seconds)
            assert r.stop_reason == ("eos" if r.output_ids[-1] in eos else "max_new_tokens")
            assert np.all(r.steps.t_end >= r.steps.t_start)
    # the chat template applied by hand, tokenized by the tokenizers library
    chat = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "Write a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n")
    assert greedy.requests[0].prompt_ids.tolist() == tok.encode(chat).ids
    assert greedy.requests[2].prompt_ids.tolist() == [5, 17, 300, 42, 9]
    for g, a in zip(greedy.requests, assisted.requests):
        # greedy: one step per token after the prefill's; assisted: steps commit every token
        assert g.steps.accepted.tolist() == [1] * (g.new_tokens - 1)
        assert g.steps.tree_size.tolist() == [1] * (g.new_tokens - 1)
        assert int(a.steps.accepted.sum()) == a.new_tokens
        assert np.all(a.steps.accepted >= 1) and np.all(a.steps.tree_size >= a.steps.accepted)
        # assisted generation is lossless in float32 on this model
        assert a.output_ids.tolist() == g.output_ids.tolist()
        assert a.prompt_ids.tolist() == g.prompt_ids.tolist()
    ref = _greedy_reference(pair[0], greedy.requests[1].prompt_ids.tolist(), MAX_NEW, eos)
    assert greedy.requests[1].output_ids.tolist() == ref


def test_tokenizer_fallback_matches_engine(pair, monkeypatch):
    """Without the engine's TextTokenizer, the HF fallback gives the same ids (AutoTokenizer
    would not: it rebuilds a Qwen2 pre-tokenizer)."""
    from swiftspec_mpi.bench import hf_baselines as hfb
    text = "The vertices of a triangle are at points (0, 0), (-1, 1), and (3, 3). Area?"
    engine = hfb.load_tokenizer(pair[0])
    assert type(engine).__name__ == "TextTokenizer"
    monkeypatch.setitem(sys.modules, "swiftspec_mpi.checkpoints.tokenizer", None)   # import fails
    hf = hfb.load_tokenizer(pair[0])
    assert type(hf).__name__ != "TextTokenizer"
    for chat in (False, True):
        assert hfb.encode(hf, text, chat) == hfb.encode(engine, text, chat)


def test_hf_failure_is_reported(tmp_path):
    from swiftspec_mpi.bench import hf_baselines as hfb
    empty = tmp_path / "nomodel"
    empty.mkdir()
    res = hfb.run_systems(["hf-greedy"], target=str(empty), draft=str(empty),
                          prompts=[hfb.Prompt(0, "x")], out_dir=str(tmp_path), max_new_tokens=2)
    assert res[0].status == "failed" and "config.json" in res[0].error
    assert not (tmp_path / "hf-greedy.h5").exists()


def test_load_prompts_per_category(tmp_path):
    lines = [{"question_id": i, "category": c, "turns": [f"q{i}", "second turn"]}
             for i, c in enumerate(["a", "a", "b", "a", "c", "b", "b"])]
    lines.append({"prompt": "plain", "category": "c"})
    src = tmp_path / "q.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    p = bench.load_prompts(str(src), 2)
    assert [(x["category"], x["text"]) for x in p] == [("a", "q0"), ("a", "q1"), ("b", "q2"), ("b", "q5"),
                                                       ("c", "q4"), ("c", "plain")]
    assert [x["index"] for x in p] == list(range(6))
    out = tmp_path / "prompts.jsonl"
    bench.write_prompts(p, str(out))
    from swiftspec_mpi.core import config
    reqs = config.read_prompts_file(str(out))   # the engine's parser reads what bench writes
    assert [(r.prompt, r.category) for r in reqs] == [(x["text"], x["category"]) for x in p]
    with pytest.raises(UserError, match="per-category"):
        bench.load_prompts(str(src), 0)
    with pytest.raises(UserError, match="does not exist"):
        bench.load_prompts(str(tmp_path / "nope.jsonl"), 1)
    assert bench.parse_systems("hf-greedy,ar") == ["ar", "hf-greedy"]
    with pytest.raises(UserError, match="both --target and --draft"):
        bench._resolve_models(argparse.Namespace(target=str(tmp_path), draft=None))
    with pytest.raises(UserError, match="unknown system"):
        bench.parse_systems("ar,vllm")


def test_default_prompts_is_shipped_spec_bench():
    """The default --prompts is package data: the first question of each Spec-Bench category."""
    path = bench.default_prompts_path()
    if not os.path.isfile(path):
        skip_or_fail(f"the shipped prompts file {path} is missing (a checkout or install without "
                     "package data)")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).prompts == path
    p = bench.load_prompts(path, 1)
    assert len(p) == 13 and len({x["category"] for x in p}) == 13
    assert [x["question_id"] for x in p] == [81, 91, 101, 111, 121, 131, 141, 151, 161, 241, 321, 401, 481]
    assert all(x["text"].strip() for x in p)
    assert bench.load_prompts(path, 5) == p                  # one question per category only


def test_run_ours_reports_failures(tmp_path):
    py = sys.executable
    ok_cmd = [py, "-c", "import sys; sys.path.insert(0, %r); import synthetic_trace as st; "
              "st.write(%r, st.make_run('ar', n_requests=2, steps=3))" % (os.path.dirname(__file__),
                                                                          str(tmp_path / "ok.h5"))]
    res = bench.run_ours("ar", ok_cmd, str(tmp_path / "ok.h5"), str(tmp_path / "ok.log"), timeout=60)
    assert res["status"] == "ok" and res["returncode"] == 0 and res["error"] == ""
    bad = [py, "-c", "import sys; print('error: model folder missing'); sys.exit(2)"]
    res = bench.run_ours("sync", bad, str(tmp_path / "bad.h5"), str(tmp_path / "bad.log"), timeout=60)
    assert res["status"] == "failed" and "exit code 2" in res["error"] and "model folder missing" in res["error"]
    slow = [py, "-c", "import time; time.sleep(60)"]
    res = bench.run_ours("async", slow, str(tmp_path / "slow.h5"), str(tmp_path / "slow.log"), timeout=1)
    assert res["status"] == "failed" and "timed out" in res["error"]
    res = bench.run_ours("async", ["/nonexistent/mpiexec"], str(tmp_path / "x.h5"), str(tmp_path / "x.log"), 5)
    assert res["status"] == "failed" and "could not start" in res["error"]


def _summary(mode, tps, acc_len, outputs, prompts=None, complete=True, cats=None):
    return {"mode": mode, "complete": complete, "exit_status": "ok", "n_requests": len(outputs),
            "tokens_per_s": tps, "mean_accepted_length": acc_len, "ttft_s": {"mean": 0.05},
            "categories": cats or {},
            "requests": [{"index": i, "prompt_ids": (prompts or [[1, 2]] * len(outputs))[i], "output_ids": o}
                         for i, o in enumerate(outputs)]}


def test_markdown_table():
    outs = [[1, 2, 3], [4, 5], [6]]
    results = [
        {"system": "ar", "status": "ok", "summary": _summary("ar", 10.0, 1.0, outs, cats={"qa": {"tokens_per_s": 9.0}})},
        {"system": "sync", "status": "failed", "error": "exit code 3: boom", "log": "runs/sync.log", "summary": None},
        {"system": "async", "status": "partial", "error": "trace incomplete (interrupted)",
         "summary": _summary("async", 25.0, 3.25, [[1, 2, 3], [4, 9]])},
        {"system": "hf-greedy", "status": "ok", "summary": _summary("hf-greedy", 8.0, 1.0, outs)},
        {"system": "hf-assisted", "status": "ok",
         "summary": _summary("hf-assisted", 12.0, 2.5, outs, prompts=[[1, 2], [1, 2], [7]])},
    ]
    md = bench.build_markdown(results, {"n_prompts": 3, "setup": {"dtype": "float32"}})
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| system")
            and not ln.startswith("| category")}
    assert rows["ar"] == ["ok", "3/3", "10.00", f"{10 / 8:.2f}x", "1.00", "reference", "50"]
    assert rows["sync"][0] == "failed" and rows["sync"][1:] == ["-"] * 6
    assert rows["async"][:6] == ["partial (see note)", "2/3", "25.00", f"{25 / 8:.2f}x", "3.25", "1/2 (50%)"]
    assert rows["hf-greedy"][3:6] == ["1.00x", "1.00", "3/3 (100%)"]
    assert rows["hf-assisted"][5] == "3/3 (100%)"
    assert "**sync** failed: exit code 3: boom (log: `runs/sync.log`)" in md
    assert "**async** partial: trace incomplete" in md
    assert "**hf-assisted**: 1 prompt(s) tokenized differently" in md
    assert "- dtype: float32" in md
    assert rows["qa"][0] == "9.00" and rows["qa"][1] == "-"   # per-category table
    # without hf-greedy there is no speedup column value
    md2 = bench.build_markdown(results[:1], {"n_prompts": 3})
    assert "| ar | ok | 3/3 | 10.00 | - |" in md2
    assert "shared a GPU" not in md                     # no gpu_sharing record: nothing to say
    # async whose two ranks took turns on one GPU (no MPS daemon): a note with the fix
    shared = {"gpu_uuids": ["GPU-a", "GPU-a"], "shared_gpu_ranks": [[0, 1]], "mps_daemon": [False, False]}
    results[2]["summary"]["env"] = {"gpu_sharing": shared}
    md3 = bench.build_markdown(results, {"n_prompts": 3})
    assert "**async**: ranks 0,1 (MPS NO: time-sliced) shared a GPU without a CUDA MPS daemon" in md3
    assert "nvidia-cuda-mps-control -d" in md3
    results[2]["summary"]["env"] = {"gpu_sharing": {**shared, "mps_daemon": [True, True]}}
    assert "shared a GPU" not in bench.build_markdown(results, {"n_prompts": 3})


def test_bench_main_hf_only_and_failed_mode(pair, tmp_path, capsys):
    src = tmp_path / "q.jsonl"
    src.write_text("\n".join(json.dumps({"category": c, "turns": [t]}) for c, t in
                             [("code", "def add(a, b):"), ("code", "skip me"), ("qa", "Who wrote Hamlet?")]))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--prompts", str(src), "--systems", "ar,hf-greedy", "--target", pair[0],
                              "--draft", pair[1], "--max-new-tokens", "6", "--threads", "1",
                              "--out-dir", str(tmp_path / "out"), "--mpiexec", "/bin/false"])
    rc = bench.main(args)
    assert rc == 3   # ar failed (its launcher is /bin/false); hf-greedy still ran
    md = (tmp_path / "out" / "bench.md").read_text()
    assert "| ar | failed |" in md and "| hf-greedy | ok | 2/2 |" in md
    assert "**ar** failed: exit code 1" in md
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [s["system"] for s in data["systems"]] == ["ar", "hf-greedy"]
    assert data["systems"][1]["summary"]["n_requests"] == 2
    trace = read_trace(str(tmp_path / "out" / "hf-greedy.h5"))
    assert [r.prompt_text for r in trace.requests] == ["def add(a, b):", "Who wrote Hamlet?"]
    log = (tmp_path / "out" / "ar.log").read_text()
    assert log.startswith("$ /bin/false -n 2 ") and "--mode ar" in log and "--threads 1" in log
    out = capsys.readouterr().out
    assert sum(ln.startswith("| hf-greedy | ok |") for ln in out.splitlines()) == 1
    assert "exit code 1: $" not in md   # the log's command line is not the error
