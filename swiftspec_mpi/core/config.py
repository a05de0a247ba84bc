"""Run configuration: flags + optional TOML file (flags win), validated once on rank 0.

`RunConfig` is a plain dataclass so it pickles for the MPI broadcast and serializes to JSON for
the HDF5 trace. Validation that needs the file system or the models' config.json (cheap, no
weights) happens in cli/validate.py on rank 0; cli/job.py broadcasts its verdict so every rank
exits together with the same message.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from swiftspec_mpi.core.errors import UserError

MODES = ("async", "sync", "ar")
# how the async verify group picks its next tree (engine/async_loop.py): rate = the draft sends
# its re-rooted tree once --floor-depth levels deep, and the verify group waits for it only when
# the expected accepted tokens per second favour it; fresh = always wait for the tree the draft
# re-rooted on the latest result (the paper's)
ASYNC_POLICIES = ("rate", "fresh")
DEFAULT_ASYNC_POLICY = "rate"     # the best tok/s and acceptance of the ablation (docs/benchmarks.md)
DEFAULT_FLOOR_DEPTH = 2           # rate: levels under the root of a tree worth waiting for
INTERACTIVE_CONTEXT = 4096    # default KV slots with --interactive / --serve (prompts unknown ahead)
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


@dataclass
class Request:
    """One prompt to decode; `ids` are its tokens (after the chat template, if any), filled by
    rank 0's validation."""
    index: int
    prompt: str
    category: str = ""
    ids: list[int] = field(default_factory=list)
    question_id: object = None     # the file's "question_id" (Spec-Bench), else its line number
    max_new_tokens: int | None = None   # this request's limit (<= the run's; --serve), None: the run's
    stop: list[str] = field(default_factory=list)   # its own stop strings, besides the run's
    logprobs: int | None = None    # --serve: the target's log-probability of each committed token
                                   # and this many alternatives (0..20); None: none (argmax only)
    new_segment: bool = False      # the trace starts its next file before this request (--trace-rotate)


# --quant: auto = a quantized checkpoint runs packed, a dense one dense; int4 = packed 4-bit
# (with --load-format dummy: random packed weights, group 128); none = dequantize to --dtype
QUANTS = ("auto", "int4", "none")
STEP_KERNELS = ("chain", "persistent")


@dataclass
class RunConfig:
    """Everything `swiftspec run` was asked (the CLI flags, defaults filled by validate_basic);
    the trace keeps it as config_json."""

    # models
    target: str | None = None          # HF folder, .gguf file or a registry name; None = embedded default
    draft: str | None = None
    draft_layers: int | None = None    # truncate the draft to its first N layers (self-speculation)
    load_format: str = "auto"          # auto | dummy (random weights at the checkpoint's shape)
    accept_from: str | None = None     # replay: the target's choices drawn from this acceptance
                                       # model (a trace .h5 or a model .json; dummy weights only)
    quant: str = "auto"                # auto | int4 | none: packed 4-bit weights (packed/int4.py)
    head_bits: int = 16                # 16 | 4: the LM head as loaded, or packed 4-bit at load (GPU int4)
    step_kernel: str = "chain"         # chain | persistent: a GPU decode step as the chain of fused
    #                                    kernels, or one persistent kernel (gpu/step_kernel.py; slower
    #                                    than the chain so far: docs/benchmarks.md)
    # parallel layout
    mode: str = "async"
    draft_ranks: int | None = None     # async: ranks in the draft group (default: 1, or world/4 from 8
                                       # ranks; the flag's "auto": chosen at start, auto_split)
    async_policy: str | None = None    # async: one of ASYNC_POLICIES (None: DEFAULT_ASYNC_POLICY)
    floor_depth: int | None = None     # rate: the depth floor (None: DEFAULT_FLOOR_DEPTH)
    threads: int | None = None         # torch threads per rank (default: cores of the node / ranks on it)
    device: str = "auto"               # auto | cpu | cuda
    # prompts and stopping
    prompt: str | None = None
    prompts: str | None = None         # JSONL file
    interactive: bool = False          # prompts from rank 0's stdin, one request each (interactive.py)
    serve: str | None = None           # "[HOST:]PORT": an OpenAI-style HTTP endpoint on rank 0 (http_server.py)
    serve_max_body: int = 4 << 20      # --serve: the largest request body accepted (bytes; larger: 413)
    serve_read_timeout: float = 30.0   # --serve: seconds from a request's start to its last body byte (then 408)
    serve_max_queue: int = 64          # --serve: requests that may wait behind the one decoding (then 429)
    serve_max_idle: int = 32           # --serve: connections held with no request queued or decoding
    trace_rotate: str | None = None    # "N" requests, "Tm"/"Th" minutes/hours, both "N,Tm", "0": one file
                                       # (--serve / --interactive; default there: DEFAULT_TRACE_ROTATE)
    chat: bool = False
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)   # extra end-of-sequence ids
    ignore_eos: bool = False
    # sampling
    temperature: float = 0.0
    seed: int = 0
    sampling_rule: str = "coupled"     # coupled (reproducible in async, equals ar's sample) | residual
    dtype: str = "float32"
    # tree shape (SwiftSpec's bs = w = 8; here bs is chosen by a startup profile unless given)
    tree_width: int | None = None      # w: leaves expanded per draft forward (None: = bs)
    tree_topk: int = 8                 # children added per expanded leaf
    verify_size: int | None = None     # bs: nodes (incl. root) per target pass (None: from profile)
    expansions: int | None = None      # d: draft expansions per verify step (sync; async: paces the draft); None = from profile
    max_depth: int = 16
    tree_capacity: int = 1024
    max_context: int | None = None     # KV slots per model; default prompt + new tokens + tree margin
    # output and robustness
    out: str | None = None
    overwrite: bool = False
    peer_timeout: float = 30.0         # seconds a blocking receive waits for a peer before failing
    quiet: bool = False                # do not stream text to stdout
    requests: list[Request] = field(default_factory=list)  # filled by validation
    auto_split: bool = False           # --draft-ranks auto: draft ranks, bs and w chosen at start (cli/plan.py)
    accept_sha256: str | None = None   # filled by validation: the sha256 of the --accept-from file
    accept_model: dict | None = None   # filled by validation: the model replayed (trace/acceptance.py)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("requests")
        return json.dumps(d, sort_keys=True)


# tree sizes the startup profile chooses from (bs = w): the one with the most expected committed
# tokens per second of target time, expected tokens of an n-node tree taken as a chain with
# per-token acceptance ACCEPT_PRIOR (the real Qwen pair's draft agrees with its target 83 % of
# the time); n > 1 only, so speculation always happens
TREE_SIZES = (2, 4, 8, 16)
ACCEPT_PRIOR = 0.8


def max_verify_size(cfg: "RunConfig") -> int:
    return cfg.verify_size or max(TREE_SIZES)


def max_tree_width(cfg: "RunConfig") -> int:
    return cfg.tree_width or cfg.verify_size or max(TREE_SIZES)


def expected_tokens(n: int, alpha: float = ACCEPT_PRIOR) -> float:
    return sum(alpha ** i for i in range(n))


def choose_tree_size(target_times: dict[int, float], tokens: dict[int, float] | None = None) -> int:
    """The n with the best expected tokens per target second (ties: the smaller n); `tokens`
    gives the expected tokens of an n-node tree (an acceptance model's, when one is replayed),
    else the chain with ACCEPT_PRIOR."""
    return max(sorted(target_times), key=lambda n: (tokens[n] if tokens else expected_tokens(n)) / target_times[n])


# TOML keys are the `swiftspec run` flag names (dashes or underscores). Flags named otherwise
# than the RunConfig field they set (flag name with underscores -> field):
RENAMED_FLAGS = {"stop_token_id": "stop_token_ids"}
_TOML_KINDS = {"str": ((str,), "a string"), "int": ((int,), "an integer"),
               "float": ((int, float), "a number"), "bool": ((bool,), "true or false")}


def _toml_value(path: str, key: str, name: str, value):
    """`value` checked against RunConfig field `name`'s type; a repeatable flag's key (a list
    field) also takes one value. Raises UserError naming the key and the type it wants."""
    kind = RunConfig.__dataclass_fields__[name].type.replace(" | None", "")
    many = kind.startswith("list[")
    kind = kind[5:-1] if many else kind
    types, what = _TOML_KINDS[kind]
    items = value if many and isinstance(value, list) else [value]
    if not all(isinstance(v, types) and (kind == "bool" or not isinstance(v, bool)) for v in items):
        want = f"{what} or a list of them" if many else what
        raise UserError(f"config file {path}: '{key}' must be {want}, got {value!r}")
    return items if many else value


def load_toml(path: str) -> dict:
    """A TOML file of `swiftspec run` options -> {RunConfig field: value}. Keys are the flag
    names without the dashes (`max-new-tokens`, `stop-token-id`; `_` for `-` works too)."""
    import tomllib
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {path} does not exist; pass an existing TOML file to --config")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML ({exc}); fix the syntax") from None
    fields = {f.name for f in dataclasses.fields(RunConfig)} - {"requests", "accept_sha256", "accept_model",
                                                                 "auto_split"}
    flags = {name: name for name in fields - set(RENAMED_FLAGS.values())} | RENAMED_FLAGS
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in flags:
            known = ", ".join(sorted(k.replace("_", "-") for k in flags))
            raise UserError(f"config file {path}: unknown key '{key}'; the keys are the flag "
                            f"names: {known}")
        out[flags[name]] = _toml_value(path, key, flags[name], value)
    return out


def merge(toml_values: dict, flag_values: dict) -> RunConfig:
    """Flags that were given (not None) win over the TOML file, which wins over defaults."""
    values = dict(toml_values)
    values.update({k: v for k, v in flag_values.items() if v is not None})
    return RunConfig(**values)


def read_prompts_file(path: str) -> list[Request]:
    """JSONL: one object a line, {"prompt": TEXT} or Spec-Bench's {"turns": [...], "category": ...}.

    Multi-turn Spec-Bench entries use their first turn (each line is one single request)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"prompts file {path} does not exist; pass a JSONL file with one "
                        '{"prompt": "..."} object per line')
    requests = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one "
                                'JSON object like {"prompt": "..."}') from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            if isinstance(obj.get("prompt"), str):
                text = obj["prompt"]
            elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
                text = obj["turns"][0]
            else:
                raise UserError(f"{path}:{lineno}: needs a string field \"prompt\" or a non-empty "
                                "list of strings \"turns\"")
            if not text:
                raise UserError(f"{path}:{lineno}: the prompt is empty")
            requests.append(Request(len(requests), text, str(obj.get("category", "")),
                                    question_id=obj.get("question_id", lineno)))
    if not requests:
        raise UserError(f"prompts file {path} holds no prompts")
    return requests


def default_draft_ranks(world_size: int) -> int:
    """The draft model is small: one rank up to 4, then a quarter of the ranks (SwiftSpec used
    1-2 of 8 GPUs for the draft)."""
    return 1 if world_size <= 4 else world_size // 4


def validate_basic(cfg: RunConfig, world_size: int) -> RunConfig:
    """Checks that need no files. Raises UserError with the fix."""
    if cfg.mode not in MODES:
        raise UserError(f"unknown mode '{cfg.mode}'; use --mode async, sync or ar")
    if cfg.dtype not in DTYPES:
        raise UserError(f"unknown dtype '{cfg.dtype}'; use --dtype float32 or bfloat16")
    if cfg.sampling_rule not in ("coupled", "residual"):
        raise UserError(f"unknown sampling rule '{cfg.sampling_rule}'; use coupled or residual")
    if cfg.load_format not in ("auto", "dummy"):
        raise UserError(f"unknown load format '{cfg.load_format}'; use auto or dummy")
    if cfg.quant not in QUANTS:
        raise UserError(f"unknown --quant '{cfg.quant}'; use {', '.join(QUANTS)}")
    if cfg.head_bits not in (16, 4):
        raise UserError(f"--head-bits must be 16 or 4, got {cfg.head_bits}")
    if cfg.step_kernel not in STEP_KERNELS:
        raise UserError(f"unknown --step-kernel '{cfg.step_kernel}'; use {', '.join(STEP_KERNELS)}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown device '{cfg.device}'; use auto, cpu or cuda")
    positive = {"max_new_tokens": cfg.max_new_tokens, "tree_topk": cfg.tree_topk,
                "max_depth": cfg.max_depth, "tree_capacity": cfg.tree_capacity}
    for name, value in positive.items():
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("expansions", "threads", "draft_layers", "max_context", "tree_width", "verify_size"):
        value = getattr(cfg, name)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if not (cfg.temperature >= 0.0) or cfg.temperature != cfg.temperature:
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {cfg.temperature}")
    if cfg.peer_timeout <= 0:
        raise UserError(f"--peer-timeout must be positive seconds, got {cfg.peer_timeout}")
    if cfg.tree_capacity < 1 + max_tree_width(cfg) * cfg.tree_topk:
        raise UserError(f"--tree-capacity {cfg.tree_capacity} cannot hold one expansion "
                        f"({max_tree_width(cfg)}x{cfg.tree_topk} children); raise it")
    if max_verify_size(cfg) > cfg.tree_capacity:
        raise UserError("--verify-size cannot exceed --tree-capacity")
    if max_verify_size(cfg) > 64:
        raise UserError(f"--verify-size {cfg.verify_size} is above 64, the most the fused tree "
                        "attention takes; use at most 64")
    if world_size < 1:
        raise UserError("world size must be >= 1")
    if cfg.accept_from is not None:
        if cfg.load_format != "dummy":
            raise UserError("--accept-from replays acceptance on random weights: add --load-format dummy "
                            "(with real weights the target itself decides what it accepts)")
        if cfg.mode == "ar":
            raise UserError("--accept-from needs a draft: use --mode sync or async (`ar` verifies no tree)")
        if cfg.temperature != 0.0:
            raise UserError("--accept-from draws the target's choices from the model; drop --temperature")
    if cfg.mode == "async":
        if world_size < 2:
            raise UserError("--mode async needs at least 2 MPI ranks (one draft, one verify); "
                            "launch with mpiexec -n 2 or more, or use --mode sync / ar on 1 rank")
        if cfg.draft_ranks == "auto":     # provisional, for the checks; the job's start picks it
            cfg.auto_split, cfg.draft_ranks = True, default_draft_ranks(world_size)
        if cfg.draft_ranks is None:
            cfg.draft_ranks = default_draft_ranks(world_size)
        if not isinstance(cfg.draft_ranks, int) or cfg.draft_ranks < 1:
            raise UserError(f"--draft-ranks must be >= 1 in async mode, got {cfg.draft_ranks}")
        if cfg.draft_ranks >= world_size:
            raise UserError(f"--draft-ranks {cfg.draft_ranks} leaves no verify rank in a world of "
                            f"{world_size}; use at most {world_size - 1}")
        if cfg.async_policy is None:
            cfg.async_policy = DEFAULT_ASYNC_POLICY
        if cfg.async_policy not in ASYNC_POLICIES:
            raise UserError(f"unknown async policy '{cfg.async_policy}'; use --async-policy "
                            f"{', '.join(ASYNC_POLICIES)}")
        if cfg.floor_depth is not None and cfg.async_policy != "rate":
            raise UserError(f"--floor-depth applies to --async-policy rate; drop it for {cfg.async_policy}")
        if cfg.floor_depth is None and cfg.async_policy == "rate":
            cfg.floor_depth = DEFAULT_FLOOR_DEPTH
        if cfg.floor_depth is not None and (not isinstance(cfg.floor_depth, int) or cfg.floor_depth < 1):
            raise UserError(f"--floor-depth must be an integer >= 1, got {cfg.floor_depth}")
    else:
        if cfg.async_policy is not None:
            raise UserError(f"--async-policy applies to --mode async only; drop it for --mode {cfg.mode}")
        if cfg.floor_depth is not None:
            raise UserError(f"--floor-depth applies to --mode async only; drop it for --mode {cfg.mode}")
        if cfg.draft_ranks not in (None, 0):
            raise UserError(f"--draft-ranks applies to --mode async only; drop it for --mode {cfg.mode} "
                            "(swiftspec plan weighs sync too)")
        cfg.draft_ranks = 0
    if cfg.prompt is not None and cfg.prompts is not None:
        raise UserError("give either --prompt or --prompts, not both")
    if cfg.interactive and (cfg.prompt is not None or cfg.prompts is not None):
        raise UserError("--interactive reads the prompts from standard input; drop --prompt / --prompts")
    if cfg.serve is not None:
        if cfg.interactive or cfg.prompt is not None or cfg.prompts is not None:
            raise UserError("--serve takes its prompts from HTTP requests; drop --interactive / --prompt / --prompts")
        parse_serve_address(cfg.serve)
    if not isinstance(cfg.serve_max_body, int) or cfg.serve_max_body < 1024:
        raise UserError(f"--serve-max-body must be at least 1024 bytes, got {cfg.serve_max_body}")
    if not cfg.serve_read_timeout > 0:
        raise UserError(f"--serve-read-timeout must be positive seconds, got {cfg.serve_read_timeout}")
    if not isinstance(cfg.serve_max_queue, int) or cfg.serve_max_queue < 0:
        raise UserError(f"--serve-max-queue must be a count >= 0, got {cfg.serve_max_queue}")
    if not isinstance(cfg.serve_max_idle, int) or cfg.serve_max_idle < 1:
        raise UserError(f"--serve-max-idle must be a count >= 1, got {cfg.serve_max_idle}")
    if cfg.trace_rotate is not None and not requests_stream_in(cfg):
        raise UserError("--trace-rotate applies to --serve and --interactive (a job of unknown length); "
                        "drop it for a --prompt / --prompts run")
    parse_trace_rotate(cfg.trace_rotate if cfg.trace_rotate is not None else DEFAULT_TRACE_ROTATE)
    if cfg.prompt is not None and not cfg.prompt:
        raise UserError("--prompt is empty; give some text")
    return cfg


def parse_serve_address(spec: str) -> tuple[str, int]:
    """--serve "[HOST:]PORT" -> (host, port); host 127.0.0.1 when not given, port 0 = any free one."""
    host, _, port = str(spec).rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        p = -1
    if not 0 <= p <= 65535:
        raise UserError(f"--serve {spec!r}: give [HOST:]PORT, e.g. --serve 8000 or --serve 0.0.0.0:8000")
    return host, p


SHUTDOWN_S = 20.0          # a signalled run: every rank out within this (the HTTP answers, the gather, the write)
DEFAULT_TRACE_ROTATE = "500"    # --serve / --interactive: a new trace file every 500 requests


def parse_trace_rotate(spec) -> tuple[int | None, float | None]:
    """--trace-rotate -> (requests per file or None, seconds per file or None); (None, None): one
    file. Forms: "N" (requests), "Tm" / "Th" (minutes / hours), "N,Tm" (whichever comes first),
    "0" (one file for the whole job)."""
    text = str(spec).strip().lower()
    if text in ("0", "off"):
        return None, None
    count = seconds = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            if part[-1] in "mh":
                value = float(part[:-1]) * (60.0 if part[-1] == "m" else 3600.0)
                ok = seconds is None and value > 0
                seconds = value
            else:
                ok = count is None and int(part) > 0
                count = int(part)
        except ValueError:
            ok = False
        if not ok:
            raise UserError(f"--trace-rotate {spec!r}: give N requests, T minutes (e.g. 30m) or hours "
                            "(e.g. 6h), both as N,Tm, or 0 for one file")
    if count is None and seconds is None:
        raise UserError(f"--trace-rotate {spec!r}: give N requests, T minutes (e.g. 30m), or 0 for one file")
    return count, seconds


def segment_path(out: str, k: int) -> str:
    """The trace file of segment k: --out itself for k = 0, then STEM.k.h5 (run.h5, run.1.h5, ...)."""
    if k == 0:
        return out
    stem, ext = os.path.splitext(out)
    return f"{stem}.{k}{ext or '.h5'}"


def requests_stream_in(cfg: "RunConfig") -> bool:
    """The prompts arrive while the job runs (--interactive, --serve), not all known at the start."""
    return bool(cfg.interactive) or cfg.serve is not None


def check_output_path_default(cfg: RunConfig) -> None:
    """Default --out: runs/swiftspec-<SLURM_JOB_ID or local time>.h5."""
    if cfg.out is None:
        tag = os.environ.get("SLURM_JOB_ID") or __import__("time").strftime("%Y%m%d-%H%M%S")
        cfg.out = f"runs/swiftspec-{tag}.h5"


def stale_segments(out: str) -> list[Path]:
    """Files STEM.<k>.h5 beside --out: the later segments of an earlier rotated trace."""
    stem, ext = os.path.splitext(os.path.basename(out))
    folder = Path(out).parent
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"{glob_escape(stem)}.*{glob_escape(ext or '.h5')}")
                  if p.name[len(stem) + 1:len(p.name) - len(ext or ".h5")].isdigit())


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def check_output_path(cfg: RunConfig) -> None:
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise UserError(f"output file {out} already exists; pass --overwrite or choose another --out")
    stale = stale_segments(cfg.out) if requests_stream_in(cfg) else []
    if stale and not cfg.overwrite:
        raise UserError(f"{stale[0]} (a segment of an earlier trace at {out}) already exists; pass "
                        "--overwrite or choose another --out")
    for p in stale:     # --overwrite: the earlier trace's later files go with it
        p.unlink(missing_ok=True)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = exc.strerror
        if isinstance(exc, FileExistsError):   # a file where a folder of the path should be
            why = f"{exc.filename} is a file, not a folder"
        raise UserError(f"cannot create the folder of --out {out} ({why}); choose a writable path") from None
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file name like {out}/run.h5")
    if not os.access(parent, os.W_OK):
        raise UserError(f"cannot write --out {out}: folder {parent} is not writable; choose a writable path")
    # os.access says yes to root on a read-only folder (/proc, a read-only bind mount, a full
    # quota...): the trace is written as PATH.tmp.<pid> then renamed, so really create one now,
    # rather than find out after the whole generation ran
    probe = parent / f".{out.name}.probe.{os.getpid()}"
    try:
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"cannot write --out {out}: creating a file in {parent} fails "
                        f"({exc.strerror}); choose a writable path") from None


def check_slurm_world(world_size: int) -> None:
    """A PMI mismatch under srun silently starts N singleton jobs of world size 1.

    Only that symptom is refused: `mpiexec` inside an allocation legitimately runs in a
    one-task step (MPICH starts its proxies through srun), so SLURM_NTASKS=1 with a larger
    world is fine."""
    ntasks = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_NPROCS")
    if ntasks is None or os.environ.get("SLURM_JOB_ID") is None:
        return
    if os.environ.get("SLURM_STEP_ID") is None:
        return  # in the batch script itself (not a step): mpiexec sets the world
    try:
        n = int(ntasks)
    except ValueError:
        return
    if world_size == 1 and n > 1:
        raise UserError(f"MPI world size is {world_size} but Slurm started {n} tasks: srun and the "
                        "MPI library disagree on PMI. Use srun --mpi=pmi2 for MPICH (the mpich wheel) "
                        "or --mpi=pmix for Open MPI, or launch with mpiexec inside the allocation")
