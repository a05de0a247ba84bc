"""`swiftspec run --serve [HOST:]PORT`: an OpenAI-style HTTP endpoint on world rank 0, so editors,
agents and scripts can use the engine the way they use any completion server.

    mpiexec -n 2 swiftspec run --serve 8000 --mode async          # then, e.g. through an ssh tunnel:
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Routes: GET /health, GET /v1/models, GET /v1/models/{id} (HEAD too), POST /v1/completions and
POST /v1/chat/completions (what a body may hold: openai_api.py). Another method on a route: 405
with Allow; another path: 404.

The engine decodes one request at a time, as it is built to: HTTP requests queue (FIFO) and each
becomes one request of the job, shared with every rank like an --interactive prompt
(interactive.SharedRequests); n > 1 answers are n requests, one after another. The HDF5 trace
is rewritten after each one.

Every refusal is JSON in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}):
400 for a body that is not JSON, nested too deeply, not UTF-8 / holds a lone surrogate, or asks
for what the server cannot do; 404 for an unknown route or model; 405 a wrong method; 408 a
client that has not sent its whole body within --serve-read-timeout seconds (a Content-Length
larger than the body ends this way); 411 a POST without a length; 413 a body above
--serve-max-body bytes (refused from its headers, never read whole); 503 while shutting down.
What a client sends never reaches a traceback: a handler's unexpected failure is one line on
rank 0's stderr and a 500; a client that disconnects is one line.

A client that disconnects ends its request at the next token (stop reason "cancelled"), or
before it starts when it was still queued, so the queue moves on. SIGTERM / SIGINT: the stream
in flight gets a last chunk with finish_reason "interrupted" and `data: [DONE]` (an unstreamed
request in flight gets its text so far, finish_reason "interrupted"), every queued request gets
503, then the trace is written and the job exits with code 4.
"""
from __future__ import annotations

import queue
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from swiftspec_mpi.core.config import Request, parse_serve_address
from swiftspec_mpi.serve.http_handler import SERVER_CATEGORY, Pending, make_handler, shutting_down
from swiftspec_mpi.serve.interactive import SharedRequests, check_while_waiting
from swiftspec_mpi.serve.openai_api import cut_at_stop  # noqa: F401 - the name tests and tools use

SHUTDOWN_WAIT_S = 5.0     # SIGTERM: how long the answers to clients may take before the exit


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """Whatever escaped a handler: one line on stderr, never a traceback."""
        exc = sys.exc_info()[1]
        what = "disconnected" if isinstance(exc, (ConnectionError, TimeoutError)) else \
            f"failed: {type(exc).__name__}: {exc}"
        print(f"swiftspec: HTTP client {client_address[0]}:{client_address[1]} {what}", file=sys.stderr,
              flush=True)


class HttpSource(SharedRequests):
    """--serve: rank 0 runs the HTTP server in background threads; its main loop takes the
    queued requests one at a time (`_read_request`) and streams each one's text back."""

    def __init__(self, world, cfg, tokenizer, stop_flag, watch, room: int, err=None):
        super().__init__(world, cfg, tokenizer, stop_flag, watch, room, err)
        self.pending: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.closing = False
        self.current: Pending | None = None
        self.model_name = (cfg.target or "default").rstrip("/").rsplit("/", 1)[-1] or "default"
        self.names = tuple(dict.fromkeys([self.model_name, *([cfg.target] if cfg.target else []), "swiftspec"]))
        self.httpd = None
        if self.rank == 0:
            host, port = parse_serve_address(cfg.serve)
            self.httpd = _Server((host, port), make_handler(self))
            self.host, self.port = host, self.httpd.server_address[1]
            threading.Thread(target=self.httpd.serve_forever, name="swiftspec-http", daemon=True).start()

    def banner(self) -> None:
        if self.rank == 0:
            self.say(f"swiftspec: serving http://{self.host}:{self.port}/v1 (completions, chat/completions, "
                     f"models; model {self.model_name!r}), {self.cfg.mode} mode, temperature "
                     f"{self.cfg.temperature:g}; up to {self.room} prompt tokens and {self.cfg.max_new_tokens} "
                     "new tokens a request, one at a time (the others queue); SIGTERM or Ctrl-C stops it")

    def submit(self, p: Pending) -> None:           # an HTTP handler thread
        with self.lock:
            if self.closing:
                raise shutting_down()
            self.pending.put(p)

    def _read_request(self) -> Request | None:
        while True:
            check_while_waiting(self.stop_flag, self.watch)
            try:
                p = self.pending.get(timeout=0.05)
            except queue.Empty:
                continue
            if p.gone:                              # its client left while it queued
                continue
            self.current, p.index = p, self.index
            req = Request(self.index, p.ask.shown, SERVER_CATEGORY, list(p.ask.ids), question_id=p.id,
                          max_new_tokens=p.ask.max_tokens, stop=list(p.ask.stop), logprobs=p.ask.logprobs)
            self.index += 1
            return req

    def stream_sink(self):
        return self.current.push_text if self.current is not None else None

    def abandoned(self):
        p = self.current
        return (lambda: p.gone) if p is not None else None

    def finished(self, result) -> None:
        if self.rank == 0 and self.current is not None:
            self.current.events.put(("done", result))
            self.current = None

    def interrupted(self, results) -> None:
        """Rank 0 at SIGTERM, before the trace is written: the request in flight ends with
        finish_reason "interrupted", the queued ones get 503; waits (SHUTDOWN_WAIT_S at most)
        until their handlers have answered."""
        from swiftspec_mpi.trace.record import RequestResult
        with self.lock:
            self.closing = True
        told = []
        p = self.current
        if p is not None:
            result = next((r for r in results if r.index == p.index), None)
            if result is None:          # stopped before its first step
                result = RequestResult(p.index, SERVER_CATEGORY, p.ask.shown, list(p.ask.ids))
            p.events.put(("done", result))
            told.append(p)
            self.current = None
        while True:
            try:
                q = self.pending.get_nowait()
            except queue.Empty:
                break
            q.events.put(("refused", shutting_down()))
            told.append(q)
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for q in told:
            if not q.gone:
                q.answered.wait(max(0.0, deadline - time.monotonic()))

    def info(self) -> dict:
        return {"mode": self.cfg.mode, "temperature": self.cfg.temperature, "seed": self.cfg.seed}
