"""jobs/generate.sbatch across nodes, on a real three-node Slurm cluster in network namespaces
(tests/slurm_netns.py): the groups land where the template says, the output equals the one-node
`ar` output token for token, and a lost rank, node or link ends the whole job in seconds with one
line naming it, and a trace file that keeps what was generated until seconds before.

Skipped only where network namespaces cannot be made (not root, no `ip`, no Slurm); CI runs as
root and runs them.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import need_registry_model  # noqa: E402
from slurm_netns import NetnsCluster, netns_cluster  # noqa: E402,F401  (fixture, used by name)
from test_slurm import JOBS, SWIFTSPEC, VENV, read_trace, tiny  # noqa: E402,F401

pytestmark = pytest.mark.mpi

JOB_TIMEOUT = 300
MAX_NEW = 24
PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
FAULT_END_S = 30              # a fault ends the whole job within this many seconds
CHECKPOINT_LAG_S = 8          # the file holds what was committed until this many seconds before a kill
PEER_TIMEOUT = "10"           # --peer-timeout of the fault jobs (a silent peer is reported after it)
LONG = 400                    # tokens per request of the fault jobs: one request lasts several seconds

# name -> (sbatch options, template knobs, expected host of each world rank)
LAYOUTS = {
    "async-draft-node1-verify-node2": (["--nodes=2", "--ntasks=2", "--nodelist=node[1-2]"],
                                       {"MODE": "async", "DRAFT_RANKS": "1", "DRAFT_NODES": "node1"},
                                       ["node2", "node1"]),
    "async-tp2-nodes12-draft-node3": (["--nodes=3", "--ntasks=3"],
                                      {"MODE": "async", "DRAFT_RANKS": "1"},
                                      ["node1", "node2", "node3"]),
    "sync-tp2-nodes12": (["--nodes=2", "--ntasks=2", "--nodelist=node[1-2]"], {"MODE": "sync"},
                         ["node1", "node2"]),
    "ar-tp2-nodes23": (["--nodes=2", "--ntasks=2", "--nodelist=node[2-3]"], {"MODE": "ar"},
                       ["node2", "node3"]),
}


@pytest.fixture(scope="module")
def submit_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mn-submit")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (d / "long.jsonl").write_text("".join(json.dumps({"prompt": f"Chapter {i}. Once upon a time"}) + "\n"
                                          for i in range(40)))
    return d


@pytest.fixture(scope="module")
def knobs(tiny) -> dict[str, str]:
    return {**tiny, "SWIFTSPEC_VENV": str(VENV), "MAX_NEW_TOKENS": str(MAX_NEW), "DTYPE": "float32",
            "THREADS": "1"}


@pytest.fixture(scope="module")
def layouts(netns_cluster, knobs, submit_dir) -> dict:
    """Every layout of LAYOUTS and the one-node `ar` reference, submitted at once."""
    c = netns_cluster
    jobs = {"ar-one-node": c.submit(JOBS / "generate.sbatch", cwd=submit_dir,
                                    options=["--nodes=1", "--ntasks=1"], export={**knobs, "MODE": "ar"})}
    for name, (options, env, _hosts) in LAYOUTS.items():
        jobs[name] = c.submit(JOBS / "generate.sbatch", cwd=submit_dir, options=options,
                              export={**knobs, **env})
    done = {}
    for name, job in jobs.items():
        info = c.wait_job(job, timeout=JOB_TIMEOUT)
        done[name] = {"id": job, "info": info, "log": c.job_output(job),
                      "h5": submit_dir / "runs" / f"swiftspec-{job}.h5"}
    return done


def test_gpu_template_puts_draft_on_its_own_node(netns_cluster, knobs, submit_dir, layouts):
    """generate-gpu.sbatch on two nodes (run on the CPU here: no GPUs in the namespaces): the
    verify rank on the first node, the draft rank on the second, the one-node `ar` output."""
    c = netns_cluster
    job = c.submit(JOBS / "generate-gpu.sbatch", cwd=submit_dir,
                   options=["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--gpus-per-node=0",
                            "--cpus-per-task=1", "--nodelist=node[2-3]"],
                   export={**knobs, "DEVICE": "cpu", "DRAFT_RANKS": "1", "MPS": "0",
                           "DTYPE": "float32", "OUT": str(submit_dir / "runs" / "gpu-2-nodes.h5")})
    info = c.wait_job(job, timeout=JOB_TIMEOUT)
    log = c.job_output(job)
    assert info["JobState"] == "COMPLETED", log
    assert "placement: rank 0 (verify) node2, rank 1 (draft) node3 (MPICH netmod ofi)" in log, log
    trace = read_trace(submit_dir / "runs" / "gpu-2-nodes.h5")
    assert sorted((int(r["rank"]), r["host"].decode()) for r in trace["ranks"]) == [(0, "node2"), (1, "node3")]
    assert outputs(trace) == outputs(read_trace(layouts["ar-one-node"]["h5"]))


def outputs(trace: dict) -> list[list[int]]:
    return [r["output_ids"] for r in trace["requests"]]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_places_groups_and_equals_one_node_ar(layouts, name):
    """The job completes, each rank ran on the node the template placed it on (the trace's
    /ranks host), and the greedy output equals the one-node `ar` output token for token."""
    job, ref = layouts[name], layouts["ar-one-node"]
    for j in (job, ref):
        assert j["info"]["JobState"] == "COMPLETED" and j["info"]["ExitCode"] == "0:0", j["log"]
    hosts = LAYOUTS[name][2]
    trace = read_trace(job["h5"])
    assert bool(trace["root"]["complete"]), job["log"]
    by_rank = {int(r["rank"]): r["host"].decode() for r in trace["ranks"]}
    assert [by_rank[r] for r in range(len(hosts))] == hosts, (by_rank, job["log"])
    mode = LAYOUTS[name][1]["MODE"]
    roles = ["verify"] * (len(hosts) - (mode == "async")) + ["draft"] * (mode == "async")
    want = ", ".join(f"rank {r} ({role}) {h}" for r, (role, h) in enumerate(zip(roles, hosts)))
    assert f"placement: {want} (MPICH netmod ofi)" in job["log"], job["log"]
    assert outputs(trace) == outputs(read_trace(ref["h5"]))
    assert len(outputs(trace)) == len(PROMPTS) and all(outputs(trace))


def test_analyze_shows_nodes(layouts):
    """`swiftspec analyze` prints where every rank ran."""
    job = layouts["async-tp2-nodes12-draft-node3"]
    r = subprocess.run([str(SWIFTSPEC), "analyze", str(job["h5"])], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("nodes"))
    assert "node1: rank 0 (verify); node2: rank 1 (verify); node3: rank 2 (draft)" in line, r.stdout


# ----------------------------------------------------------------------------------- faults
def start_long_job(c: NetnsCluster, knobs, submit_dir, tmp_path, layout: str = "async-tp2-nodes12-draft-node3"):
    """A job of long requests in `layout`; returns (job id, trace path) once decoding is under
    way (the first checkpoint of a request in flight is on disk)."""
    options, env, _hosts = LAYOUTS[layout]
    out = tmp_path / "fault.h5"
    job = c.submit(JOBS / "generate.sbatch", cwd=submit_dir, options=options,
                   export={**knobs, **env, "PROMPTS": str(submit_dir / "long.jsonl"), "OUT": str(out),
                           "MAX_NEW_TOKENS": str(LONG), "EXTRA_ARGS": f"--peer-timeout {PEER_TIMEOUT}"})
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        state = c.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"{state}\n{c.job_output(job)}"
        assert time.monotonic() < deadline, "no checkpoint\n" + c.job_output(job)
        if out.exists() and committed(out) > 0:
            return job, out
        time.sleep(0.2)


def committed(path: Path) -> int:
    try:
        return sum(len(r["output_ids"]) for r in read_trace(path)["requests"])
    except (OSError, KeyError):
        return 0


def wait_end(c: NetnsCluster, job: int, t0: float, final: bool = True) -> tuple[dict, float]:
    """The job's state once its script and ranks are gone, and the seconds from t0 until then.
    COMPLETING counts as ended: the job's processes are over and Slurm is still waiting for a
    node that cannot answer (it drops it after SlurmdTimeout). final: wait for the state after
    COMPLETING too."""
    ended = None
    while True:
        info = c.job(job)
        if info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING"):
            ended = ended or time.monotonic() - t0
            if info["JobState"] != "COMPLETING" or not final:
                return info, ended
        assert time.monotonic() - t0 < 120, f"job {job} still {info['JobState']}\n{c.job_output(job)}"
        time.sleep(0.2)


def check_file_kept_up(out: Path, reference: list[list[int]], t_fault: float, wall_fault: float,
                       log: str) -> dict:
    """The file written until the fault: every request in it is a prefix of the greedy reference
    (finished ones whole), and its last write came at most CHECKPOINT_LAG_S before the fault."""
    trace = read_trace(out)
    assert trace["requests"], log
    for r in trace["requests"]:
        ref = reference[int(r["index"])]
        ids = r["output_ids"]
        assert ids == ref[:len(ids)], (r["index"], log)
        if r["stop_reason"] in ("max_new_tokens", "eos"):
            assert ids == ref, log
    assert out.stat().st_mtime >= wall_fault - CHECKPOINT_LAG_S, (
        f"last write {wall_fault - out.stat().st_mtime:.1f} s before the fault\n{log}")
    return trace


@pytest.fixture(scope="module")
def long_reference(netns_cluster, knobs, submit_dir, tmp_path_factory) -> list[list[int]]:
    """The greedy one-node `ar` output of the first requests of long.jsonl."""
    c = netns_cluster
    out = tmp_path_factory.mktemp("mn-ref") / "ref.h5"
    few = submit_dir / "long-few.jsonl"
    few.write_text("".join((submit_dir / "long.jsonl").read_text().splitlines(True)[:6]))
    job = c.submit(JOBS / "generate.sbatch", cwd=submit_dir, options=["--nodes=1", "--ntasks=1"],
                   export={**knobs, "MODE": "ar", "PROMPTS": str(few), "OUT": str(out),
                           "MAX_NEW_TOKENS": str(LONG)})
    info = c.wait_job(job, timeout=JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED", c.job_output(job)
    return outputs(read_trace(out))


def ended_by_fault(c, job, t_fault, expect, before_final=None) -> str:
    """The job ended within FAULT_END_S, non-zero, with exactly one error line of ours, which
    holds every string of `expect` (a string or a tuple of them)."""
    info, took = wait_end(c, job, t_fault, final=before_final is None)
    if before_final is not None:     # e.g. heal the link, then let Slurm finish the job
        before_final()
        info, _ = wait_end(c, job, t_fault)
    log = c.job_output(job)
    assert took <= FAULT_END_S, f"{took:.1f} s\n{log}"
    assert info["JobState"] != "COMPLETED" and info["ExitCode"] != "0:0", f"{info}\n{log}"
    # our software's error lines (streamed text has no final newline: a line may start mid-text)
    errors = re.findall(r"(?:generate\.sbatch|swiftspec run): error[^\n]*", log)
    assert len(errors) == 1, log
    for want in ((expect,) if isinstance(expect, str) else expect):
        assert want in errors[0], log
    return log


@pytest.mark.parametrize("rank,node", [(2, "node3"), (1, "node2")], ids=["draft-node", "verify-member"])
def test_rank_killed_ends_job(netns_cluster, knobs, submit_dir, long_reference, tmp_path, rank, node):
    """SIGKILL of a rank's process on another node (the draft node; the verify group's non-leader
    member): srun ends every rank, one line names the lost rank and node (the template's, from
    srun, or rank 0's, when the connection reset reached it first), and the file holds the tokens
    committed until seconds before the kill."""
    c = netns_cluster
    job, out = start_long_job(c, knobs, submit_dir, tmp_path)
    pids = c.job_pids(node, job)
    assert pids, f"no ranks of job {job} on {node}\n{c.job_output(job)}"
    time.sleep(2.5)                      # mid-request
    t_fault, wall_fault = time.monotonic(), time.time()
    for pid in pids:
        subprocess.run(["kill", "-KILL", str(pid)], check=False)
    role = "draft" if rank == 2 else "verify"
    # srun's view (the template's line) or rank 0's (the connection reset reached it first)
    log = ended_by_fault(c, job, t_fault, (f"rank {rank} ({role}", node))
    check_file_kept_up(out, long_reference, t_fault, wall_fault, log)


def test_partition_ends_job(netns_cluster, knobs, submit_dir, long_reference, tmp_path):
    """The draft node's link goes down (silence, no reset): rank 0 reports the silent draft
    leader by rank and node after --peer-timeout, writes the file and ends the job."""
    c = netns_cluster
    job, out = start_long_job(c, knobs, submit_dir, tmp_path)
    time.sleep(1.5)
    t_fault, wall_fault = time.monotonic(), time.time()
    c.partition("node3")
    try:
        log = ended_by_fault(c, job, t_fault, f"rank 2 (draft leader on node3) within {PEER_TIMEOUT} s",
                             before_final=lambda: c.heal("node3"))
    finally:
        c.heal("node3")
    trace = check_file_kept_up(out, long_reference, t_fault, wall_fault, log)
    assert re.match(r"error: no (token tree from|delivery of a verify result to) rank 2 \(draft leader "
                    r"on node3\)", trace["root"]["exit_status"]), trace["root"]
    hosts = sorted(r["host"].decode() for r in trace["ranks"])
    assert hosts == ["node1", "node2", "node3"], hosts
    c.wait_nodes_idle()


def test_scancel_multinode_job(netns_cluster, knobs, submit_dir, long_reference, tmp_path):
    """scancel: every rank on every node stops at its next step, rank 0 writes the partial file
    (exit_status interrupted) and the job ends CANCELLED."""
    c = netns_cluster
    job, out = start_long_job(c, knobs, submit_dir, tmp_path)
    time.sleep(1.5)
    t_fault, wall_fault = time.monotonic(), time.time()
    c.run(["scancel", str(job)], timeout=30)
    info, took = wait_end(c, job, t_fault)
    log = c.job_output(job)
    assert took <= FAULT_END_S and info["JobState"] == "CANCELLED", f"{took:.1f} s {info}\n{log}"
    assert "swiftspec exited with status 4" in log, log     # EXIT_INTERRUPTED, passed on by the script
    trace = check_file_kept_up(out, long_reference, t_fault, wall_fault, log)
    assert trace["root"]["exit_status"] == "interrupted"


def test_dead_slurmd_before_start(netns_cluster, knobs, submit_dir, tmp_path):
    """node3's slurmd is dead when a three-node job is submitted: the job fails as Slurm says
    (the ranks cannot start there) or waits for the node; the template names the node."""
    c = netns_cluster
    c.kill_slurmd("node3")
    try:
        options, env, _ = LAYOUTS["async-tp2-nodes12-draft-node3"]
        job = c.submit(JOBS / "generate.sbatch", cwd=submit_dir, options=options,
                       export={**knobs, **env, "OUT": str(tmp_path / "never.h5")})
        t0 = time.monotonic()
        info, took = wait_end(c, job, t0)
        log = c.job_output(job)
        assert info["JobState"] in ("FAILED", "NODE_FAIL") and info["ExitCode"] != "0:0", f"{info}\n{log}"
        assert "the ranks could not start on node3" in log, log
    finally:
        c.start_slurmd("node3")
        c.wait_nodes_idle()


@pytest.mark.slow
def test_smollm2_across_nodes_equals_one_node_ar(netns_cluster, knobs, submit_dir, tmp_path):
    """The real SmolLM2-135M (opt-in: -m slow): async with the draft (the model's first 12
    layers) on node1 and the verify rank on node2, and ar with TP=3 over the three nodes (9
    heads, 3 KV heads: 3 ways), each equal to the one-node ar output token for token."""
    from swiftspec_mpi.checkpoints import registry
    need_registry_model("smollm2-135m")      # skips only where neither the cache nor the index has it
    target = str(registry.resolve_model("smollm2-135m"))
    c = netns_cluster
    env = {**knobs, "SWIFTSPEC_TARGET": target, "SWIFTSPEC_DRAFT": "", "MAX_NEW_TOKENS": "48",
           "EXTRA_ARGS": "--draft-layers 12"}
    runs = {"ar-one-node": (["--nodes=1", "--ntasks=1"], {"MODE": "ar"}),
            "async-2-nodes": (["--nodes=2", "--ntasks=2", "--nodelist=node[1-2]"],
                              {"MODE": "async", "DRAFT_RANKS": "1", "DRAFT_NODES": "node1"}),
            "ar-tp3-3-nodes": (["--nodes=3", "--ntasks=3"], {"MODE": "ar"})}
    jobs = {name: c.submit(JOBS / "generate.sbatch", cwd=submit_dir, options=options,
                           export={**env, **extra, "OUT": str(tmp_path / f"{name}.h5")})
            for name, (options, extra) in runs.items()}
    got = {}
    for name, job in jobs.items():
        info = c.wait_job(job, timeout=900)
        assert info["JobState"] == "COMPLETED", c.job_output(job)
        got[name] = outputs(read_trace(tmp_path / f"{name}.h5"))
    assert got["async-2-nodes"] == got["ar-one-node"]
    assert got["ar-tp3-3-nodes"] == got["ar-one-node"]


def _place(tmp_path, mode, ntasks, draft, draft_nodes, nodes, cpus_per_node, cpus_per_task=1):
    """jobs/placement.sh's place_ranks under a fake allocation (a stand-in `scontrol show
    hostnames`) -> (exit status, hostfile lines, stdout + stderr)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text('#!/bin/bash\ntr , "\\n" <<< "$3"\n')   # "a,b" -> one per line
    (fake / "scontrol").chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.unlink(missing_ok=True)
    script = (f'source {JOBS / "placement.sh"}; place_ranks {mode} {ntasks} {draft} "{draft_nodes}" {hostfile}; '
              'echo "ARGS ${PLACE_ARGS[*]}"; echo "PLACEMENT $PLACEMENT"')
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_NODELIST": ",".join(nodes),
           "SLURM_JOB_CPUS_PER_NODE": cpus_per_node, "SLURM_CPUS_PER_TASK": str(cpus_per_task),
           "PLACE_SCRIPT": "generate.sbatch"}
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    lines = hostfile.read_text().split() if hostfile.exists() else []
    return r.returncode, lines, r.stdout + r.stderr


def test_placement_helper_layouts(tmp_path):
    """place_ranks without a cluster: verify ranks spread evenly over the non-draft nodes, the
    draft ranks on DRAFT_NODES (default: the last node), sync/ar over all; one node: nothing."""
    rc, hosts, out = _place(tmp_path, "async", 9, 1, "", ["g1", "g2"], "8(x2)")
    assert rc == 0 and hosts == ["g1"] * 8 + ["g2"], out
    assert "ARGS --distribution=arbitrary" in out and "rank 8 (draft) g2" in out
    rc, hosts, out = _place(tmp_path, "async", 5, 2, "n1", ["n1", "n2", "n3"], "4(x3)")
    assert rc == 0 and hosts == ["n2", "n2", "n3", "n1", "n1"], out
    rc, hosts, out = _place(tmp_path, "ar", 4, 0, "", ["n1", "n2"], "2(x2)")
    assert rc == 0 and hosts == ["n1", "n1", "n2", "n2"], out
    rc, hosts, out = _place(tmp_path, "async", 2, 1, "", ["n1"], "4")
    assert rc == 0 and hosts == [] and "ARGS \n" in out, out


def test_placement_helper_refuses_what_cannot_fit(tmp_path):
    """A placement the allocation has no cores for, or a DRAFT_NODES outside the job: one line
    with the fix, exit 2."""
    rc, _hosts, out = _place(tmp_path, "async", 4, 1, "", ["n1", "n2"], "2(x2)")
    assert rc == 2 and ("generate.sbatch: error: the placement puts 3 ranks x 1 cores on n1, but this "
                        "job has 2 cores there; sbatch --ntasks-per-node=3 (or --exclusive)") in out, out
    rc, _hosts, out = _place(tmp_path, "async", 2, 1, "n9", ["n1", "n2"], "1(x2)")
    assert rc == 2 and "DRAFT_NODES names n9, which is not in this job's nodes (n1,n2)" in out, out
