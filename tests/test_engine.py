"""The engine end to end under mpiexec (tiny random checkpoints, CPU float32).

Greedy `async` and `sync` must equal `ar` token for token, for the layouts 1+1, 1 draft + 2
verify (TP=2 target), 2+2, and sync on 2 ranks (TP=2 for both models), and `async` under every
--async-policy (1+1 and 2+2); --expansions paces the async draft; speculation must really
be exercised (accepted draft tokens > 0); stop conditions (max tokens, EOS-like stop token, stop
string) must end requests identically in every mode.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine_helpers import greedy_gaps, read_outputs, read_requests, read_root, run_swiftspec, write_prompts
from swiftspec_mpi.core.config import ASYNC_POLICIES, DEFAULT_ASYNC_POLICY, RunConfig, validate_basic
from swiftspec_mpi.engine.async_loop import depth_floor, send_size, waits_fresh
from swiftspec_mpi.trace.record import EVENT_KINDS

pytestmark = pytest.mark.mpi

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Summarize the following text: the quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Made through the real CLI (`swiftspec tiny-checkpoint DIR`)."""
    d = tmp_path_factory.mktemp("tiny")
    subprocess.run([sys.executable, "-m", "swiftspec_mpi", "tiny-checkpoint", str(d)], check=True,
                   capture_output=True, timeout=120)
    return str(d / "target"), str(d / "draft")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "p.jsonl", PROMPTS)


def _run(pair, prompts_file, tmp_path, mode, n, extra=(), name=None):
    out = tmp_path / f"{name or mode}-{n}.h5"
    run_swiftspec(n, ["--target", pair[0], "--draft", pair[1], "--mode", mode, "--prompts",
                      prompts_file, "--max-new-tokens", "64", "--out", str(out), "--quiet", *extra])
    return out


@pytest.fixture(scope="module")
def ar_reference(pair, prompts_file, tmp_path_factory):
    out = _run(pair, prompts_file, tmp_path_factory.mktemp("ar"), "ar", 1)
    outputs = read_outputs(out)
    assert [len(o) for o in outputs] == [64, 64, 64]
    return outputs


@pytest.mark.parametrize("mode,n,extra", [
    ("async", 2, ["--draft-ranks", "1"]),      # 1 verify + 1 draft
    ("async", 3, ["--draft-ranks", "1"]),      # TP=2 verify + 1 draft
    ("async", 4, ["--draft-ranks", "2"]),      # TP=2 verify + TP=2 draft
    ("sync", 1, []),
    ("sync", 2, []),                           # TP=2 for both models
    ("ar", 2, []),                             # TP=2 target
] + [("async", n, ["--draft-ranks", str(n // 2), "--async-policy", policy])   # the default: above
     for policy in ASYNC_POLICIES if policy != DEFAULT_ASYNC_POLICY for n in (2, 4)])
def test_greedy_equals_ar(pair, prompts_file, tmp_path, ar_reference, mode, n, extra):
    out = _run(pair, prompts_file, tmp_path, mode, n, extra)
    assert read_outputs(out) == ar_reference
    root = read_root(out)
    assert root["complete"] and root["exit_status"] == "ok" and root["mode"] == mode
    requests = read_requests(out)
    assert [r["stop_reason"] for r in requests] == ["max_new_tokens"] * 3
    if mode != "ar":
        steps = np.concatenate([r["steps"] for r in requests])
        # speculation is exercised: some verify steps commit more than the bonus token
        assert steps["accepted"].max() > 1
        assert steps["accepted"].sum() == 3 * 64
        assert len(steps) < 3 * 64 * 0.8, "acceptance too low to be real speculation"
    # every rank recorded events and the ranks table names every rank
    ev = root["events"]
    assert sorted(set(ev["rank"].tolist())) == list(range(n))
    assert len(root["ranks"]) == n
    if mode != "ar":   # the verified trees: where from, how deep, cut from how many nodes
        assert set(steps["tree_source"].tolist()) <= {0, 1, 2}
        assert np.all(steps["tree_depth"] <= steps["tree_size"] - 1)
        assert np.all(steps["tree_depth"] >= steps["accepted"] - 1)
        assert np.all(steps["tree_nodes"] >= steps["tree_size"]) and np.all(steps["drafted"] >= 0)
        waits = steps["fresh_wait_s"]
        assert np.all(waits[np.isfinite(waits)] >= 0) and np.isfinite(waits).mean() > 0.5
        if mode == "sync":
            assert np.all(steps["tree_source"] == 0) and np.all(steps["fresh_wait_s"] == 0)
        else:
            policy = extra[extra.index("--async-policy") + 1] if "--async-policy" in extra \
                else DEFAULT_ASYNC_POLICY
            if policy == "fresh":   # always the tree built on the latest result
                assert np.all(steps["tree_source"] == 0)
    if mode == "async":      # CPU ranks share no GPU: the draft never pauses unless asked
        assert json.loads(root["env_json"])["draft_pace"] == 0


def test_async_policy_rules():
    """`rate` (the default) holds the re-rooted tree back to --floor-depth levels (at most bs - 1)
    and weighs the wait; `fresh` sends it at once and always waits; both send 4 x bs nodes."""
    assert ASYNC_POLICIES == ("rate", "fresh") and DEFAULT_ASYNC_POLICY == "rate"

    def cfg(policy, bs, floor=None):
        return validate_basic(RunConfig(mode="async", prompt="x", async_policy=policy,
                                        verify_size=bs, floor_depth=floor), 2)
    assert not waits_fresh(cfg("rate", 8)) and depth_floor(cfg("rate", 8)) == 2
    assert depth_floor(cfg("rate", 8, 5)) == 5 and depth_floor(cfg("rate", 3, 5)) == 2
    assert waits_fresh(cfg("fresh", 8)) and depth_floor(cfg("fresh", 8)) == 0
    assert send_size(cfg("fresh", 8)) == send_size(cfg("rate", 8)) == min(cfg("rate", 8).tree_capacity, 32)


def test_expansions_pace_the_async_draft(pair, prompts_file, tmp_path, ar_reference):
    """--expansions d in async: the draft expands d times a step and then waits for the result;
    with --async-policy fresh the verify group checks the tree re-rooted on its latest result,
    holding those d expansions. (Without it, on CPUs, the draft never pauses: draft_pace 0.)"""
    d = 2
    out = _run(pair, prompts_file, tmp_path, "async", 2,
               ["--async-policy", "fresh", "--expansions", str(d)], name="paced")
    assert read_outputs(out) == ar_reference
    root = read_root(out)
    assert json.loads(root["env_json"])["draft_pace"] == d
    ev = root["events"]
    kinds = EVENT_KINDS                 # an "abandon" (a result arriving mid-expansion) counts as no expansion
    draft = ev[ev["role"] == 1]
    for request in sorted(set(draft["request"].tolist())):
        seq = draft[draft["request"] == request]
        seq = seq[np.argsort(seq["t_start"], kind="stable")]
        names = [kinds[k] for k in seq["kind"]]
        run, runs = 0, []
        for name in names:              # expansions between two re-roots (one verify step)
            if name == "expand":
                run += 1
            elif name == "reroot":
                runs.append(run)
                run = 0
        assert max(runs) <= d, runs
        assert sum(r == d for r in runs) >= len(runs) // 2, runs   # the draft does use its d
        assert "wait" in names                                      # and then waits
    steps = np.concatenate([r["steps"] for r in read_requests(out)])
    assert np.all(steps["tree_source"] == 0)
    assert np.all(steps["drafted"][1:] <= d + 1)    # d, plus the root's forward after a re-root
    assert steps["drafted"].max() >= d


def test_bfloat16_on_cpu_async_equals_ar(pair, prompts_file, tmp_path):
    """--dtype bfloat16 on CPU (bf16 weights in the packed panels, float32 arithmetic): the
    target's tree passes round like its one-token passes, so async equals ar token for token."""
    bf16 = ["--dtype", "bfloat16"]
    ar = read_outputs(_run(pair, prompts_file, tmp_path, "ar", 1, bf16, name="ar-bf16"))
    out = _run(pair, prompts_file, tmp_path, "async", 2, ["--draft-ranks", "1", *bf16], name="async-bf16")
    assert read_outputs(out) == ar and [len(o) for o in ar] == [64, 64, 64]
    assert read_root(out)["config"]["dtype"] == "bfloat16"


def test_stop_token_and_stop_string_end_all_modes_alike(pair, prompts_file, tmp_path, ar_reference):
    from swiftspec_mpi.checkpoints.load import load_tokenizer
    tok = load_tokenizer(pair[0])
    stop_id = ar_reference[0][20]                  # ends request 0 at (the first occurrence of) it
    texts = [tok.decode(o) for o in ar_reference]
    mid = len(texts[1]) // 2
    candidates = [texts[1][i:i + 4] for i in range(mid, len(texts[1]) - 4)]
    stop_str = next(c for c in candidates if c.strip() and c not in texts[0] and c not in texts[2])
    extra = ["--stop-token-id", str(stop_id), "--stop", stop_str]
    runs = {}
    for mode, n, more in [("ar", 1, []), ("async", 2, []), ("sync", 1, [])]:
        out = _run(pair, prompts_file, tmp_path, mode, n, extra + more, name=f"stop-{mode}")
        runs[mode] = read_requests(out)
    ref = runs["ar"]
    first = ar_reference[0].index(stop_id)
    assert ref[0]["output_ids"] == ar_reference[0][:first + 1]
    assert ref[0]["stop_reason"] in ("eos", "stop_string")
    assert any(r["stop_reason"] == "stop_string" for r in ref)
    for mode in ("async", "sync"):
        assert [r["output_ids"] for r in runs[mode]] == [r["output_ids"] for r in ref], mode
        assert [r["stop_reason"] for r in runs[mode]] == [r["stop_reason"] for r in ref], mode
        assert [r["text"] for r in runs[mode]] == [r["text"] for r in ref], mode


def test_sampling_is_reproducible_and_equals_ar(pair, prompts_file, tmp_path):
    """Coupled sampling: with a fixed seed, async and sync produce exactly ar's sample."""
    outs = {}
    for mode, n in [("ar", 1), ("async", 2), ("sync", 1)]:
        out = _run(pair, prompts_file, tmp_path, mode, n,
                   ["--temperature", "0.8", "--seed", "7"], name=f"t-{mode}")
        outs[mode] = read_outputs(out)
    again = read_outputs(_run(pair, prompts_file, tmp_path, "async", 2,
                              ["--temperature", "0.8", "--seed", "7"], name="t-async-again"))
    assert outs["async"] == outs["ar"] == outs["sync"] == again
    other = read_outputs(_run(pair, prompts_file, tmp_path, "ar", 1,
                              ["--temperature", "0.8", "--seed", "8"], name="t-ar-seed8"))
    assert other != outs["ar"]


def _chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; categories with expected < 5 pooled. p-value by the
    Wilson-Hilferty normal approximation (no scipy needed)."""
    import math
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    k = len(obs) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampling_matches_target_distribution(pair, tmp_path):
    """async at temperature 0.7: the first and second committed tokens are distributed as the
    target's own distribution (one request per sample; seeds differ per request index)."""
    import torch

    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    T, R = 0.7, 300
    prompt = "Write a story about a dragon"
    prompts = write_prompts(tmp_path / "same.jsonl", [prompt] * R)
    out = tmp_path / "samples.h5"
    run_swiftspec(2, ["--target", pair[0], "--draft", pair[1], "--mode", "async", "--prompts", prompts,
                      "--max-new-tokens", "2", "--temperature", str(T), "--seed", "3",
                      "--ignore-eos", "--out", str(out), "--quiet"], timeout=600)
    samples = np.array(read_outputs(out))                       # [R, 2]
    assert samples.shape == (R, 2)
    model, tok = load_model(pair[0], max_slots=64)
    ids = tok.encode(prompt)

    def next_probs(seq, temperature):
        n = len(seq)
        logits = model.forward(torch.tensor(seq), torch.arange(n), 0, chain_mask(0, n))[-1]
        return torch.softmax(logits.double() / temperature, -1).numpy()

    p1 = next_probs(ids, T)
    counts1 = np.bincount(samples[:, 0], minlength=len(p1))
    assert _chi2_pvalue(counts1, R * p1) > 1e-3
    # the test has power: a sharper distribution is rejected
    assert _chi2_pvalue(counts1, R * next_probs(ids, T / 3)) < 1e-3
    # second token, conditioned on the most frequent first token
    top = int(np.argmax(counts1))
    second = samples[samples[:, 0] == top, 1]
    p2 = next_probs(ids + [top], T)
    assert _chi2_pvalue(np.bincount(second, minlength=len(p2)), len(second) * p2) > 1e-3


def test_greedy_gaps_tells_a_greedy_output_from_a_wrong_token(pair, tmp_path):
    """engine_helpers.greedy_gaps (the rule of the GPU bf16 equality test) on a float32 CPU ar
    output: every token is the float32 target's best (gap ~ 0); one token swapped for the
    position's worst has a gap far above any bf16 near-tie (tests/test_gpu_engine.BF16_TIE)."""
    out = tmp_path / "ar.h5"
    run_swiftspec(1, ["--target", pair[0], "--mode", "ar", "--prompt", PROMPTS[0], "--max-new-tokens", "16",
                      "--ignore-eos", "--out", str(out), "--quiet"])
    req = read_requests(out)[0]
    gaps = greedy_gaps(pair[0], req["prompt_ids"], req["output_ids"])
    assert len(gaps) == 16 and max(g for g, _ in gaps) < 1e-5, gaps
    assert all(m >= 0 for _, m in gaps)
    import torch

    from swiftspec_mpi.checkpoints.load import load_model
    from swiftspec_mpi.network.transformer import chain_mask
    ids = req["prompt_ids"] + req["output_ids"][:5]
    model, _ = load_model(pair[0], max_slots=len(ids) + 1)
    worst = int(model(torch.tensor(ids), torch.arange(len(ids)), 0, chain_mask(0, len(ids)))[-1].argmin())
    planted = req["output_ids"][:5] + [worst] + req["output_ids"][6:]
    assert greedy_gaps(pair[0], req["prompt_ids"], planted)[5][0] > 0.5
