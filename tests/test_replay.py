"""Acceptance replayed on dummy weights (`run --accept-from`) and `swiftspec plan`, end to end
under mpiexec on the tiny pair (whose draft shares the target's first layers, so it accepts for
real): a replay reproduces the recorded mean accepted length, sync and async; the trace and
analyze say it replayed; bad input is one error line; plan picks a valid split for 2-4 ranks."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_helpers import MPIEXEC, env_for_tests, read_root, run_swiftspec, write_prompts
from swiftspec_mpi.core.errors import EXIT_USER_ERROR
from swiftspec_mpi.trace import acceptance
from swiftspec_mpi.trace.read import read_trace

PROMPTS = ["def fib(n):", "Write a poem about the sea.", "Explain quicksort in two sentences.",
           "What is the capital of France?", "List three prime numbers.", "Translate hello to German.",
           "Summarize the plot of Hamlet.", "class Stack:"]
TREE = ["--verify-size", "8", "--max-new-tokens", "96", "--quiet"]


def mean_accepted(path) -> tuple[float, int]:
    t = read_trace(str(path))
    return acceptance.mean_accepted(t), sum(len(r.steps) for r in t.requests)


def record_and_replay(tmp_path, tiny_pair, n: int, mode: str, extra: list[str]) -> tuple[float, float, int]:
    """Record a real run of the tiny pair, replay its trace on dummy weights with three seeds ->
    (recorded mean accepted length, the replays' pooled mean, replayed steps)."""
    target, draft = tiny_pair
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    real = tmp_path / f"{mode}.h5"
    run_swiftspec(n, ["--target", target, "--draft", draft, "--mode", mode, "--prompts", prompts,
                      "--ignore-eos", "--out", str(real), *TREE, *extra])
    total_acc, total_steps = 0.0, 0
    for seed in (0, 1, 2):
        out = tmp_path / f"replay_{mode}_{seed}.h5"
        run_swiftspec(n, ["--target", target, "--draft", draft, "--load-format", "dummy", "--accept-from",
                          str(real), "--mode", mode, "--prompts", prompts, "--seed", str(seed),
                          "--out", str(out), *TREE, *extra])
        m, steps = mean_accepted(out)
        total_acc += m * steps
        total_steps += steps
        cfg = read_root(out)["config"]
        assert cfg["accept_from"] == str(real) and cfg["accept_sha256"] == acceptance.file_sha256(str(real))
    return mean_accepted(real)[0], total_acc / total_steps, total_steps


@pytest.mark.parametrize("mode,n,extra", [("sync", 1, ["--expansions", "2"]), ("sync", 1, ["--expansions", "3"]),
                                         ("async", 2, [])])
def test_replay_reproduces_the_recorded_mean_accepted_length(tmp_path, tiny_pair, mode, n, extra):
    recorded, replayed, steps = record_and_replay(tmp_path, tiny_pair, n, mode, extra)
    assert steps >= 300
    assert recorded > 1.8                      # the pair really accepts
    assert abs(replayed / recorded - 1) < 0.05, (recorded, replayed)


def test_analyze_says_replayed_and_model_is_stable(tmp_path, tiny_pair):
    """analyze's first line names the replay; --acceptance prints the model and the halves'
    spread; --acceptance-out writes a model file that replays like the trace."""
    target, draft = tiny_pair
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    real, model = tmp_path / "real.h5", tmp_path / "model.json"
    run_swiftspec(1, ["--target", target, "--draft", draft, "--mode", "sync", "--prompts", prompts,
                      "--ignore-eos", "--expansions", "1", "--out", str(real), *TREE])
    cmd = [sys.executable, "-m", "swiftspec_mpi", "analyze", str(real)]
    got = subprocess.run(cmd + ["--acceptance", "--acceptance-out", str(model)], capture_output=True,
                         text=True, env=env_for_tests(), check=True)
    assert "depth" in got.stdout and "1st" in got.stdout and "stability:" in got.stdout
    data = json.loads(model.read_text())
    assert data["format"] == "swiftspec-acceptance" and data["halves_spread"] < 0.2
    replay = tmp_path / "replay.h5"
    run_swiftspec(1, ["--target", target, "--draft", draft, "--load-format", "dummy", "--accept-from",
                      str(model), "--mode", "sync", "--prompts", prompts, "--expansions", "1",
                      "--out", str(replay), *TREE])
    first = subprocess.run(cmd[:-1] + [str(replay)], capture_output=True, text=True, env=env_for_tests(),
                           check=True).stdout.splitlines()[0]
    assert "acceptance REPLAYED from" in first and str(model) in first and "meaningless" in first


@pytest.mark.parametrize("args,message", [
    (["--mode", "async"], "add --load-format dummy"),
    (["--mode", "ar", "--load-format", "dummy"], "needs a draft"),
])
def test_replay_refuses_bad_input_in_one_line(tmp_path, tiny_pair, args, message):
    target, draft = tiny_pair
    model = tmp_path / "m.json"
    acceptance.write_model(acceptance.chain_model(2.5, 8), str(model))
    proc = run_swiftspec(2, ["--target", target, "--draft", draft, "--accept-from", str(model), "--prompt", "hi",
                             "--max-new-tokens", "4", "--out", str(tmp_path / "x.h5"), *args], check=False)
    assert proc.returncode == EXIT_USER_ERROR
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def plan(n: int, tiny_pair, model, *extra) -> subprocess.CompletedProcess:
    target, draft = tiny_pair
    cmd = [*MPIEXEC, "-n", str(n), sys.executable, "-m", "swiftspec_mpi", "plan", "--target", target,
           "--draft", draft, "--accept-from", str(model), "--threads", "1", "--steps", "100",
           "--max-expansions", "3", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env_for_tests())


@pytest.mark.parametrize("n", [2, 3, 4])
def test_plan_picks_a_valid_split(tmp_path, tiny_pair, n):
    model = tmp_path / "m.json"
    acceptance.write_model(acceptance.chain_model(2.8, 8), str(model))
    proc = plan(n, tiny_pair, model)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"plan: {n} ranks") and "chosen:" in out and f"mpiexec -n" in out
    proc = plan(n, tiny_pair, model, "--json")
    result = json.loads(proc.stdout)
    c = result["chosen"]
    assert c["mode"] in ("sync", "async") and c["tok_s"] == max(r["tok_s"] for r in result["table"])
    if c["mode"] == "async":
        assert c["draft_ranks"] >= 1 and c["draft_ranks"] + c["verify_ranks"] == n
    else:
        assert 1 <= c["verify_ranks"] <= n and c["expansions"] >= 1
    assert {r["mode"] for r in result["table"]} == {"sync", "async"}


@pytest.mark.parametrize("n,extra,message", [
    (1, [], "launch it on 2 or more ranks"),
    (2, ["--verify-size", "16", "--max-context", "40"], "does not fit the KV room"),
])
def test_plan_refuses_impossible_input_in_one_line(tmp_path, tiny_pair, n, extra, message):
    model = tmp_path / "m.json"
    acceptance.write_model(acceptance.chain_model(2.8, 8), str(model))
    proc = plan(n, tiny_pair, model, *extra)
    assert proc.returncode == EXIT_USER_ERROR
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_run_draft_ranks_auto_takes_the_plans_split(tmp_path, tiny_pair):
    """--draft-ranks auto on 3 ranks: the job runs with the split the plan's model weighs best,
    and its config says it was chosen."""
    target, draft = tiny_pair
    model = tmp_path / "m.json"
    acceptance.write_model(acceptance.chain_model(2.8, 8), str(model))
    out = tmp_path / "auto.h5"
    proc = run_swiftspec(3, ["--target", target, "--draft", draft, "--load-format", "dummy", "--accept-from",
                             str(model), "--mode", "async", "--draft-ranks", "auto", "--prompt", "def fib(n):",
                             "--max-new-tokens", "16", "--quiet", "--out", str(out)])
    assert "--draft-ranks auto:" in proc.stderr
    root = read_root(out)
    env = json.loads(root["env_json"])
    assert root["config"]["auto_split"] and env["draft_ranks"] == root["config"]["draft_ranks"] in (1, 2)
    assert env["draft_ranks"] + env["verify_ranks"] == 3


@pytest.mark.timing        # a 20 % bound on tok/s: a busy 2-core box misses it (benchmarks/cpu_plan_check.sh)
def test_plan_predicts_the_measured_tok_s_of_its_choice(tmp_path, tiny_pair):
    """plan on one CPU rank (its table: sync; --gpus 2 lets it run on one) predicts the tok/s
    of the split it chooses, run with replayed acceptance, within 20 %: on the tiny shapes the
    host time (engine/host_time.py) is half a step, and without it the prediction is more than
    1.5x the measured. Three rounds of plan + run, interleaved, so that a burst of load on the
    shared cores (one run's tok/s scatters by up to ~10 % on 2 idle cores, 27 % was seen on a
    busy one; benchmarks/cpu_plan_check.sh shows the error run by run) weighs on the predictions
    and the runs alike; the choice is the first round's, its prediction looked up in each table."""
    target, draft = tiny_pair
    real = "benchmarks/acceptance/qwen25coder-0.5b-1.5b.json"
    keys = ("mode", "verify_size", "tree_width", "expansions", "draft_ranks", "verify_ranks")
    chosen, predicted, without_host = None, [], []
    tokens = seconds = 0.0
    for i in range(3):
        proc = plan(1, tiny_pair, real, "--gpus", "2", "--context", "150", "--json")   # 300 new tokens
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        chosen = chosen or result["chosen"]
        c = next(r for r in result["table"] if all(r.get(k) == chosen.get(k) for k in keys))
        assert c["mode"] == "sync" and c["host_ms"] > 0, c
        predicted.append(c["tok_s"])
        without_host.append(c["tokens_per_step"] / (1e-3 * (c["step_ms"] - c["host_ms"])))
        out = tmp_path / f"planned{i}.h5"
        run_swiftspec(1, ["--target", target, "--draft", draft, "--load-format", "dummy", "--accept-from", real,
                          "--mode", "sync", "--verify-size", str(c["verify_size"]), "--tree-width",
                          str(c["tree_width"]), "--expansions", str(c["expansions"]), "--prompt", "def fib(n):",
                          "--max-new-tokens", "300", "--ignore-eos", "--quiet", "--out", str(out)])
        for r in read_trace(str(out)).requests:
            tokens += len(r.output_ids)
            seconds += r.seconds
    measured = tokens / seconds
    assert abs(sum(predicted) / 3 / measured - 1) < 0.20, (chosen, predicted, measured)
    assert sum(without_host) / 3 / measured > 1.5, (without_host, measured)
