"""The fault matrix: every way a job can be misconfigured or break, run for real under mpiexec.

What must hold (docs/internals.md, DESIGN.md "What must always hold"):
- bad input is refused by rank 0 before any weights are read: exit code 2 (EXIT_USER_ERROR),
  one line naming the problem and the fix, printed once (not once per rank), no traceback, and
  no output file;
- a broken model file fails before or while loading, on whichever rank reads it, and every rank
  leaves together with one message;
- a rank that dies, hangs or raises mid-generation ends the whole job within 30 s, never a rank
  waiting forever, and the HDF5 file keeps what was generated (written atomically);
- SIGTERM ends the job after the current step with exit code 4 (EXIT_INTERRUPTED), the file
  marked complete=False, exit_status "interrupted".

Cases run on the tiny random checkpoint (conftest.tiny_pair) with short generations. Damaged
copies of it are made once per module.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import time

import pytest

from engine_helpers import read_requests, read_root, write_prompts
from reliability_helpers import (Job, copy_model, edit_config, error_lines, gguf_spans,
                                 patch_bytes, run_job, truncate_file, write_other_tokenizer,
                                 write_tiny_gguf)
from swiftspec_mpi.core.errors import EXIT_INTERRUPTED, EXIT_RUNTIME_ERROR, EXIT_USER_ERROR

pytestmark = pytest.mark.mpi

WALL_S = 30.0          # every failure must end the whole job within this
NEW_TOKENS = 48        # per request in the mid-generation cases


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def models(tiny_pair, tmp_path_factory):
    """Damaged copies of the tiny pair, by name -> path."""
    from safetensors.numpy import load_file, save_file

    target, draft = tiny_pair
    d = tmp_path_factory.mktemp("damaged")
    m = {"target": target, "draft": draft}

    m["truncated_st"] = copy_model(draft, d / "truncated_st")       # cut in the tensor data
    st = os.path.join(m["truncated_st"], "model.safetensors")
    truncate_file(st, os.path.getsize(st) // 2)

    m["corrupt_st"] = copy_model(target, d / "corrupt_st")          # garbage in the JSON header
    st = os.path.join(m["corrupt_st"], "model.safetensors")
    patch_bytes(st, 8, b"\xff\xfe garbage \x00\x01")

    m["huge_header_st"] = copy_model(draft, d / "huge_header_st")   # header length field lies
    patch_bytes(os.path.join(m["huge_header_st"], "model.safetensors"), 0,
                (1 << 40).to_bytes(8, "little"))

    m["missing_tensor"] = copy_model(draft, d / "missing_tensor")   # valid file, one tensor gone
    st = os.path.join(m["missing_tensor"], "model.safetensors")
    tensors = load_file(st)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, st, metadata={"format": "pt"})

    m["config_mismatch"] = copy_model(target, d / "config_mismatch")  # config.json != weights
    edit_config(m["config_mismatch"], intermediate_size=352)

    m["zero_heads"] = copy_model(target, d / "zero_heads")
    edit_config(m["zero_heads"], num_attention_heads=0)

    m["unsupported_arch"] = copy_model(target, d / "unsupported_arch")
    edit_config(m["unsupported_arch"], model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])

    m["other_tokenizer"] = copy_model(draft, d / "other_tokenizer")
    write_other_tokenizer(m["other_tokenizer"])

    m["short_context"] = copy_model(target, d / "short_context")
    edit_config(m["short_context"], max_position_embeddings=32)

    gguf = write_tiny_gguf(target, str(d / "target.gguf"))
    size = os.path.getsize(gguf)
    for name, cut in (("gguf_truncated_data", size - 4096), ("gguf_truncated_header", 5000)):
        m[name] = str(d / f"{name}.gguf")
        with open(gguf, "rb") as src, open(m[name], "wb") as dst:
            dst.write(src.read(cut))
    m["gguf_bad_magic"] = str(d / "bad_magic.gguf")
    with open(gguf, "rb") as src, open(m["gguf_bad_magic"], "wb") as dst:
        dst.write(b"GGML" + src.read()[4:])
    spans = {label: (offset, n) for label, offset, n, _ in gguf_spans(gguf)}
    for name, label, value in (("gguf_huge_heads", "qwen2.attention.head_count", 1 << 31),
                               ("gguf_huge_mlp", "qwen2.feed_forward_length", 0x07000000)):
        m[name] = str(d / f"{name}.gguf")       # one metadata value corrupted: loading it as is
        shutil.copyfile(gguf, m[name])          # hangs in a 2**31-head loop / allocates 90 GB
        offset, n = spans[label]
        patch_bytes(m[name], offset, value.to_bytes(n, "little"))
    return m


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """300 prompts: far more than any mid-generation case lets finish (the first checkpoint with
    a finished request comes ~5 s into decoding)."""
    d = tmp_path_factory.mktemp("prompts")
    texts = [f"Write a Python function number {i} that reverses a linked list." for i in range(300)]
    return write_prompts(d / "many.jsonl", texts)


def base_args(models, out, target="target", draft="draft", mode="async",
              prompt="def fibonacci(n):", prompts=None, max_new_tokens=8):
    source = ["--prompts", prompts] if prompts else ["--prompt", prompt]
    return ["--target", models[target], "--draft", models[draft], "--mode", mode, *source,
            "--max-new-tokens", str(max_new_tokens), "--out", str(out), "--quiet"]


def fixture_as(role: str, name: str):
    """The VALIDATION args of a default run with the fixture model `name` as the `role` model
    ("target" or "draft")."""
    return lambda m, o, t: base_args(m, o, **{role: name})


def ar_target(target: str):
    """The VALIDATION args of a plain autoregressive run on the fixture model `target`."""
    return lambda m, o, t: base_args(m, o, target=target, mode="ar")


def assert_clean_user_error(job: Job, pattern: str, out=None) -> None:
    """Exit 2 within WALL_S, exactly one error line (rank 0's) matching `pattern`, no traceback,
    no output file (nothing was generated)."""
    report = job.report()
    assert job.proc.returncode == EXIT_USER_ERROR, report
    lines = error_lines(job.stderr)
    assert len(lines) == 1, f"the message must be printed once, got {len(lines)}\n{report}"
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}\n{report}"
    assert "Traceback" not in job.stderr, report
    assert not error_lines(job.stdout), report
    assert job.seconds < WALL_S, report
    if out is not None:
        assert not os.path.exists(out), f"{out} written by a refused run\n{report}"
        folder = os.path.dirname(out)
        leftovers = [f for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                     if f.startswith(os.path.basename(out)) or ".probe." in f]
        assert not leftovers, leftovers


# ------------------------------------------------------------------------ refused by rank 0

# (id, ranks, args(models, out, tmp_path) -> list, expected message regex)
VALIDATION = [
    ("missing-target", 2, lambda m, o, t: ["--target", str(t / "nope"), "--draft", m["draft"],
                                           "--out", str(o)],
     r"nope.*(neither a registry name|no such file).*(fix the path|give)"),
    ("missing-draft", 2, lambda m, o, t: ["--target", m["target"], "--draft", str(t / "gone"),
                                          "--out", str(o)],
     r"gone.*(neither a registry name|no such file)"),
    ("truncated-safetensors", 2, fixture_as("draft", "truncated_st"),
     r"truncated_st/model\.safetensors: truncated or corrupt safetensors.*re-download"),
    ("corrupt-safetensors-header", 2, fixture_as("target", "corrupt_st"),
     r"corrupt_st/model\.safetensors: truncated or corrupt safetensors.*re-download"),
    ("safetensors-header-length-lies", 2, fixture_as("draft", "huge_header_st"),
     r"huge_header_st/model\.safetensors: truncated or corrupt safetensors"),
    ("gguf-truncated-data", 2, ar_target("gguf_truncated_data"),
     r"gguf_truncated_data\.gguf: truncated GGUF file: tensor .* ends at byte \d+ but the file "
     r"has \d+"),
    ("gguf-truncated-header", 2, ar_target("gguf_truncated_header"),
     r"gguf_truncated_header\.gguf: truncated (or corrupt )?GGUF file.*re-download"),
    ("gguf-bad-magic", 2, ar_target("gguf_bad_magic"),
     r"bad_magic\.gguf: .*(corrupt|not a GGUF file).*re-download"),
    ("draft-lacks-a-tensor", 2, fixture_as("draft", "missing_tensor"),
     r"missing_tensor: lacks tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"),
    ("config-disagrees-with-weights", 2, fixture_as("target", "config_mismatch"),
     r"config_mismatch: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[176, 64\] "
     r"but the config\.json implies \[352, 64\]"),
    ("config-zero-heads", 2, fixture_as("target", "zero_heads"),
     r"zero_heads: .*num_attention_heads.*0"),
    ("gguf-metadata-huge-head-count", 2, ar_target("gguf_huge_heads"),
     r"gguf_huge_heads\.gguf: GGUF metadata has attention\.head_count=2147483648.*does not "
     r"belong"),
    ("gguf-metadata-huge-mlp", 2, ar_target("gguf_huge_mlp"),
     r"gguf_huge_mlp\.gguf: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
     r"\[176, 64\] but the GGUF metadata implies \[117440512, 64\]"),
    ("unsupported-architecture", 2, fixture_as("target", "unsupported_arch"),
     r"--target .*unsupported_arch: unsupported model architecture 'gpt_neox'.*supported: "
     r"llama.*qwen2"),
    ("different-tokenizers", 2, fixture_as("draft", "other_tokenizer"),
     r"use different tokenizers.*same vocabulary"),
    ("prompt-longer-than-context", 2,
     lambda m, o, t: base_args(m, o, target="short_context", prompt="word " * 40),
     r"prompt 0 has \d+ tokens.*models' context is 32; shorten the prompt"),
    ("max-new-tokens-overflows-kv", 2,
     lambda m, o, t: base_args(m, o, max_new_tokens=64) + ["--max-context", "40"],
     r"--max-context 40 cannot hold.*--max-new-tokens 64; raise it to at least \d+"),
    ("kv-cache-out-of-memory", 2,
     lambda m, o, t: base_args(m, o) + ["--max-context", str(10 ** 9)],
     r"not enough memory: the KV cache .*--max-context 1000000000 slots needs [\d.]+ GiB per "
     r"rank.*only [\d.]+ GiB is available; lower --max-context"),
    ("max-new-tokens-zero", 2, lambda m, o, t: base_args(m, o) + ["--max-new-tokens", "0"],
     r"--max-new-tokens must be a positive integer, got 0"),
    ("max-new-tokens-negative", 2, lambda m, o, t: base_args(m, o) + ["--max-new-tokens", "-5"],
     r"--max-new-tokens must be a positive integer, got -5"),
    ("max-context-zero", 2, lambda m, o, t: base_args(m, o) + ["--max-context", "0"],
     r"--max-context must be a positive integer, got 0"),
    ("verify-size-negative", 2, lambda m, o, t: base_args(m, o) + ["--verify-size", "-1"],
     r"--verify-size must be a positive integer, got -1"),
    ("temperature-negative", 2, lambda m, o, t: base_args(m, o) + ["--temperature", "-0.5"],
     r"--temperature must be >= 0.*got -0\.5"),
    ("temperature-nan", 2, lambda m, o, t: base_args(m, o) + ["--temperature", "nan"],
     r"--temperature must be >= 0.*got nan"),
    ("peer-timeout-zero", 2, lambda m, o, t: base_args(m, o) + ["--peer-timeout", "0"],
     r"--peer-timeout must be positive"),
    ("draft-ranks-zero", 2, lambda m, o, t: base_args(m, o) + ["--draft-ranks", "0"],
     r"--draft-ranks must be >= 1 in async mode, got 0"),
    ("draft-ranks-negative", 2, lambda m, o, t: base_args(m, o) + ["--draft-ranks", "-2"],
     r"--draft-ranks must be >= 1 in async mode, got -2"),
    ("draft-ranks-eq-world", 2, lambda m, o, t: base_args(m, o) + ["--draft-ranks", "2"],
     r"--draft-ranks 2 leaves no verify rank in a world of 2; use at most 1"),
    ("threads-zero", 2, lambda m, o, t: base_args(m, o) + ["--threads", "0"],
     r"--threads must be a positive integer, got 0"),
    ("tp-does-not-divide-heads", 3, lambda m, o, t: base_args(m, o, mode="ar"),
     r"the target has 4 attention heads, not divisible by its group of 3 ranks"),
    ("async-on-one-rank", 1, lambda m, o, t: base_args(m, o),
     r"--mode async needs at least 2 MPI ranks.*mpiexec -n 2"),
    ("unknown-mode", 2, lambda m, o, t: base_args(m, o, mode="turbo"),
     r"unknown mode 'turbo'; use --mode async, sync or ar"),
    ("malformed-jsonl", 2, lambda m, o, t: base_args(m, o, prompts=_jsonl(
        t, ['{"prompt": "ok"}', "", '{"prompt": "fine"}', '{"prompt": oops}'])),
     r"bad\.jsonl:4: not valid JSON.*one JSON object like"),
    ("jsonl-without-prompt", 2, lambda m, o, t: base_args(m, o, prompts=_jsonl(
        t, ['{"prompt": "ok"}', '{"text": "no prompt key"}'])),
     r"bad\.jsonl:2: needs a string field \"prompt\""),
    ("unwritable-output-dir", 2, lambda m, o, t: base_args(m, "/proc/swiftspec-run.h5"),
     r"cannot write --out /proc/swiftspec-run\.h5: creating a file in /proc fails"),
    ("output-under-a-file", 2, lambda m, o, t: base_args(m, _file(t) + "/run.h5"),
     r"cannot create the folder of --out .*/afile/run\.h5 \(.*afile is a file, not a folder\)"),
    ("output-is-a-folder", 2, lambda m, o, t: base_args(m, t) + ["--overwrite"],
     r"--out .* is a folder; give a file name"),
]


def _jsonl(tmp_path, lines) -> str:
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def _file(tmp_path) -> str:
    p = tmp_path / "afile"
    p.write_text("not a folder")
    return str(p)


@pytest.mark.parametrize("name,n,make_args,pattern", VALIDATION, ids=[c[0] for c in VALIDATION])
def test_refused_by_rank0(models, tmp_path, name, n, make_args, pattern):
    out = tmp_path / "out" / "run.h5"
    job = run_job(n, make_args(models, out, tmp_path), timeout=120)
    check_out = None if name in ("unwritable-output-dir", "output-under-a-file",
                                 "output-is-a-folder") else str(out)
    assert_clean_user_error(job, pattern, check_out)


def test_srun_pmi_mismatch_singletons_refuse_and_print_once(models, tmp_path):
    """srun and the MPI library disagreeing on PMI: Slurm starts 2 tasks, but each is an MPI
    singleton (world size 1) that would run the whole job alone. Both refuse (exit 2); only
    Slurm's task 0 prints the fix, so the message appears once."""
    import subprocess
    import sys
    out = tmp_path / "run.h5"
    procs = []
    t0 = time.monotonic()
    for task in (0, 1):
        env = dict(os.environ, OMP_NUM_THREADS="1", SWIFTSPEC_NO_PIN="1", SLURM_JOB_ID="4242",
                   SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_PROCID=str(task))
        procs.append(subprocess.Popen([sys.executable, "-m", "swiftspec_mpi", "run",
                                       *base_args(models, out, mode="sync")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) for p in procs]
    seconds = time.monotonic() - t0
    report = "\n".join(f"task {i}: exit {p.returncode}\n{err}" for i, (p, (_, err))
                       in enumerate(zip(procs, results)))
    assert [p.returncode for p in procs] == [EXIT_USER_ERROR] * 2, report
    lines = [line for _, err in results for line in error_lines(err)]
    assert len(lines) == 1 and error_lines(results[0][1]), report
    assert re.search(r"MPI world size is 1 but Slurm started 2 tasks.*srun --mpi=pmi2", lines[0]), \
        report
    assert "Traceback" not in report and seconds < WALL_S and not out.exists(), report


def test_existing_output_refused_unless_overwrite(models, tmp_path):
    out = tmp_path / "run.h5"
    out.write_bytes(b"results of an earlier run")
    job = run_job(2, base_args(models, out), timeout=120)
    report = job.report()
    assert job.proc.returncode == EXIT_USER_ERROR, report
    lines = error_lines(job.stderr)
    assert len(lines) == 1 and re.search(r"output file .*run\.h5 already exists; pass --overwrite",
                                         lines[0]), report
    assert job.seconds < WALL_S, report
    assert out.read_bytes() == b"results of an earlier run"   # untouched
    # (--overwrite replacing it is exercised by test_sigterm_writes_partial_file_and_exits_4)


def test_flag_parse_error_printed_once(models, tmp_path):
    job = run_job(2, base_args(models, tmp_path / "run.h5") + ["--max-new-tokens", "many"],
                  timeout=120)
    assert job.proc.returncode == EXIT_USER_ERROR, job.report()
    lines = error_lines(job.stderr)
    assert len(lines) == 1 and "--max-new-tokens: invalid int value: 'many'" in lines[0], \
        job.report()


def test_bug_in_rank0_validation_ends_every_rank(models, tmp_path):
    """Not a UserError while rank 0 validates: its verdict still reaches every rank (no rank
    left waiting in the broadcast), exit 3 with the traceback and one summary line."""
    job = run_job(2, base_args(models, tmp_path / "run.h5"), timeout=120, fault="0:validate:1")
    report = job.report()
    assert job.proc.returncode == EXIT_RUNTIME_ERROR, report
    lines = error_lines(job.stderr)
    assert lines == ["swiftspec run: error: RuntimeError: injected fault in validate (call 1)"], \
        report
    assert "Traceback" in job.stderr and job.seconds < WALL_S, report


# ------------------------------------------------------------------------ failing while loading

def test_load_error_on_one_rank_ends_all_together(models, tmp_path):
    """A CheckpointError only the draft rank meets while loading (what rank 0's header checks
    cannot see: an I/O error, a file replaced after validation): all ranks agree on it
    (allgather) and leave together, the message printed once by rank 0, exit 2."""
    out = tmp_path / "run.h5"
    job = run_job(2, base_args(models, out), timeout=180, fault="1:load:1:user")
    assert_clean_user_error(job, r"^swiftspec run: error: injected user error in load \(call 1\)$",
                            str(out))


def test_bug_while_loading_on_one_rank_ends_all_together(models, tmp_path):
    """Not a UserError (a bug) on the draft rank while loading: the failing rank prints its
    traceback, rank 0 the one-line summary naming that rank and role; exit 3, no hang."""
    out = tmp_path / "run.h5"
    job = run_job(2, base_args(models, out), timeout=180, fault="1:load:1")
    report = job.report()
    assert job.proc.returncode == EXIT_RUNTIME_ERROR, report
    lines = error_lines(job.stderr)
    assert len(lines) == 1, report
    assert re.search(r"rank 1 \(draft\) failed while loading: RuntimeError: injected fault",
                     lines[0]), report
    assert job.seconds < WALL_S, report
    assert not out.exists(), report


# ------------------------------------------------------------------------ mid-generation faults

def gen_args(models, prompts, out, *extra):
    return ["--target", models["target"], "--draft", models["draft"], "--mode", "async",
            "--prompts", prompts, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
            "--out", str(out), "--quiet", *extra]


def check_partial_file(out, status_pattern: str, last_reason: str) -> list[dict]:
    """A valid trace with complete=False; finished requests whole; the last one possibly cut
    short, with a stop_reason matching `last_reason`."""
    root = read_root(out)
    assert root["format"] == "swiftspec-trace"
    assert not bool(root["complete"])
    assert re.search(status_pattern, root["exit_status"]), root["exit_status"]
    reqs = read_requests(out)
    assert reqs, "no request in the partial file"
    assert [r["index"] for r in reqs] == list(range(len(reqs)))
    finished = [r for r in reqs if r["stop_reason"] == "max_new_tokens"]
    for r in finished:
        assert r["new_tokens"] == NEW_TOKENS == len(r["output_ids"]), r
        assert r["steps"]["accepted"].sum() == NEW_TOKENS
    for r in reqs:      # the text of what was generated is kept too, for the cut request as well
        assert (r["text"] != "") == (r["new_tokens"] > 0), (r["stop_reason"], r["new_tokens"])
    cut = [r for r in reqs if r["stop_reason"] != "max_new_tokens"]
    assert len(cut) <= 1 and (not cut or cut[0] is reqs[-1]), [r["stop_reason"] for r in reqs]
    if cut:
        assert re.fullmatch(last_reason, cut[0]["stop_reason"]), cut[0]["stop_reason"]
        assert len(cut[0]["output_ids"]) == cut[0]["new_tokens"] < NEW_TOKENS
    return reqs


def test_sigkill_of_draft_rank_ends_job_and_keeps_finished_requests(models, prompts, tmp_path):
    out = tmp_path / "killed.h5"
    job = Job(2, gen_args(models, prompts, out))
    try:
        rc, after = job.signal_mid_run(out, signal.SIGKILL, rank=1)
    finally:
        job.kill()
    report = job.report()
    assert rc != 0, report
    assert after < WALL_S, f"job took {after:.1f} s to end after the kill\n{report}"
    assert not job.rank_pids(), "a rank survived"
    # the launcher SIGKILLs the other ranks at once (hydra even with -disable-auto-cleanup), so
    # the file is the last checkpoint: its running request, if any, is marked "interrupted"
    reqs = check_partial_file(out, r"^(running|error: .*rank 1)", "interrupted|error")
    assert sum(r["stop_reason"] == "max_new_tokens" for r in reqs) >= 1


@pytest.mark.parametrize("n", [2, 3])
def test_sigterm_writes_partial_file_and_exits_4(models, prompts, tmp_path, n):
    """mpiexec (hydra) forwards SIGTERM to every rank, as Slurm does at the time limit. With 3
    ranks the verify group has 2 (tensor parallel): its leader tells the other to stop with the
    step's tree broadcast, so neither is left in a collective."""
    out = tmp_path / "term.h5"
    out.write_bytes(b"an older file, replaced because of --overwrite")
    job = Job(n, gen_args(models, prompts, out, "--overwrite", "--draft-ranks", "1"))
    try:
        rc, after = job.signal_mid_run(out, signal.SIGTERM)
    finally:
        job.kill()
    report = job.report()
    assert rc == EXIT_INTERRUPTED, report
    assert after < WALL_S, report
    assert job.stderr.count("interrupted (signal); writing what was generated") == 1, report
    assert not error_lines(job.stderr), report
    reqs = check_partial_file(out, r"^interrupted$", "interrupted")
    assert len(reqs) < 300
    assert set(read_root(out)["events"]["role"].tolist()) == {0, 1}       # every rank's, gathered


def test_sigterm_to_one_rank_of_a_group_stops_the_group_together(models, prompts, tmp_path):
    """`ar` on 2 ranks (one tensor-parallel group), SIGTERM to rank 1 only (a signal that reaches
    the ranks a moment apart, at its extreme): the group agrees to stop at the next step, so
    rank 0 is not left blocked in a collective and writes the partial file; both exit 4."""
    out = tmp_path / "one.h5"
    args = ["--target", models["target"], "--mode", "ar", "--prompts", prompts, "--max-new-tokens",
            str(NEW_TOKENS), "--ignore-eos", "--out", str(out), "--quiet"]
    job = Job(2, args)
    try:
        rc, after = job.signal_mid_run(out, signal.SIGTERM, rank=1)
    finally:
        job.kill()
    report = job.report()
    assert rc == EXIT_INTERRUPTED, report
    assert after < 15.0, report        # not the 20 s a rank waits for a peer that never comes
    assert job.stderr.count("interrupted (signal); writing what was generated") == 1, report
    check_partial_file(out, r"^interrupted$", "interrupted")


def test_hung_draft_rank_is_reported_by_rank_and_role_after_peer_timeout(models, prompts, tmp_path):
    """SIGSTOP: the draft rank is alive but silent (the launcher sees nothing wrong). The verify
    leader's deadline (--peer-timeout) names it, writes the file and aborts the job."""
    out = tmp_path / "hung.h5"
    job = Job(2, gen_args(models, prompts, out, "--peer-timeout", "4"))
    pids = {}
    try:
        job.wait_file(out, min_requests=1)
        pids = job.wait_ranks(2)
        os.kill(pids[1], signal.SIGSTOP)
        t_stop = time.monotonic()
        rc = job.finish(timeout=90)
        after = time.monotonic() - t_stop
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        job.kill()
    report = job.report()
    assert rc == EXIT_RUNTIME_ERROR, report
    assert 4 <= after < WALL_S, f"{after:.1f} s\n{report}"
    lines = error_lines(job.stderr)
    assert len(lines) == 1, report
    # the stop lands while the verify leader waits for a token tree, or (between requests) for
    # the draft's end-of-request acknowledgement: either way the report names rank 1 and its role
    waited = r"no (token tree|end-of-request acknowledgement) from rank 1 \(draft leader on [^)]+\)"
    assert re.search(r"error on rank 0 \(verify on [^)]+\): " + waited +
                     r" within 4 s \(--peer-timeout\).*raise --peer-timeout", lines[0]), report
    check_partial_file(out, r"^error: " + waited, "error")
    # rank 0 asked every rank for its events; the stopped one cannot answer: named, file and stderr
    assert re.search(r"rank 1 \(draft\) sent no events", job.stderr), report
    assert json.loads(read_root(out)["ranks_missing"]) == [1]


def test_exception_on_draft_rank_mid_generation(models, prompts, tmp_path):
    """A bug on the draft rank in the third request or so: it tells rank 0, which prints the
    one-line error naming rank 1 (draft) once, writes the partial file and aborts the job."""
    out = tmp_path / "fault.h5"
    stamp = tmp_path / "fault-time"
    job = Job(2, gen_args(models, prompts, out), fault="1:expand:150",
              env={"SWIFTSPEC_FAULT_STAMP": str(stamp)})
    try:
        rc = job.finish(timeout=180)
    finally:
        job.kill()
    report = job.report()
    assert rc == EXIT_RUNTIME_ERROR, report
    after = job.ended_at - float(stamp.read_text())
    assert after < WALL_S, f"{after:.1f} s from the fault to the end\n{report}"
    lines = error_lines(job.stderr)
    assert len(lines) == 1, report
    assert re.search(r"error on rank 1 \(draft on [^)]+\): RuntimeError: injected fault in expand",
                     lines[0]), report
    assert "Traceback" in job.stderr   # the failing rank's own traceback: it is a bug
    reqs = check_partial_file(out, r"^error: rank 1 \(draft on [^)]+\) failed: RuntimeError: injected "
                              r"fault", "error")
    assert sum(r["stop_reason"] == "max_new_tokens" for r in reqs) >= 1   # ~60 expansions each
    assert set(read_root(out)["events"]["role"].tolist()) == {0, 1}       # the failing rank's too


def test_exception_on_tensor_parallel_member_ends_job(models, tmp_path):
    """sync on 2 ranks (one tensor-parallel group): rank 1 raises inside the target forward while
    rank 0 waits in the matching all-reduce and cannot hear the abort notice. After the grace
    period rank 1 prints the one-line error itself (once: rank 0 never printed it) and aborts
    the job. Also the regression test of a deadlock: the sync ranks used to measure their own
    draft expansions per step and could disagree, hanging in mismatched collectives."""
    out = tmp_path / "tp.h5"
    stamp = tmp_path / "fault-time"
    args = base_args(models, out, mode="sync", max_new_tokens=16)
    job = Job(2, args, fault="1:verify:3", env={"SWIFTSPEC_FAULT_STAMP": str(stamp)})
    try:
        rc = job.finish(timeout=180)
    finally:
        job.kill()
    report = job.report()
    assert rc == EXIT_RUNTIME_ERROR, report
    assert stamp.exists(), f"the fault never fired: the ranks hung before it\n{report}"
    after = job.ended_at - float(stamp.read_text())
    assert after < WALL_S, f"{after:.1f} s from the fault to the end\n{report}"
    lines = error_lines(job.stderr)
    assert lines == [f"swiftspec run: error on rank 1 (verify on {platform.node()}): RuntimeError: "
                     "injected fault in verify (call 3)"], report


def test_trace_writer_keeps_text_hdf5_cannot_store(tmp_path):
    """A byte-level tokenizer can generate NUL, a JSON prompt can hold a lone surrogate: h5py
    refuses both in strings, which used to fail the checkpoint write and so the whole job (found
    by the SIGTERM case above). The writer stores them visibly instead; tokens stay exact."""
    import h5py
    import numpy as np

    from swiftspec_mpi.trace.record import EVENT_DTYPE, RANK_DTYPE, RequestResult, write_trace
    r = RequestResult(0, "cat\x00", "prompt \ud800 with a lone surrogate", [5, 6], [0, 7, 0],
                      text="a\x00b\x00", t_start=1.0, t_end=2.0, stop_reason="max_new_tokens")
    out = tmp_path / "nul.h5"
    write_trace(str(out), mode="ar", config_json="{}", env={}, requests=[r],
                events=np.zeros(0, EVENT_DTYPE), ranks=np.zeros(0, RANK_DTYPE), complete=False,
                exit_status="error: token '\x00' in a message")
    with h5py.File(out) as f:
        g = f["requests/000000"]
        assert g.attrs["text"] == "a\u2400b\u2400" and g.attrs["category"] == "cat\u2400"
        assert g.attrs["prompt_text"] == "prompt ? with a lone surrogate"
        assert g["output_ids"][()].tolist() == [0, 7, 0]
        assert f.attrs["exit_status"] == "error: token '\u2400' in a message"
    assert os.listdir(tmp_path) == ["nul.h5"]     # no temporary file left behind
