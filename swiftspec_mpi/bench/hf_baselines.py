"""Reference baselines for `swiftspec bench`: HF transformers greedy `generate` ("hf-greedy") and
HF assisted generation with the draft as `assistant_model` ("hf-assisted"), run in-process on
the same HF folders, dtype, threads and prompt token ids as our modes.

Each system writes one HDF5 trace in the schema of docs/trace-format.md (through
`swiftspec_mpi.trace.record.write_trace`, after every request, `complete=False` until the end) with
mode "hf-greedy" / "hf-assisted", the requests and their steps, and an empty `/events` table.

How steps and times are measured (no guessing from totals):
- a forward pre/post hook on the target model times every target forward and records how many
  tokens it was fed; a streamer records when each batch of tokens was committed, and how many;
- hf-greedy: the first target forward is the prefill (its token is the time to first token);
  every later forward is one decode step (`tree_size` 1, `accepted` 1);
- hf-assisted: every target forward checks the assistant's candidates (the first one together
  with the prompt), so every forward is one verify step; `tree_size` = candidates + 1 (the root)
  and `accepted` = tokens committed (accepted candidates + the target's bonus token);
- step times are the target forward's start and end on the job clock (t = 0 when the system
  starts); `seconds` runs from the call to `generate` to its return (prompt ids in, ids out).
Prompt ids come from our own trace when bench has one, else from the engine's tokenizer
(`swiftspec_mpi.checkpoints.tokenizer.TextTokenizer`: same ids, chat template and EOS set as `swiftspec run`);
generation stops at that same EOS set.
A short untimed warm-up generation runs before the first request (one-off lazy inits).
The models' own generation_config.json (sampling defaults, repetition penalty...) is replaced
by a neutral one, so greedy means argmax of the raw logits, as in our engine.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field

from swiftspec_mpi.core.errors import UserError, one_line
from swiftspec_mpi.trace.record import step_row

HF_SYSTEMS = ("hf-greedy", "hf-assisted")
WARMUP_TOKENS = 2


@dataclass
class Prompt:
    index: int
    text: str
    category: str = ""
    prompt_ids: list[int] | None = None   # use these ids as-is (e.g. taken from the `ar` trace)


@dataclass
class HfResult:
    system: str
    path: str
    status: str = "failed"   # ok | partial | failed
    error: str = ""
    done: int = 0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)


def torch_dtype(name: str):
    import torch
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise UserError(f"unknown dtype '{name}'; use float32 or bfloat16")
    return table[name]


def load_model(folder: str, dtype: str):
    """AutoModelForCausalLM from an HF folder, eval mode, neutral generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise UserError(f"{folder} is not a Hugging Face model folder (no config.json); the HF baselines "
                        "need HF folders: pass --target/--draft folders with config.json + *.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype(dtype))
    model.eval()
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    eos_list = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)])
    bos = model.generation_config.bos_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=eos_list or None, bos_token_id=bos,
        pad_token_id=eos_list[0] if eos_list else None)
    return model, eos_list


def load_tokenizer(folder: str):
    """The engine's own TextTokenizer (same ids, chat template and EOS set as `swiftspec run`);
    without it, transformers' PreTrainedTokenizerFast over tokenizer.json (not AutoTokenizer:
    for some model types it rebuilds the pre-tokenizer and splits text differently)."""
    try:
        from swiftspec_mpi.checkpoints.tokenizer import TextTokenizer
    except ImportError:
        TextTokenizer = None
    if TextTokenizer is not None:
        return TextTokenizer.from_hf_folder(folder)
    from transformers import PreTrainedTokenizerFast
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise UserError(f"{folder} has no tokenizer.json; add the model's fast-tokenizer file")
    tok = PreTrainedTokenizerFast(tokenizer_file=path)
    template = None
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError):
        pass
    jinja = os.path.join(folder, "chat_template.jinja")
    if not template and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if template:
        tok.chat_template = template
    return tok


def _is_engine_tokenizer(tok) -> bool:
    return type(tok).__module__ == "swiftspec_mpi.checkpoints.tokenizer"


def tokenizer_eos(tok) -> list[int]:
    """The engine's EOS set ([] for an HF tokenizer: then the model's generation config decides)."""
    return [int(i) for i in tok.eos_token_ids] if _is_engine_tokenizer(tok) else []


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    if _is_engine_tokenizer(tokenizer):
        if chat and not tokenizer.chat_template:
            raise UserError("--chat was given but the target has no chat template; drop --chat or add "
                            "chat_template to its tokenizer_config.json")
        return [int(i) for i in tokenizer.encode(tokenizer.apply_chat_template(text) if chat else text)]
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("--chat was given but the target has no chat template; drop --chat or add "
                            "chat_template to its tokenizer_config.json")
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [int(i) for i in tokenizer(text)["input_ids"]]


class _Recorder:
    """Times target forwards (hooks) and token commits (streamer protocol: put/end)."""

    def __init__(self, model, clock):
        self.clock = clock
        self.forwards: list[list] = []   # [t_start, t_end, n_input_tokens]
        self.puts: list[tuple] = []      # (t, n_tokens), the prompt put excluded
        self._seen_prompt = False
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post)]

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = int(ids.shape[-1]) if ids is not None else -1
        self.forwards.append([self.clock(), float("nan"), n])

    def _post(self, module, args, output):
        if self.forwards:
            self.forwards[-1][1] = self.clock()

    def put(self, value):
        t = self.clock()
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.puts.append((t, int(value.numel())))

    def end(self):
        pass

    def reset(self):
        self.forwards, self.puts, self._seen_prompt = [], [], False

    def remove(self):
        for h in self._handles:
            h.remove()


def _steps(system: str, rec: _Recorder, prompt_len: int) -> list[tuple]:
    """The request's `steps` rows (trace.record.step_row: step, tree_size, accepted, t_start,
    t_end; no tree source); see the module doc."""
    fw, puts = rec.forwards, rec.puts
    rows = []
    if system == "hf-greedy":
        aligned = len(fw) == len(puts)
        for i in range(1, len(puts)):
            t0, t1 = (fw[i][0], fw[i][1]) if aligned else (puts[i - 1][0], puts[i][0])
            rows.append(step_row(i - 1, 1, puts[i][1], t0, t1))
    else:
        aligned = len(fw) == len(puts)
        for i in range(len(puts)):
            if aligned:
                n_in = fw[i][2]
                tree = n_in - prompt_len + 1 if i == 0 else n_in
                t0, t1 = fw[i][0], fw[i][1]
            else:  # a transformers change broke the 1:1 forward/commit pairing: keep the commits
                tree = -1
                t0, t1 = (puts[i - 1][0] if i else float("nan")), puts[i][0]
            rows.append(step_row(i, tree, puts[i][1], t0, t1))
    return rows


def generate_one(model, prompt_ids: list[int], *, system: str, max_new_tokens: int, temperature: float,
                 seed: int, assistant=None, recorder: _Recorder) -> dict:
    import torch

    ids = torch.tensor([prompt_ids], dtype=torch.long)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                  attention_mask=torch.ones_like(ids))
    if temperature > 0:
        kwargs.update(temperature=float(temperature), top_k=0, top_p=1.0)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    torch.manual_seed(seed)
    recorder.reset()
    t_start = recorder.clock()
    with torch.inference_mode():
        out = model.generate(ids, streamer=recorder, **kwargs)
    t_end = recorder.clock()
    new = [int(t) for t in out[0, len(prompt_ids):].tolist()]
    return {"output_ids": new, "t_start": t_start, "t_end": t_end,
            "t_first": recorder.puts[0][0] if recorder.puts else None,
            "steps": _steps(system, recorder, len(prompt_ids))}


def _env(threads: int | None) -> dict:
    import torch
    import transformers
    return {"world_size": 1, "verify_size": 1, "draft_size": 0, "hosts": [socket.gethostname()],
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "threads_requested": threads, "device": "cpu", "platform": platform.platform()}


def run_systems(systems: list[str], *, target: str, draft: str, prompts: list[Prompt], out_dir: str,
                dtype: str = "float32", threads: int | None = None, max_new_tokens: int = 128,
                temperature: float = 0.0, seed: int = 0, chat: bool = False,
                progress=None) -> list[HfResult]:
    """Run each HF system over `prompts`; write OUT_DIR/<system>.h5. Never raises for a failing
    system: its HfResult says failed/partial with the error. `progress(n)` is called per request."""
    import numpy as np
    import torch

    from swiftspec_mpi.trace.record import EVENT_DTYPE, RANK_DTYPE, RequestResult, write_trace

    for s in systems:
        if s not in HF_SYSTEMS:
            raise UserError(f"unknown HF system '{s}'; use {', '.join(HF_SYSTEMS)}")
    results = [HfResult(s, os.path.join(out_dir, f"{s}.h5")) for s in systems]
    if not systems:
        return results
    if threads:
        torch.set_num_threads(int(threads))
    import transformers
    transformers.logging.set_verbosity_error()   # our progress bar, not theirs
    transformers.utils.logging.disable_progress_bar()
    try:
        target_model, eos = load_model(target, dtype)
        tokenizer = load_tokenizer(target)
        if tokenizer_eos(tokenizer):  # stop exactly where the engine stops
            eos = tokenizer_eos(tokenizer)
            target_model.generation_config.eos_token_id = eos
            target_model.generation_config.pad_token_id = eos[0]
        encoded = {p.index: (list(p.prompt_ids) if p.prompt_ids is not None else encode(tokenizer, p.text, chat))
                   for p in prompts}
        draft_model = load_model(draft, dtype)[0] if "hf-assisted" in systems else None
    except Exception as exc:  # loading failed: every system fails with the same reason
        for r in results:
            r.error = _one_line(exc)
        return results

    ranks = np.array([(0, 0, 0, 1, socket.gethostname().encode()[:64], b"cpu", 0, 0)], dtype=RANK_DTYPE)
    events = np.zeros(0, dtype=EVENT_DTYPE)
    for res in results:
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0  # noqa: E731
        recorder = _Recorder(target_model, clock)
        assistant = draft_model if res.system == "hf-assisted" else None
        config = {"mode": res.system, "target": target, "draft": draft if assistant is not None else None,
                  "dtype": dtype, "threads": threads, "max_new_tokens": max_new_tokens,
                  "temperature": temperature, "seed": seed, "chat": chat, "eos_token_ids": eos,
                  "warmup_tokens": WARMUP_TOKENS, "prompt_ids_from": sorted({
                      "trace" if p.prompt_ids is not None else "hf-tokenizer" for p in prompts})}
        if assistant is not None:
            gc = assistant.generation_config
            config["assistant"] = {k: getattr(gc, k, None) for k in (
                "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")}
            config["assistant"]["defaults"] = "transformers defaults where None (20, constant, 0.4)"
        done: list = []
        env = _env(threads)

        def save(complete: bool, status: str):
            write_trace(res.path, mode=res.system, config_json=json.dumps(config, sort_keys=True, default=str),
                        env=env, requests=done, events=events, ranks=ranks, complete=complete,
                        exit_status=status)
        try:
            if prompts:  # untimed warm-up
                generate_one(target_model, encoded[prompts[0].index], system=res.system,
                             max_new_tokens=WARMUP_TOKENS, temperature=0.0, seed=seed, assistant=assistant,
                             recorder=recorder)
            for p in prompts:
                ids = encoded[p.index]
                g = generate_one(target_model, ids, system=res.system, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed + p.index, assistant=assistant,
                                 recorder=recorder)
                out = g["output_ids"]
                stop = "eos" if out and out[-1] in eos else "max_new_tokens"
                text = tokenizer.decode(out, skip_special_tokens=True)
                done.append(RequestResult(index=p.index, category=p.category, prompt_text=p.text,
                                          prompt_ids=ids, output_ids=out, text=text, t_start=g["t_start"],
                                          t_first=g["t_first"], t_end=g["t_end"], stop_reason=stop,
                                          steps=g["steps"]))
                save(False, "running")
                if progress is not None:
                    progress(1)
            save(True, "ok")
            res.status = "ok"
        except KeyboardInterrupt:
            res.status, res.error = ("partial" if done else "failed"), "interrupted"
            _try(save, False, "interrupted")
            recorder.remove()
            res.done, res.wall_s = len(done), time.perf_counter() - t0
            raise
        except Exception as exc:
            res.status = "partial" if done else "failed"
            res.error = _one_line(exc)
            _try(save, False, f"error: {res.error}")
        finally:
            recorder.remove()
        res.done, res.wall_s = len(done), time.perf_counter() - t0
    return results


def _try(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # the trace of a failing system is best effort
        print(f"swiftspec bench: could not write the partial trace ({_one_line(exc)})", file=sys.stderr)


def _one_line(exc: BaseException) -> str:
    """An exception as one short line: its type and its message (errors.one_line), 300 chars at most."""
    return f"{type(exc).__name__}: {one_line(exc)}"[:300]
