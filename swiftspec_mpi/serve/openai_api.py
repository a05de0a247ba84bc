"""The OpenAI request and response shapes of `--serve`: a JSON body checked into a `Ask` (or an
ApiError in OpenAI's error shape), and the response bodies, chunks and log-probabilities built
from what the engine returns. No sockets here (http_handler.py moves the bytes).

What a request may hold (anything else is ignored, as most OpenAI-style servers do):

    model            optional; the served id (GET /v1/models), the --target value as given, or
                     "swiftspec"; another name: 404 model_not_found
    prompt           /v1/completions: a non-empty string (or a list of exactly one)
    messages         /v1/chat/completions: roles system, developer (as system), user, assistant;
                     content a string, a list of text parts (joined with newlines; any other part
                     type: 400), or null in an assistant message (an empty turn)
    max_tokens       1 .. --max-new-tokens (or max_completion_tokens); default --max-new-tokens
    stop             a string or a list of non-empty strings
    stream           server-sent events; stream_options.include_usage adds a last chunk with usage
    n                1 .. MAX_N answers, decoded one after another (each its own request)
    logprobs         the target's log-probabilities of the answer's tokens (chat: true, with
                     top_logprobs 0..20 alternatives; completions: an integer 0..5)
    temperature, seed, top_p, frequency_penalty, presence_penalty, logit_bias: the run's own
                     values (--temperature, --seed; 1, 0, 0, {}) or left out; any other: 400
                     (the decode graphs and the coupled sampling are built for the run's)
    tools, functions, response_format other than text, echo, suffix, best_of > n: 400
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_N = 8                # answers a request may ask for (n), each a full decode
MAX_DEPTH = 32           # nesting of a request body's JSON (a real request needs 4)
TOP_LOGPROBS_MAX = {"chat": 20, "text": 5}
FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "interrupted": "interrupted",
          "cancelled": "cancelled", "error": "error"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 etype: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.etype, self.code = status, message, param, etype, code
        self.headers = headers or {}     # extra response headers (429: Retry-After)

    def body(self) -> dict:
        return error_body(self.message, self.etype, self.param, self.code)


def error_body(message: str, etype: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


@dataclass
class Ask:
    """A checked request: one prompt, decoded `n` times."""
    kind: str                    # "text" (/v1/completions) | "chat"
    shown: str                   # the prompt as the trace shows it (the last message in a chat)
    ids: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: int | None = None  # alternatives per token, None: no log-probabilities


def parse_body(raw: bytes):
    """Request bytes -> the JSON value; 400 for what is not JSON, nested deeper than MAX_DEPTH,
    or holds a string that is not Unicode text (a lone surrogate escape such as \\ud800)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON ({exc})") from None
    check_strings(body)
    return body


def check_strings(body) -> None:
    """Walk the JSON value (no recursion): depth at most MAX_DEPTH, every string (keys too)
    encodable as UTF-8. Raises ApiError naming the place (its `param`)."""
    todo = [(body, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body is nested too deeply (at most {MAX_DEPTH} levels)", where or None)
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, where)
                todo.append((v, f"{where}.{k}" if where else k, depth + 1))
        elif isinstance(value, list):
            todo.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{where or 'the body'} holds an invalid Unicode character "
                       f"({exc.object[exc.start]!r}, a lone surrogate); send UTF-8 text",
                       where or None) from None


def _int(body: dict, name: str, lo: int, hi: int, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ApiError(400, f'"{name}" must be an integer in {lo}..{hi}', name)
    return v


def _same_as_run(body: dict, name: str, run_value, what: str) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f'"{name}" must be a number', name)
    if v != run_value:
        raise ApiError(400, f'this server decodes with {name} {run_value:g} ({what}); the decode graphs '
                       f'and its reproducible sampling are built for it. Leave "{name}" out or send '
                       f'{run_value:g} (start another server for another value)', name, code="unsupported_value")


def check_model(body: dict, names: tuple[str, ...]) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, '"model" must be a string', "model")
    if model not in names:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves {names[0]!r} "
                       f"(also reachable as {', '.join(repr(n) for n in names[1:])})", "model",
                       code="model_not_found")


def _content(m: dict, i: int) -> str:
    """A message's text: a string, text parts joined with newlines, or "" for an assistant's null."""
    c = m.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if m.get("tool_calls") or m.get("function_call"):
            raise ApiError(400, f"messages[{i}] holds tool calls; this server has no tools", f"messages[{i}].tool_calls")
        if m["role"] != "assistant":
            raise ApiError(400, f"{where} may be null only in an assistant message", where)
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}[{j}] is a {kind!r} part; this server reads text only "
                               '({"type": "text", "text": "..."})', f"{where}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(400, f"{where} must be a string, a list of text parts or null", where)


def chat_text(body: dict, tokenizer) -> tuple[str, str]:
    """The prompt text of a chat body through the target's chat template, and its last message."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, '"messages" must be a non-empty list of {"role": ..., "content": ...}', "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a role: one of {', '.join(ROLES)}", f"messages[{i}].role")
        if m.get("tool_calls") or m.get("function_call"):
            raise ApiError(400, f"messages[{i}] holds tool calls; this server has no tools", f"messages[{i}].tool_calls")
        turns.append({"role": ROLES[m["role"]], "content": _content(m, i)})
    try:
        text = tokenizer.render_conversation(turns)
    except Exception as exc:  # noqa: BLE001 - a template's raise_exception, or any render error
        raise ApiError(400, f"the model's chat template refused these messages ({exc})", "messages") from None
    return text, turns[-1]["content"]


def parse_ask(kind: str, body, tokenizer, room: int, max_new: int, run: dict,
              names: tuple[str, ...]) -> Ask:
    """Validate an OpenAI-style body -> Ask, or raise ApiError with the fix. `run`: the run's
    temperature and seed; `names`: the model ids this server answers to."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    check_model(body, names)
    for name in ("tools", "functions"):
        if body.get(name):
            raise ApiError(400, f'"{name}": this server has no tool calling', name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ApiError(400, '"response_format": only {"type": "text"} (no JSON mode)', "response_format")
    if kind == "chat":
        text, shown = chat_text(body, tokenizer)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, '"prompt" must be a non-empty string (one prompt a request)', "prompt")
        if body.get("echo"):
            raise ApiError(400, '"echo" is not supported', "echo")
        if body.get("suffix"):
            raise ApiError(400, '"suffix" (fill in the middle) is not supported', "suffix")
        text = shown = prompt
    _same_as_run(body, "temperature", run["temperature"], "its --temperature")
    _same_as_run(body, "seed", run["seed"], "its --seed")
    _same_as_run(body, "top_p", 1.0, "no nucleus cut")
    _same_as_run(body, "frequency_penalty", 0.0, "no penalties")
    _same_as_run(body, "presence_penalty", 0.0, "no penalties")
    if body.get("logit_bias"):
        raise ApiError(400, '"logit_bias" is not supported (the target\'s distribution is sampled as it is)',
                       "logit_bias")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = max_new
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= max_new:
        raise ApiError(400, f'"max_tokens" must be an integer in 1..{max_new} (the server\'s --max-new-tokens)',
                       "max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, '"stop" must be a string or a list of non-empty strings', "stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, '"stream" must be true or false', "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError(400, '"stream_options" is allowed only with "stream": true', "stream_options")
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise ApiError(400, '"stream_options" must be {"include_usage": true | false}', "stream_options")
        include_usage = bool(opts.get("include_usage", False))
    n = _int(body, "n", 1, MAX_N, 1)
    if body.get("best_of") is not None and _int(body, "best_of", 1, MAX_N, 1) != n:
        raise ApiError(400, '"best_of" is not supported (send n)', "best_of")
    logprobs = _logprobs(kind, body)
    where = "messages" if kind == "chat" else "prompt"
    longest = max_token_bytes(tokenizer)
    if longest and len(text.encode("utf-8")) > room * longest:      # too long without tokenizing it
        raise ApiError(400, f"the prompt has {len(text.encode('utf-8'))} bytes, more than the {room} tokens "
                       f"this server has room for can hold (start it with a larger --max-context)", where,
                       code="context_length_exceeded")
    try:
        ids = tokenizer.encode(text)
    except Exception as exc:  # noqa: BLE001 - the checks above should leave nothing to fail here
        raise ApiError(400, f"the prompt cannot be tokenized ({type(exc).__name__})") from None
    if not ids:
        raise ApiError(400, "the prompt tokenizes to nothing", where)
    if len(ids) > room:
        raise ApiError(400, f"the prompt has {len(ids)} tokens and this server has room for {room} "
                       "(start it with a larger --max-context)", where, code="context_length_exceeded")
    return Ask(kind, shown, ids, max_tokens, stop, stream, include_usage, n, logprobs)


def max_token_bytes(tokenizer) -> int | None:
    """The UTF-8 length of the vocabulary's longest token string, a bound on the bytes of text
    one token covers (a byte-level BPE string spends at least one byte a byte, SentencePiece's
    '\u2581' three for a space); cached on the tokenizer. None when it has no vocabulary to read."""
    cached = getattr(tokenizer, "_max_token_bytes", None)
    if cached is None:
        vocab = getattr(getattr(tokenizer, "tok", None), "get_vocab", None)
        if vocab is None:
            return None
        cached = max((len(t.encode("utf-8")) for t in vocab(with_added_tokens=True)), default=0) or None
        tokenizer._max_token_bytes = cached
    return cached


def _logprobs(kind: str, body: dict) -> int | None:
    top = TOP_LOGPROBS_MAX[kind]
    if kind == "chat":
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise ApiError(400, '"logprobs" must be true or false', "logprobs")
        k = _int(body, "top_logprobs", 0, top, None)
        if k is not None and not want:
            raise ApiError(400, '"top_logprobs" needs "logprobs": true', "top_logprobs")
        return (k or 0) if want else None
    return _int(body, "logprobs", 0, top, None)


# ----------------------------------------------------------------------------- responses

def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for: exact for byte-level BPE vocabularies (GPT-2's byte to
    character map), else the UTF-8 of its decoded text."""
    piece = tokenizer.token_text(token)
    if piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    return tokenizer.decode([token]).encode("utf-8", "replace")


def _byte_of_char() -> dict[str, int]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()


def logprobs_object(kind: str, entries: list, tokenizer, offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice from decoding.committed_logprobs entries: chat {"content":
    [{token, logprob, bytes, top_logprobs}]}; completions {tokens, token_logprobs, top_logprobs,
    text_offset} (`offset`: where the first token's text starts in the answer)."""
    def tok(i):
        b = token_bytes(tokenizer, i)
        return b.decode("utf-8", "replace"), list(b)

    if kind == "chat":
        content = []
        for t, lp, alts in entries:
            s, b = tok(t)
            content.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": [
                {"token": tok(a)[0], "logprob": alp, "bytes": tok(a)[1]} for a, alp in alts]})
        return {"content": content, "refusal": None}
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp, alts in entries:
        s = tok(t)[0]
        tokens.append(s)
        lps.append(lp)
        tops.append({tok(a)[0]: alp for a, alp in alts})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(kind: str, index: int, text: str | None, finish, logprobs=None, delta: bool = False) -> dict:
    """One entry of "choices": a whole answer, or with `delta` a stream chunk's (text None: none)."""
    if kind == "chat":
        if delta:
            body = {"index": index, "delta": {} if text is None else {"content": text}}
        else:
            body = {"index": index, "message": {"role": "assistant", "content": text, "refusal": None}}
    else:
        body = {"index": index, "text": text or ""}
    body.update(finish_reason=finish, logprobs=logprobs)
    return body


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The text before the first stop string (OpenAI leaves it out)."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]
