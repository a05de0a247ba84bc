"""`swiftspec run --serve [HOST:]PORT`: an OpenAI-style HTTP endpoint on world rank 0, so editors,
agents and scripts can use the engine the way they use any completion server.

    mpiexec -n 2 swiftspec run --serve 8000 --mode async          # then, e.g. through an ssh tunnel:
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /health, GET /v1/models, POST /v1/completions ({"prompt": str, ...}: the text as
it is) and POST /v1/chat/completions ({"messages": [{"role", "content"}, ...]}: through the
target's chat template). Per request: "max_tokens" (1 .. --max-new-tokens, default the latter),
"stop" (a string or a list), "stream" (server-sent events, OpenAI's chunk format, ending with
`data: [DONE]`). The sampling settings are the run's (--temperature, --seed: the decode graphs
are built for them); a request's own "temperature", "top_p", ... are ignored, and every response
says what was used in its "swiftspec" field.

The engine decodes one request at a time, as it is built to: HTTP requests queue (FIFO) and each
becomes one request of the job, shared with every rank like an --interactive prompt
(interactive.SharedRequests). The HDF5 trace is rewritten after each one. SIGTERM / SIGINT stop
the server like any job (exit code 4, the trace written). When a streaming client disconnects,
its request ends at the next token (stop reason "cancelled"), so the queue moves on; a
non-streaming one is only noticed when its answer is written. Bad requests get HTTP 400 with
OpenAI's error shape, before they reach the queue.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from swiftspec_mpi.core.config import Request, parse_serve_address
from swiftspec_mpi.serve.interactive import SharedRequests, check_while_waiting

SERVER_CATEGORY = "server"
_FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


class BadRequest(Exception):
    """An HTTP request the server refuses (400) with this message."""


class Pending:
    """One HTTP request on its way through the engine: what the handler thread waits on."""

    def __init__(self, kind: str, prompt_text: str, ids: list[int], max_tokens: int, stop: list[str],
                 stream: bool):
        self.kind, self.prompt_text, self.ids = kind, prompt_text, ids
        self.max_tokens, self.stop, self.stream = max_tokens, stop, stream
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.gone = False                            # the client closed the connection
        self.events: queue.Queue = queue.Queue()     # ("text", piece) ..., then ("done", result)

    def push_text(self, piece: str) -> None:        # the engine's thread (rank 0's main loop)
        self.events.put(("text", piece))

    def done(self, result) -> None:
        self.events.put(("done", result))


def cut_at_stop(text: str, stop: list[str]) -> str:
    """The text before the first stop string (OpenAI leaves it out)."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]


def parse_request(kind: str, body: dict, tokenizer, room: int, max_new: int) -> Pending:
    """Validate an OpenAI-style body -> Pending, or raise BadRequest with the fix."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest('"messages" must be a non-empty list of {"role": str, "content": str}')
        text = tokenizer.render_conversation([{"role": m["role"], "content": m["content"]} for m in messages])
        shown = messages[-1]["content"]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest('"prompt" must be a non-empty string (one prompt a request)')
        text = shown = prompt
    ids = tokenizer.encode(text)
    if not ids:
        raise BadRequest("the prompt tokenizes to nothing")
    if len(ids) > room:
        raise BadRequest(f"the prompt has {len(ids)} tokens and this server has room for {room} "
                         "(start it with a larger --max-context)")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = max_new
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= max_new:
        raise BadRequest(f'"max_tokens" must be an integer in 1..{max_new} (the server\'s --max-new-tokens)')
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest('"stop" must be a string or a list of non-empty strings')
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest('"stream" must be true or false')
    return Pending(kind, shown, ids, max_tokens, stop, stream)


class HttpSource(SharedRequests):
    """--serve: rank 0 runs the HTTP server in background threads; its main loop takes the
    queued requests one at a time (`_read_request`) and streams each one's text back."""

    def __init__(self, world, cfg, tokenizer, stop_flag, watch, room: int, err=None):
        super().__init__(world, cfg, tokenizer, stop_flag, watch, room, err)
        self.pending: queue.Queue = queue.Queue()
        self.current: Pending | None = None
        self.model_name = (cfg.target or "default").rstrip("/").rsplit("/", 1)[-1]
        self.httpd = None
        if self.rank == 0:
            host, port = parse_serve_address(cfg.serve)
            self.httpd = ThreadingHTTPServer((host, port), _handler_class(self))
            self.httpd.daemon_threads = True
            self.host, self.port = host, self.httpd.server_address[1]
            threading.Thread(target=self.httpd.serve_forever, name="swiftspec-http", daemon=True).start()

    def banner(self) -> None:
        if self.rank == 0:
            self.say(f"swiftspec: serving http://{self.host}:{self.port}/v1 (completions, chat/completions, "
                     f"models; model {self.model_name!r}), {self.cfg.mode} mode, temperature "
                     f"{self.cfg.temperature:g}; up to {self.room} prompt tokens and {self.cfg.max_new_tokens} "
                     "new tokens a request, one at a time (the others queue); SIGTERM or Ctrl-C stops it")

    def submit(self, p: Pending) -> None:           # an HTTP handler thread
        self.pending.put(p)

    def _read_request(self) -> Request | None:
        while True:
            check_while_waiting(self.stop_flag, self.watch)
            try:
                p = self.pending.get(timeout=0.05)
            except queue.Empty:
                continue
            self.current = p
            req = Request(self.index, p.prompt_text, SERVER_CATEGORY, list(p.ids), question_id=p.id,
                          max_new_tokens=p.max_tokens, stop=list(p.stop))
            self.index += 1
            return req

    def stream_sink(self):
        return self.current.push_text if self.current is not None else None

    def abandoned(self):
        p = self.current
        return (lambda: p.gone) if p is not None else None

    def finished(self, result) -> None:
        if self.rank == 0 and self.current is not None:
            self.current.done(result)
            self.current = None

    def info(self) -> dict:
        return {"mode": self.cfg.mode, "temperature": self.cfg.temperature, "seed": self.cfg.seed}


def _handler_class(source: HttpSource):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "swiftspec-mpi"

        def log_message(self, fmt, *args):       # no per-request lines on rank 0's stderr
            pass

        def _json(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, etype: str = "invalid_request_error") -> None:
            self._json(code, {"error": {"message": message, "type": etype, "param": None, "code": None}})

        def do_GET(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/health":
                self._json(200, {"status": "ok", "queued": source.pending.qsize()})
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": source.model_name, "object": "model",
                                                             "created": 0, "owned_by": "swiftspec-mpi"}]})
            else:
                self._error(404, f"no route GET {path}; try /v1/models or /health", "not_found_error")

        def do_POST(self):
            path = self.path.split("?", 1)[0].rstrip("/")
            kind = {"/v1/completions": "text", "/v1/chat/completions": "chat"}.get(path)
            if kind is None:
                self._error(404, f"no route POST {path}; use /v1/completions or /v1/chat/completions",
                            "not_found_error")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
            except (ValueError, json.JSONDecodeError) as exc:
                self._error(400, f"the body is not valid JSON ({exc})")
                return
            try:
                p = parse_request(kind, body, source.tokenizer, source.room, source.cfg.max_new_tokens)
            except BadRequest as exc:
                self._error(400, str(exc))
                return
            source.submit(p)
            try:
                if p.stream:
                    self._stream(p)
                else:
                    self._whole(p)
            except (BrokenPipeError, ConnectionResetError):
                p.gone = True                     # the engine ends the request at its next token

        def _wait_result(self, p: Pending, on_text=None):
            while True:
                what, value = p.events.get()
                if what == "done":
                    return value
                if on_text is not None:
                    on_text(value)

        def _body(self, p: Pending, text: str, finish) -> dict:
            usage = {"prompt_tokens": len(p.ids), "completion_tokens": 0, "total_tokens": len(p.ids)}
            choice = {"index": 0, "finish_reason": finish, "logprobs": None}
            if p.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return {"id": p.id, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                    "created": p.created, "model": source.model_name, "choices": [choice], "usage": usage,
                    "swiftspec": source.info()}

        def _whole(self, p: Pending) -> None:
            result = self._wait_result(p)
            body = self._body(p, cut_at_stop(result.text, p.stop), _FINISH.get(result.stop_reason))
            n = len(result.output_ids)
            body["usage"].update(completion_tokens=n, total_tokens=len(p.ids) + n)
            self._json(200, body)

        def _stream(self, p: Pending) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            hold = max((len(s) for s in p.stop), default=1) - 1     # a stop string may be starting
            state = {"seen": "", "sent": 0}                           # text seen / sent so far

            def chunk(delta: str | None, finish=None) -> None:
                if p.kind == "chat":
                    d = {} if delta is None else {"content": delta}
                    if delta is not None and state["sent"] == 0:      # the first content chunk
                        d["role"] = "assistant"
                    choice = {"index": 0, "delta": d, "finish_reason": finish}
                    obj = "chat.completion.chunk"
                else:
                    choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
                    obj = "text_completion"
                msg = {"id": p.id, "object": obj, "created": p.created, "model": source.model_name,
                       "choices": [choice]}
                self.wfile.write(b"data: " + json.dumps(msg).encode() + b"\n\n")
                self.wfile.flush()

            def on_text(piece: str) -> None:
                state["seen"] += piece
                safe = cut_at_stop(state["seen"], p.stop)
                upto = len(safe) if len(safe) < len(state["seen"]) else max(state["sent"], len(safe) - hold)
                if upto > state["sent"]:
                    chunk(safe[state["sent"]:upto])
                    state["sent"] = upto

            result = self._wait_result(p, on_text)
            final = cut_at_stop(result.text, p.stop)
            if len(final) > state["sent"] and final.startswith(state["seen"][:state["sent"]]):
                chunk(final[state["sent"]:])
            chunk(None, _FINISH.get(result.stop_reason))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler
