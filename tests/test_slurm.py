"""The jobs/ templates on a REAL Slurm: a private slurmctld + slurmd started by the session fixture
in tests/slurm_cluster.py. The templates are submitted unchanged (knobs via --export) on a tiny
random checkpoint; the HDF5 traces they write are checked against docs/trace-format.md, and the
greedy async output against the ar output.

Skips, each for a condition of the machine:
- every test that starts the cluster, where the Slurm binaries are missing (.ci/install-slurm.sh
  installs them); under SWIFTSPEC_TEST_STRICT=1 (CI) those tests fail instead;
- the two fake-GPU template tests, where the cluster could not make its fake GPU device nodes
  (mknod needs root or CAP_MKNOD; the reason names the error);
- the MPS probe test, where a CUDA driver loads (the probe's outcome then depends on the GPU).
Every test that needs the engine fails, loudly, while `swiftspec run` / `tiny-checkpoint` are
missing.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, slurm_cluster  # noqa: E402,F401  (fixture, used by name)

REPO = Path(__file__).resolve().parent.parent
JOBS = REPO / "jobs"
VENV = Path(sys.executable).parent.parent          # the venv running pytest holds swiftspec too
SWIFTSPEC = VENV / "bin" / "swiftspec"
EXIT_INTERRUPTED = 4                                # swiftspec_mpi.core.errors.EXIT_INTERRUPTED
JOB_TIMEOUT = 300                                   # seconds any one job may take on a loaded 2-core CI box
MAX_NEW = 24                                        # tokens per prompt in the generation tests
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Summarize the plot of Hamlet in one sentence.",
]

pytestmark = pytest.mark.mpi


# ----------------------------------------------------------------------------------- helpers
def trace_requests(path: Path) -> int:
    """How many requests a trace file being rewritten holds now (0 while it cannot be read)."""
    try:
        with h5py.File(path, "r") as f:
            return len(f["requests"]) if "requests" in f else 0
    except OSError:
        return 0


def read_trace(path: Path) -> dict:
    """Root attributes, per-request attributes + output ids, and /ranks of one HDF5 trace."""
    def s(v):
        return v.decode() if isinstance(v, bytes) else v
    with h5py.File(path, "r") as f:
        root = {k: s(v) for k, v in f.attrs.items()}
        reqs = []
        for name in sorted(f["requests"]):
            g = f["requests"][name]
            d = {k: s(v) for k, v in g.attrs.items()}
            d["output_ids"] = g["output_ids"][()].tolist()
            d["prompt_ids"] = g["prompt_ids"][()].tolist()
            d["n_steps"] = len(g["steps"])
            reqs.append(d)
        ranks = f["ranks"][()] if "ranks" in f else None
    return {"root": root, "requests": reqs, "ranks": ranks}


def job_log(cluster: SlurmCluster, job_id: int) -> str:
    return f"--- job {job_id} output ---\n{cluster.job_output(job_id)}"


def assert_completed(cluster: SlurmCluster, job_id: int, info: dict) -> None:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (
        f"job {job_id}: {info.get('JobState')} exit {info.get('ExitCode')}\n" + job_log(cluster, job_id))


def assert_good_trace(trace: dict, mode: str, world: int, n_requests: int) -> None:
    root = trace["root"]
    assert root["format"] == "swiftspec-trace" and int(root["format_version"]) == 1
    assert root["mode"] == mode
    assert bool(root["complete"]) is True and root["exit_status"] == "ok"
    assert json.loads(root["env_json"])  # parses
    assert len(trace["requests"]) == n_requests
    for i, r in enumerate(trace["requests"]):
        assert int(r["index"]) == i
        assert r["prompt_text"] == PROMPTS[i]
        assert r["prompt_ids"], "empty tokenized prompt"
        assert 1 <= len(r["output_ids"]) <= MAX_NEW
        assert int(r["new_tokens"]) == len(r["output_ids"])
        assert r["stop_reason"] in ("max_new_tokens", "eos")
        assert r["n_steps"] >= 1
    ranks = trace["ranks"]
    assert ranks is not None and len(ranks) == world
    assert sorted(ranks["rank"].tolist()) == list(range(world))
    roles = sorted(ranks["role"].tolist())
    assert roles == ([0] * (world - 1) + [1] if mode == "async" else [0] * world)


def outputs(trace: dict) -> list[list[int]]:
    return [r["output_ids"] for r in trace["requests"]]


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, str]:
    """A tiny random target/draft pair (`swiftspec tiny-checkpoint`)."""
    assert SWIFTSPEC.exists(), f"{SWIFTSPEC} missing: pip install -e . into {VENV}"
    d = tmp_path_factory.mktemp("tiny")
    r = subprocess.run([str(SWIFTSPEC), "tiny-checkpoint", str(d)], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, f"swiftspec tiny-checkpoint failed:\n{r.stdout}\n{r.stderr}"
    return {"SWIFTSPEC_TARGET": str(d / "target"), "SWIFTSPEC_DRAFT": str(d / "draft")}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """The submit directory of the jobs: prompts.jsonl in it, runs/ appears under it."""
    d = tmp_path_factory.mktemp("submit")
    with open(d / "prompts.jsonl", "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt": p}) + "\n")
    return d


@pytest.fixture(scope="session")
def base_env(tiny) -> dict[str, str]:
    """Knobs every engine job gets: the tiny models, this venv, few tokens, float32 (exact on CPU)."""
    return {**tiny, "SWIFTSPEC_VENV": str(VENV), "MAX_NEW_TOKENS": str(MAX_NEW), "DTYPE": "float32"}


@pytest.fixture(scope="session")
def generated(slurm_cluster, base_env, workdir) -> dict:
    """jobs/generate.sbatch, submitted twice at once: MODE=async on 2 tasks and MODE=ar on 1."""
    cluster = slurm_cluster
    jobs = {
        "async": cluster.submit(JOBS / "generate.sbatch", cwd=workdir, options=["--ntasks=2"],
                                export={**base_env, "MODE": "async", "DRAFT_RANKS": "1"}),
        "ar": cluster.submit(JOBS / "generate.sbatch", cwd=workdir, options=["--ntasks=1"],
                             export={**base_env, "MODE": "ar"}),
    }
    result = {}
    for mode, job_id in jobs.items():
        info = cluster.wait_job(job_id, timeout=JOB_TIMEOUT)
        result[mode] = {"id": job_id, "info": info,
                        "h5": workdir / "runs" / f"swiftspec-{job_id}.h5"}
    return result


# ----------------------------------------------------------------------------------- no engine needed
def test_templates_parse_and_every_knob_is_commented():
    """bash -n on every script; each #SBATCH line and each `NAME=${NAME:-default}` knob has a
    comment on its line (the templates are meant to be edited by people who did not write them)."""
    scripts = sorted(JOBS.glob("*.sbatch")) + sorted(JOBS.glob("*.sh"))
    assert {p.name for p in scripts} >= {"generate.sbatch", "generate-gpu.sbatch", "bench.sbatch",
                                        "interactive.sh", "mpirun-local.sh"}
    knob = re.compile(r"^(export )?([A-Z][A-Z0-9_]*)=\$\{\2:?-")
    for p in scripts:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"
        assert os.access(p, os.X_OK), f"{p.name} is not executable"
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.startswith("#SBATCH") or knob.match(line):
                assert "# " in line.split("#SBATCH", 1)[-1], f"{p.name}:{n} has no comment: {line}"
        text = p.read_text()
        if re.search(r"^\s*(exec )?srun ", text, re.M):   # launches its ranks with srun
            assert "--mpi=pmi2" in text or 'SRUN_MPI:-pmi2' in text, f"{p.name}: srun without pmi2"
            assert "pmix" in text, f"{p.name} must say that Open MPI needs --mpi=pmix"


def test_srun_pmi2_gives_one_world(slurm_cluster):
    """srun --mpi=pmi2 + the mpich wheel: one MPI world of 2 ranks that can talk (not 2 singletons)."""
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print(c.rank, c.size, c.allreduce(c.rank + 1), flush=True)")
    r = slurm_cluster.run(["srun", "--mpi=pmi2", "-n", "2", sys.executable, "-c", code], timeout=120)
    assert sorted(r.stdout.split("\n")[:2]) == ["0 2 3", "1 2 3"], r.stdout + r.stderr


def test_srun_without_pmi_gives_singletons(slurm_cluster):
    """What the engine's world-size check guards against: no PMI -> two worlds of size 1."""
    code = "from mpi4py import MPI; print(MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, flush=True)"
    r = slurm_cluster.run(["srun", "--mpi=none", "-n", "2", sys.executable, "-c", code], timeout=120)
    assert r.stdout.split("\n")[:2] == ["0 1", "0 1"], r.stdout + r.stderr


def test_template_fails_fast_on_missing_prompts(slurm_cluster, workdir):
    """A wrong PROMPTS path ends the job in the script (exit 2, one clear line), before srun."""
    job = slurm_cluster.submit(JOBS / "generate.sbatch", cwd=workdir,
                               export={"PROMPTS": "/nonexistent/prompts.jsonl",
                                       "SWIFTSPEC_VENV": str(VENV)})
    info = slurm_cluster.wait_job(job, timeout=120)
    log = slurm_cluster.job_output(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", f"{info}\n{log}"
    assert "prompts file '/nonexistent/prompts.jsonl' not found" in log, log
    assert "srun" not in log.replace("+ srun", "")  # nothing launched


# ----------------------------------------------------------------------------------- engine jobs
def test_generate_async_job(slurm_cluster, generated):
    """generate.sbatch MODE=async on 2 tasks: COMPLETED, trace named after the job id, complete."""
    job = generated["async"]
    assert_completed(slurm_cluster, job["id"], job["info"])
    assert job["h5"].is_file(), f"no {job['h5']}\n" + job_log(slurm_cluster, job["id"])
    trace = read_trace(job["h5"])
    assert_good_trace(trace, "async", world=2, n_requests=len(PROMPTS))
    env = json.loads(trace["root"]["env_json"])
    assert env["world_size"] == 2 and env["verify_ranks"] == 1 and env["draft_ranks"] == 1, env
    assert env["slurm_job_id"] == str(job["id"]), env
    assert env["gpu_sharing"]["gpu_uuids"] == [None, None] and env["gpu_sharing"]["shared_gpu_ranks"] == [], env
    log = slurm_cluster.job_output(job["id"])
    assert "swiftspec exited with status 0" in log, log


def test_generate_async_equals_ar(slurm_cluster, generated):
    """Greedy async (draft + verify groups under srun) == greedy ar, token for token."""
    for mode in ("async", "ar"):
        assert_completed(slurm_cluster, generated[mode]["id"], generated[mode]["info"])
    ar = read_trace(generated["ar"]["h5"])
    assert_good_trace(ar, "ar", world=1, n_requests=len(PROMPTS))
    asy = read_trace(generated["async"]["h5"])
    assert outputs(asy) == outputs(ar)
    assert [r["text"] for r in asy["requests"]] == [r["text"] for r in ar["requests"]]
    # speculation did something: fewer verify steps than tokens somewhere (tiny draft agrees often)
    assert sum(r["n_steps"] for r in asy["requests"]) < sum(len(o) for o in outputs(asy))


def test_world_size_mismatch_is_refused(slurm_cluster, tiny, tmp_path):
    """srun without the matching PMI starts singletons; the engine refuses them with the fix."""
    out = tmp_path / "never.h5"
    r = slurm_cluster.run(
        ["srun", "--mpi=none", "-n", "2", str(SWIFTSPEC), "run", "--mode", "async",
         "--target", tiny["SWIFTSPEC_TARGET"], "--draft", tiny["SWIFTSPEC_DRAFT"],
         "--prompt", "hello", "--max-new-tokens", "4", "--threads", "1", "--out", str(out)],
        timeout=180, check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "MPI world size is 1 but Slurm started 2 tasks" in r.stderr, r.stderr
    assert "--mpi=pmi2" in r.stderr
    assert not out.exists()


def test_generate_gpu_template_binds_by_localid(slurm_cluster, base_env, workdir, generated):
    """generate-gpu.sbatch on the fake-GPU node: --gpus-per-node=2, rank i bound to GPU i through
    SLURM_LOCALID, the engine (on CPU here) gives the ar output."""
    if slurm_cluster.gpu_reason:
        pytest.skip(slurm_cluster.gpu_reason)
    job = slurm_cluster.submit(
        JOBS / "generate-gpu.sbatch", cwd=workdir,
        options=["--gpus-per-node=2", "--ntasks-per-node=2", "--cpus-per-task=1"],
        export={**base_env, "DEVICE": "cpu", "THREADS": "1", "DRAFT_RANKS": "1"})
    info = slurm_cluster.wait_job(job, timeout=JOB_TIMEOUT)
    assert_completed(slurm_cluster, job, info)
    log = slurm_cluster.job_output(job)
    assert "GPUs 0,1" in log, log                 # the job got both GPUs
    for rank in (0, 1):
        assert f"rank {rank} (node node0, local {rank}): CUDA_VISIBLE_DEVICES={rank}" in log, log
    trace = read_trace(workdir / "runs" / f"swiftspec-{job}.h5")
    assert_good_trace(trace, "async", world=2, n_requests=len(PROMPTS))
    assert outputs(trace) == outputs(read_trace(generated["ar"]["h5"]))


def test_generate_gpu_template_starts_mps_for_shared_gpus(slurm_cluster, base_env, workdir, tmp_path):
    """generate-gpu.sbatch with 2 ranks on 1 (fake) GPU: MPS=auto starts a per-job daemon (a
    stand-in nvidia-cuda-mps-control), found next to the submitted template, and stops it."""
    if slurm_cluster.gpu_reason:
        pytest.skip(slurm_cluster.gpu_reason)
    bin_dir, log = fake_mps_control(tmp_path)
    job = slurm_cluster.submit(
        JOBS / "generate-gpu.sbatch", cwd=workdir,
        options=["--gpus-per-node=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
        export={**base_env, "DEVICE": "cpu", "THREADS": "1", "DRAFT_RANKS": "1", "TMPDIR": str(tmp_path),
                "MPS_PROBE": "0",   # the stand-in daemon serves no CUDA client
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": f"runs/mps-{tmp_path.name}.h5"})
    info = slurm_cluster.wait_job(job, timeout=JOB_TIMEOUT)
    assert_completed(slurm_cluster, job, info)
    out = slurm_cluster.job_output(job)
    assert "started a CUDA MPS daemon for 2 ranks on 1 GPU(s)" in out and "stopped the CUDA MPS daemon" in out, out
    assert log.read_text().splitlines()[-1] == "quit"
    env = json.loads(read_trace(workdir / "runs" / f"mps-{tmp_path.name}.h5")["root"]["env_json"])
    assert env["gpu_sharing"]["mps_daemon"] == [True, True], env


def test_interactive_under_salloc(slurm_cluster, base_env, workdir, generated):
    """salloc -n 2 jobs/interactive.sh PROMPT: srun inside the allocation, text on stdout."""
    out = workdir / "runs" / "interactive.h5"
    r = slurm_cluster.run(["salloc", "-n", "2", "-c", "1", str(JOBS / "interactive.sh"), PROMPTS[0]],
                          timeout=JOB_TIMEOUT, check=False, cwd=workdir,
                          extra_env={**base_env, "OUT": str(out), "CHAT": "0", "MODE": "async"})
    assert r.returncode == 0, r.stdout + r.stderr
    trace = read_trace(out)
    assert bool(trace["root"]["complete"]) and trace["root"]["mode"] == "async"
    assert len(trace["ranks"]) == 2
    ref = read_trace(generated["ar"]["h5"])["requests"][0]
    assert trace["requests"][0]["output_ids"] == ref["output_ids"]
    assert ref["text"].strip()[:20] in r.stdout, r.stdout   # streamed to the terminal


def test_interactive_session_under_salloc(slurm_cluster, base_env, workdir, generated):
    """salloc -n 2 jobs/interactive.sh with no prompt: a session; srun hands the piped input to
    task 0 only (--input=0), which answers each line and ends at the end of the input."""
    out = workdir / "runs" / "session.h5"
    r = slurm_cluster.run(["salloc", "-n", "2", "-c", "1", str(JOBS / "interactive.sh")],
                          timeout=JOB_TIMEOUT, check=False, cwd=workdir, input=f"{PROMPTS[0]}\n{PROMPTS[1]}\n",
                          extra_env={**base_env, "OUT": str(out), "CHAT": "0", "MODE": "async"})
    assert r.returncode == 0, r.stdout + r.stderr
    trace = read_trace(out)
    assert bool(trace["root"]["complete"]) and trace["root"]["mode"] == "async"
    ref = read_trace(generated["ar"]["h5"])["requests"]
    assert [q["output_ids"] for q in trace["requests"]] == [q["output_ids"] for q in ref[:2]]
    assert "interactive session" in r.stderr, r.stderr


def test_generate_template_serves_http_until_scancel(slurm_cluster, base_env, tmp_path, generated):
    """SERVE=PORT: generate.sbatch runs `swiftspec run --serve`; a completion over HTTP equals the
    batch `ar` job's output text; scancel ends it with exit 4 and the answered request in the trace."""
    import socket
    import urllib.request
    with socket.socket() as s_:
        s_.bind(("127.0.0.1", 0))
        port = s_.getsockname()[1]
    out = tmp_path / "runs" / "served.h5"
    job = slurm_cluster.submit(JOBS / "generate.sbatch", cwd=tmp_path, options=["--ntasks=2"],
                               export={**base_env, "MODE": "async", "SERVE": str(port), "OUT": str(out)})
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        state = slurm_cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{state}\n" + job_log(slurm_cluster, job)
        assert time.monotonic() < deadline, "the server never answered\n" + job_log(slurm_cluster, job)
        time.sleep(0.3)
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": MAX_NEW}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        answer = json.loads(r.read())
    ref = read_trace(generated["ar"]["h5"])["requests"][0]
    slurm_cluster.run(["scancel", str(job)], timeout=30)
    info = slurm_cluster.wait_job(job, timeout=120)
    log = slurm_cluster.job_output(job)
    assert f"swiftspec exited with status {EXIT_INTERRUPTED}" in log, log
    assert "--serve" in log and "serving http://127.0.0.1:" in log, log
    trace = read_trace(out)
    assert trace["root"]["exit_status"] == "interrupted" and len(trace["requests"]) == 1, info
    assert trace["requests"][0]["output_ids"] == ref["output_ids"]
    assert answer["choices"][0]["text"] == trace["requests"][0]["text"]


@pytest.mark.parametrize("how", ["scancel", "time-limit-signal"])
def test_cancel_leaves_partial_trace(slurm_cluster, base_env, tmp_path, how):
    """Mid-run SIGTERM: the ranks finish their step, write a partial trace (complete=False,
    exit_status interrupted) and exit EXIT_INTERRUPTED, which the script passes on.
    scancel: SIGTERM to script and ranks -> CANCELLED. time-limit-signal: `scancel --signal=TERM`
    reaches the ranks only, exactly what `#SBATCH --signal=TERM@120` does before the time limit
    -> the job ends FAILED with exit code 4 (not killed at the limit)."""
    many = tmp_path / "many.jsonl"
    many.write_text("".join(json.dumps({"prompt": f"Story number {i}: once upon a time"}) + "\n"
                            for i in range(200)))
    out = tmp_path / "runs" / "cancelled.h5"
    job = slurm_cluster.submit(JOBS / "generate.sbatch", cwd=tmp_path, options=["--ntasks=2"],
                               export={**base_env, "MODE": "async", "PROMPTS": str(many),
                                       "MAX_NEW_TOKENS": "64", "OUT": str(out)})
    deadline = time.monotonic() + JOB_TIMEOUT
    # the file exists before the first request (its header); a checkpoint with a request in
    # it says decoding is under way, so the signal lands mid-run
    while not (out.exists() and trace_requests(out) >= 1):
        state = slurm_cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{state}\n" + job_log(slurm_cluster, job)
        assert time.monotonic() < deadline, "no checkpoint file\n" + job_log(slurm_cluster, job)
        time.sleep(0.2)
    assert slurm_cluster.job(job)["JobState"] == "RUNNING"
    cmd = ["scancel", str(job)] if how == "scancel" else ["scancel", "--signal=TERM", str(job)]
    slurm_cluster.run(cmd, timeout=30)
    info = slurm_cluster.wait_job(job, timeout=120)
    log = slurm_cluster.job_output(job)
    want = "CANCELLED" if how == "scancel" else "FAILED"
    assert info["JobState"] == want, f"{info}\n{log}"
    assert f"swiftspec exited with status {EXIT_INTERRUPTED}" in log, log
    assert info["ExitCode"] == f"{EXIT_INTERRUPTED}:0", f"{info}\n{log}"
    trace = read_trace(out)
    assert bool(trace["root"]["complete"]) is False
    assert trace["root"]["exit_status"] == "interrupted", trace["root"]
    assert 1 <= len(trace["requests"]) < 200
    assert all(len(r["output_ids"]) >= 1 for r in trace["requests"][:-1])
    # the one in flight is cut short; if the signal came while the leaders were closing a finished
    # request, that request keeps its real reason and its whole output (close_open_requests)
    last = trace["requests"][-1]
    assert last["stop_reason"] in ("interrupted", "max_new_tokens", "eos"), last["stop_reason"]
    if last["stop_reason"] == "max_new_tokens":
        assert len(last["output_ids"]) == 64


def test_mpiexec_inside_allocation(slurm_cluster, base_env, tmp_path, generated):
    """`salloc -n 2 jobs/mpirun-local.sh`: MPICH's mpiexec inside an allocation (hydra starts its
    proxy through srun, so the ranks see SLURM_NTASKS=1 of the proxy step but a world of 2) must
    run, not be mistaken for a PMI mismatch."""
    out = tmp_path / "hydra.h5"
    r = slurm_cluster.run(["salloc", "-n", "2", "-c", "1", str(JOBS / "mpirun-local.sh")],
                          timeout=JOB_TIMEOUT, check=False, cwd=tmp_path,
                          extra_env={**base_env, "NP": "2", "MODE": "async", "PROMPT": PROMPTS[0],
                                     "THREADS": "1", "OUT": str(out)})
    assert r.returncode == 0, r.stdout + r.stderr
    trace = read_trace(out)
    assert bool(trace["root"]["complete"]) and len(trace["ranks"]) == 2
    assert trace["requests"][0]["output_ids"] == outputs(read_trace(generated["ar"]["h5"]))[0]


def test_bench_job(slurm_cluster, base_env, workdir, generated):
    """jobs/bench.sbatch: `swiftspec bench --systems async` inside the job (its mpiexec starts 2
    ranks with the fork bootstrap): COMPLETED, table + json + a complete trace; first prompt of
    each of 2 categories, same tokens as the ar job gave for those prompts."""
    prompts = workdir / "bench-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [p], "category": c}) + "\n"
                               for p, c in zip(PROMPTS, ["writing", "writing", "coding"])))
    job = slurm_cluster.submit(JOBS / "bench.sbatch", cwd=workdir,
                               options=["--ntasks=2", "--cpus-per-task=1"],
                               export={**base_env, "PROMPTS": str(prompts), "PER_CATEGORY": "1",
                                       "SYSTEMS": "async"})
    info = slurm_cluster.wait_job(job, timeout=JOB_TIMEOUT)
    assert_completed(slurm_cluster, job, info)
    out_dir = workdir / "runs" / f"bench-{job}"
    assert "async" in (out_dir / "bench.md").read_text()
    result = json.loads((out_dir / "bench.json").read_text())
    assert [(s["system"], s["status"]) for s in result["systems"]] == [("async", "ok")], result
    trace = read_trace(out_dir / "async.h5")
    assert bool(trace["root"]["complete"]) and len(trace["ranks"]) == 2
    ar = outputs(read_trace(generated["ar"]["h5"]))
    assert outputs(trace) == [ar[0], ar[2]]      # PROMPTS[0] (writing) and PROMPTS[2] (coding)


def test_bench_time_limit_signal(slurm_cluster, base_env, tmp_path):
    """`#SBATCH --signal=B:TERM@120` signals only the batch script; it turns that into Ctrl-C for
    bench, which stops the running system (partial trace) and still writes its table."""
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Story {i}: once upon a time"],
                                           "category": "writing"}) + "\n" for i in range(100)))
    out_dir = tmp_path / "bench"
    job = slurm_cluster.submit(JOBS / "bench.sbatch", cwd=tmp_path,
                               options=["--ntasks=2", "--cpus-per-task=1"],
                               export={**base_env, "PROMPTS": str(prompts), "PER_CATEGORY": "100",
                                       "SYSTEMS": "ar", "MAX_NEW_TOKENS": "64",
                                       "OUT_DIR": str(out_dir)})
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (out_dir / "ar.h5").exists():
        state = slurm_cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{state}\n" + job_log(slurm_cluster, job)
        assert time.monotonic() < deadline, "no trace\n" + job_log(slurm_cluster, job)
        time.sleep(0.2)
    slurm_cluster.run(["scancel", "--batch", "--signal=TERM", str(job)], timeout=30)
    info = slurm_cluster.wait_job(job, timeout=120)
    log = slurm_cluster.job_output(job)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{log}"
    assert "asking bench to stop" in log, log
    result = json.loads((out_dir / "bench.json").read_text())
    (ar,) = result["systems"]
    assert ar["system"] == "ar" and ar["status"] != "ok", ar
    trace = read_trace(out_dir / "ar.h5")
    assert trace["root"]["exit_status"] == "interrupted" and not bool(trace["root"]["complete"]), log
    assert (out_dir / "bench.md").is_file()


def fake_mps_control(folder: Path) -> tuple[Path, Path]:
    """A stand-in nvidia-cuda-mps-control on PATH (no GPU here): `-d` makes the daemon's control
    pipe in CUDA_MPS_PIPE_DIRECTORY (what the engine checks), `quit` on stdin removes it; each
    call is logged. -> (bin folder for PATH, log file)."""
    bin_dir, log = folder / "fakebin", folder / "mps.log"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-cuda-mps-control"
    tool.write_text(f"""#!/bin/bash
if [[ ${{1:-}} == -d ]]; then echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {log}
    touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read -r cmd; echo "$cmd" >> {log}; rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
""")
    tool.chmod(0o755)
    return bin_dir, log


def mpirun_local_with_fake_mps(tiny, tmp_path: Path, out: Path, **extra):
    """jobs/mpirun-local.sh, `async` on 2 ranks, MPS=1, the stand-in nvidia-cuda-mps-control on
    PATH, `extra` added to the environment. -> (completed process, the stand-in's log, env)."""
    bin_dir, log = fake_mps_control(tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "HYDRA_", "CUDA_MPS_", "MPS"))}
    env.update(tiny, SWIFTSPEC_VENV=str(VENV), NP="2", MODE="async", PROMPT=PROMPTS[1], MPS="1",
               MAX_NEW_TOKENS=str(MAX_NEW), THREADS="1", OUT=str(out), TMPDIR=str(tmp_path),
               PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", **extra)
    r = subprocess.run([str(JOBS / "mpirun-local.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=JOB_TIMEOUT)
    return r, log, env


def test_mpirun_local_starts_and_stops_mps(tiny, tmp_path):
    """jobs/mpirun-local.sh MPS=1: a per-run MPS daemon (a stand-in here) is started before the
    ranks, which see it (the trace's gpu_sharing.mps_daemon), and stopped after them."""
    r, log, env = mpirun_local_with_fake_mps(tiny, tmp_path, tmp_path / "mps.h5",
                                             MPS_PROBE="0")   # the stand-in serves no CUDA client
    assert r.returncode == 0, r.stdout + r.stderr
    start, quit_ = log.read_text().splitlines()
    pipe = start.split()[1]
    base = str(tmp_path) if len(str(tmp_path)) <= 60 else "/tmp"     # mps.sh keeps socket paths short
    assert start.startswith(f"start {base}/swiftspec-mps-") and pipe.endswith("/pipe") and quit_ == "quit"
    assert not Path(pipe).exists()                          # removed once the daemon stopped
    assert "started a CUDA MPS daemon for 2 ranks" in r.stderr and "stopped the CUDA MPS daemon" in r.stderr
    trace = read_trace(tmp_path / "mps.h5")
    env_json = json.loads(trace["root"]["env_json"])
    assert env_json["gpu_sharing"]["mps_daemon"] == [True, True], env_json["gpu_sharing"]
    env["MPS"] = "maybe"
    r = subprocess.run([str(JOBS / "mpirun-local.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=JOB_TIMEOUT)
    assert r.returncode != 0 and "MPS must be auto, 1 or 0, not 'maybe'" in r.stderr, r.stderr


def test_mpirun_local_without_slurm(tiny, tmp_path):
    """jobs/mpirun-local.sh on a workstation: the wheel's mpiexec, 2 ranks, async, one prompt."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "HYDRA_"))}
    env.update(tiny, SWIFTSPEC_VENV=str(VENV), NP="2", MODE="async", PROMPT=PROMPTS[1],
               MAX_NEW_TOKENS=str(MAX_NEW), THREADS="1", OUT=str(tmp_path / "local.h5"))
    r = subprocess.run([str(JOBS / "mpirun-local.sh")], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=JOB_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    trace = read_trace(tmp_path / "local.h5")
    root = trace["root"]
    assert root["mode"] == "async" and bool(root["complete"]) and root["exit_status"] == "ok"
    assert sorted(trace["ranks"]["role"].tolist()) == [0, 1]
    req = trace["requests"][0]
    assert req["prompt_text"] == PROMPTS[1] and 1 <= len(req["output_ids"]) <= MAX_NEW


def _libcuda_loads() -> bool:
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_libcuda_loads(), reason="a CUDA driver is present: the probe's outcome depends on the GPU")
def test_mps_daemon_no_client_can_use_is_stopped(tiny, tmp_path):
    """mps.sh tries a daemon it started with one CUDA client (MPS_PROBE=1, the default). Here no
    client can work (no CUDA driver), as on a node whose MPS server cannot start: the daemon is
    stopped again, the job runs without it (the ranks see none) and says so once."""
    r, log, _env = mpirun_local_with_fake_mps(tiny, tmp_path, tmp_path / "probe.h5")
    assert r.returncode == 0, r.stdout + r.stderr
    start, quit_ = log.read_text().splitlines()
    assert start.startswith("start ") and quit_ == "quit"
    assert not Path(start.split()[1]).exists()
    assert r.stderr.count("the CUDA MPS daemon started but a CUDA client could not use it") == 1, r.stderr
    assert "started a CUDA MPS daemon for" not in r.stderr and "stopped the CUDA MPS daemon" not in r.stderr
    env_json = json.loads(read_trace(tmp_path / "probe.h5")["root"]["env_json"])
    assert env_json["gpu_sharing"]["mps_daemon"] == [False, False], env_json["gpu_sharing"]
