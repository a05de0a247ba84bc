"""Helpers of the fault matrix (tests/test_reliability.py) and the header fuzzers
(tests/test_fuzz_headers.py): launch a job and find its ranks, damaged copies of the tiny
checkpoint, a tiny GGUF file, and a fault-injection launcher.

Fault injection, test-only (nothing in the package knows about it): run the ranks as

    mpiexec -n 2 python tests/reliability_helpers.py --fault RANK:WHERE:N run ARGS...

and world rank RANK raises RuntimeError("injected fault ...") at the N-th call of WHERE
(RANK:WHERE:N:user raises CheckpointError("injected user error ...") instead)
(`expand`: DraftSide.expand, `verify`: TargetSide.forward_tree, `load`: checkpoint.load_model,
`validate`: validate.prepare_config, rank 0's validation);
every other rank runs `swiftspec run ARGS` unchanged. With SWIFTSPEC_FAULT_STAMP=FILE in the
environment, the faulty rank writes time.time() to FILE when it raises.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from engine_helpers import MPIEXEC   # the launcher: a command line, split (SWIFTSPEC_TEST_MPIEXEC)

BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
ERROR_PREFIX = "swiftspec run: error"


# ----------------------------------------------------------------------------- launching a job

class Job:
    """One `mpiexec -n N swiftspec run ...` in the background, its ranks tagged through the
    environment (SWIFTSPEC_TEST_TAG) so the test can find their pids in /proc."""

    def __init__(self, n: int, args: list[str], *, env: dict | None = None,
                 fault: str | None = None, stdin=None):
        self.tag = uuid.uuid4().hex
        self.n = n
        e = dict(os.environ)
        for k in [k for k in e if k.startswith("SLURM_")]:
            del e[k]                  # a test run inside a Slurm job must not look like a step
        e.update(OMP_NUM_THREADS="1", SWIFTSPEC_NO_PIN="1", PYTHONUNBUFFERED="1",
                 SWIFTSPEC_TEST_TAG=self.tag)
        e.update(env or {})
        entry = [sys.executable, str(HERE / "reliability_helpers.py"), "--fault", fault] if fault \
            else [sys.executable, "-m", "swiftspec_mpi"]
        self.cmd = [*MPIEXEC, "-n", str(n), *entry, "run", "--threads", "1", *args]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, env=e, stdin=stdin, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.stdout = self.stderr = ""
        self.seconds = None
        self.ended_at = None       # time.time() when the job was seen ending

    def rank_pids(self) -> dict[int, int]:
        """world rank -> pid of the running ranks (hydra sets PMI_RANK)."""
        found = {}
        key = f"SWIFTSPEC_TEST_TAG={self.tag}".encode()
        for d in glob.glob("/proc/[0-9]*"):
            try:
                with open(d + "/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(d + "/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if key not in env or b"mpiexec" in cmdline.split(b"\0")[0]:
                continue
            for kv in env:
                if kv.startswith(b"PMI_RANK="):
                    found[int(kv[9:])] = int(d[6:])
        return found

    def wait_ranks(self, n: int, timeout: float = 120) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.rank_pids()
            if len(pids) == n:
                return pids
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"ranks of {self.cmd} not found (exit {self.proc.poll()})\n"
                             f"{self.communicate(5)}")

    def wait_file(self, path, timeout: float = 150, min_requests: int = 1) -> None:
        """Until the job's HDF5 file exists and holds `min_requests` finished requests."""
        import h5py
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ended = self.proc.poll() is not None
            if os.path.exists(path):
                try:
                    with h5py.File(path, "r") as f:
                        done = sum(1 for g in f["requests"].values()
                                   if g.attrs["stop_reason"] != "interrupted")
                    if done >= min_requests:
                        return
                except (OSError, KeyError):
                    pass     # replaced under us: os.replace is atomic, but open/rename can race
            if ended:
                raise AssertionError(f"job ended (exit {self.proc.returncode}) before writing "
                                     f"{min_requests} request(s) to {path}\n{self.communicate(5)}")
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"{path} did not get {min_requests} request(s) within {timeout} s")

    def communicate(self, timeout: float) -> str:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
        self.stdout += out or ""
        self.stderr += err or ""
        if self.seconds is None:
            self.seconds = time.monotonic() - self.t0
            self.ended_at = time.time()
        return f"exit {self.proc.returncode}\nstdout:\n{self.stdout[-2000:]}\nstderr:\n{self.stderr[-4000:]}"

    def signal_mid_run(self, out, sig: int, rank: int | None = None) -> tuple[int, float]:
        """Once `out` holds a finished request, send `sig` to world rank `rank` (None: to
        mpiexec, which forwards it to every rank, as Slurm does) and wait for the end.
        -> (exit code, seconds from the signal to the end)."""
        self.wait_file(out, min_requests=1)
        if rank is None:
            self.proc.send_signal(sig)
        else:
            os.kill(self.wait_ranks(self.n)[rank], sig)
        t = time.monotonic()
        rc = self.finish(timeout=90)
        return rc, time.monotonic() - t

    def finish(self, timeout: float = 180) -> int:
        """Wait for the end; -> exit code. A job still alive after `timeout` is killed (the
        test then fails on the code/time it asserts)."""
        self.communicate(timeout)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # our own session: mpiexec + ranks
            except ProcessLookupError:
                pass

    def report(self) -> str:
        return (f"{' '.join(self.cmd)}\nexit {self.proc.returncode} after {self.seconds:.1f} s\n"
                f"stdout:\n{self.stdout[-2000:]}\nstderr:\n{self.stderr[-4000:]}")


def run_job(n: int, args: list[str], timeout: float = 180, **kw) -> Job:
    job = Job(n, args, **kw)
    job.finish(timeout)
    return job


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(ERROR_PREFIX)]


# ----------------------------------------------------------------------------- damaged checkpoints

def copy_model(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def safetensors_header_end(path: str) -> int:
    """Bytes of the 8-byte length + JSON header of a safetensors file."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def truncate_file(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def write_other_tokenizer(folder: str) -> None:
    """Replace folder/tokenizer.json by a byte-level BPE trained on other text (another vocab,
    same special tokens, fewer tokens than the model's embeddings)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["Zebras quietly juggle vivid xylophones near the fjord."] * 50 + \
             ["Pack my box with five dozen liquor jugs; sphinx of black quartz, judge my vow."] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))


def write_tiny_gguf(hf_folder: str, path: str) -> str:
    """A qwen2 GGUF file (F32 tensors, byte-level BPE tokenizer metadata) with the weights and
    tokenizer of a tiny Hugging Face folder, written with gguf.GGUFWriter."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_folder, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf_folder, "tokenizer.json")) as f:
        tj = json.load(f)
    weights = load_file(os.path.join(hf_folder, "model.safetensors"))
    w = gguf.GGUFWriter(path, arch="qwen2")
    w.add_context_length(int(cfg.get("max_position_embeddings", 4096)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg["num_key_value_heads"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    vocab = tj["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"] if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for name, arr in weights.items():
        if name in names:
            gname = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{parts[base]}.{kind}"
        w.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_data_start(path: str) -> int:
    """Offset of the first tensor's data (everything before it is header)."""
    import gguf
    r = gguf.GGUFReader(path, "r")
    start = min(int(t.data_offset) for t in r.tensors)
    del r
    return start


def gguf_spans(path: str) -> list[tuple[str, int, int, str]]:
    """(label, byte offset, byte length, kind) of every scalar or string metadata value and of
    each tensor's n_dims, dims, type and data offset: the fields a structural fuzzer rewrites.
    kind: "int", "float" or "bytes"."""
    import gguf
    r = gguf.GGUFReader(path, "r")
    spans = []
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or len(f.types) != 1:
            continue                                   # arrays: left to the byte fuzzer
        t = f.types[0]
        pos = f.offset + sum(int(p.nbytes) for p in f.parts[:-1])
        kind = {gguf.GGUFValueType.FLOAT32: "float", gguf.GGUFValueType.FLOAT64: "float",
                gguf.GGUFValueType.STRING: "bytes"}.get(t, "int")
        spans.append((key, pos, int(f.parts[-1].nbytes), kind))
    for t in r.tensors:
        parts = t.field.parts            # name_len, name, n_dims, dims, type, offset
        pos = t.field.offset + int(parts[0].nbytes) + int(parts[1].nbytes)
        for label, part in zip(("n_dims", "dims", "type", "offset"), parts[2:]):
            spans.append((f"{t.name}.{label}", pos, int(part.nbytes), "int"))
            pos += int(part.nbytes)
    del r
    return spans


# ----------------------------------------------------------------------------- fault injection

def _install_fault(spec: str) -> None:
    rank_s, where, nth_s, *kind = spec.split(":")
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_rank() != int(rank_s):
        return
    nth = int(nth_s)
    if where == "expand":
        from swiftspec_mpi.engine import decoding as mod
        owner, attr = mod.DraftSide, "expand"
    elif where == "verify":
        from swiftspec_mpi.engine import decoding as mod
        owner, attr = mod.TargetSide, "forward_tree"
    elif where == "load":
        from swiftspec_mpi.checkpoints import load as mod
        owner, attr = mod, "load_model"
    elif where == "validate":
        from swiftspec_mpi.cli import job as mod   # run_job calls the name it imported
        owner, attr = mod, "prepare_config"
    else:
        raise SystemExit(f"unknown fault point {where!r}")
    original = getattr(owner, attr)
    calls = [0]

    stamp = os.environ.get("SWIFTSPEC_FAULT_STAMP")

    def faulty(*a, **k):
        calls[0] += 1
        if calls[0] >= nth:
            if stamp:                      # when it fired, for the test's time bound
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
            if kind == ["user"]:
                from swiftspec_mpi.core.errors import CheckpointError
                raise CheckpointError(f"injected user error in {where} (call {calls[0]})")
            raise RuntimeError(f"injected fault in {where} (call {calls[0]})")
        return original(*a, **k)

    setattr(owner, attr, faulty)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--fault":
        raise SystemExit("usage: reliability_helpers.py --fault RANK:WHERE:N run ARGS...")
    import faulthandler
    faulthandler.register(signal.SIGUSR1)       # `kill -USR1 PID`: the rank's Python stacks
    _install_fault(argv[1])
    from swiftspec_mpi.cli.main import main as cli_main
    return cli_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
