"""`swiftspec run --serve [HOST:]PORT`: an OpenAI-style HTTP endpoint on world rank 0, so editors,
agents and scripts can use the engine the way they use any completion server.

    mpiexec -n 2 swiftspec run --serve 8000 --mode async          # then, e.g. through an ssh tunnel:
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Routes: GET /health (queue depth, the request decoding, connections), GET /metrics (Prometheus
text: metrics.py), GET /v1/models, GET /v1/models/{id} (HEAD too), POST /v1/completions and
POST /v1/chat/completions (what a body may hold: openai_api.py). Another method on a route: 405
with Allow; another path: 404.

The engine decodes one request at a time, as it is built to: HTTP requests queue (FIFO, at most
--serve-max-queue behind the one decoding, then 429 with Retry-After) and each becomes one
request of the job, shared with every rank like an --interactive prompt
(interactive.SharedRequests); n > 1 answers are n requests, one after another. A queued stream
gets its headers at once and ": queued, position N" comments while it waits. The HDF5 trace is
rewritten after each one (in files of --trace-rotate requests: cli/job.py).

Connections: one deadline a request, --serve-read-timeout, from the connection's opening (or the
previous answer) to the body's last byte (http_handler.DeadlineReader); at most --serve-max-idle
connections held with no request queued or decoding (Connections: a new one closes the oldest).

Every refusal is JSON in OpenAI's error shape ({"error": {"message", "type", "param", "code"}}):
400 for a body that is not JSON, nested too deeply, not UTF-8 / holds a lone surrogate, or asks
for what the server cannot do; 404 for an unknown route or model; 405 a wrong method; 408 a
request not whole by its deadline (a Content-Length larger than the body ends this way); 411 a
POST without a length; 413 a body above --serve-max-body bytes (refused from its headers, never
read whole); 429 a full queue; 503 while shutting down.
What a client sends never reaches a traceback: a handler's unexpected failure is one line on
rank 0's stderr and a 500; a client that disconnects is one line.

A client that disconnects ends its request at the next token (stop reason "cancelled"), or
before it starts when it was still queued, so the queue moves on. SIGTERM / SIGINT: the stream
in flight gets a last chunk with finish_reason "interrupted" and `data: [DONE]` (an unstreamed
request in flight gets its text so far, finish_reason "interrupted"), every queued request gets
503 (a queued stream: as an error event), then the trace is written with every rank's events
and the job exits with code 4.
"""
from __future__ import annotations

import collections
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from swiftspec_mpi.core.config import Request, parse_serve_address
from swiftspec_mpi.serve import openai_api as api
from swiftspec_mpi.serve.http_handler import SERVER_CATEGORY, Pending, log, make_handler, shutting_down
from swiftspec_mpi.serve.interactive import SharedRequests, check_while_waiting
from swiftspec_mpi.serve.metrics import ServeMetrics
from swiftspec_mpi.serve.openai_api import cut_at_stop  # noqa: F401 - the name tests and tools use

SHUTDOWN_WAIT_S = 5.0     # SIGTERM: how long the answers to clients may take before the exit


class Connections:
    """The connections the server holds, each idle (no request queued or decoding: a keep-alive
    wait, or a request still arriving) or busy; beyond `max_idle` idle ones, a new connection
    closes the oldest idle one."""

    def __init__(self, max_idle: int, metrics: ServeMetrics):
        self.max_idle, self.metrics = max_idle, metrics
        self.lock = threading.Lock()
        self.idle: dict[socket.socket, tuple[float, str]] = {}    # insertion order = age
        self.busy: set[socket.socket] = set()

    def opened(self, sock: socket.socket, who: str) -> None:     # the accepting thread
        with self.lock:
            self.idle[sock] = (time.monotonic(), who)
            evict = list(self.idle.items())[:max(0, len(self.idle) - self.max_idle)]
            for old, _ in evict:
                del self.idle[old]
        for old, (since, whom) in evict:
            log(f"HTTP client {whom}: connection closed after {time.monotonic() - since:.1f} s without a "
                f"request in progress: {self.max_idle} such connections are held at most (--serve-max-idle)")
            self.metrics.connection_closed("idle_limit")
            try:
                old.shutdown(socket.SHUT_RDWR)    # its handler thread reads the end and leaves
            except OSError:
                pass

    def set_busy(self, sock: socket.socket, busy: bool) -> None:
        with self.lock:
            if busy and sock in self.idle:
                del self.idle[sock]
                self.busy.add(sock)
            elif not busy and sock in self.busy:
                self.busy.discard(sock)
                self.idle[sock] = (time.monotonic(), self.idle.get(sock, (0, "?"))[1])

    def closed(self, sock: socket.socket) -> None:
        with self.lock:
            self.idle.pop(sock, None)
            self.busy.discard(sock)

    def counts(self) -> tuple[int, int]:
        """-> (open, idle)."""
        with self.lock:
            return len(self.idle) + len(self.busy), len(self.idle)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    connections: Connections

    def process_request(self, request, client_address):
        self.connections.opened(request, f"{client_address[0]}:{client_address[1]}")
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        self.connections.closed(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address):
        """Whatever escaped a handler: one line on stderr, never a traceback."""
        exc = sys.exc_info()[1]
        what = "disconnected" if isinstance(exc, (ConnectionError, TimeoutError)) else \
            f"failed: {type(exc).__name__}: {exc}"
        print(f"swiftspec: HTTP client {client_address[0]}:{client_address[1]} {what}", file=sys.stderr,
              flush=True)


class HttpSource(SharedRequests):
    """--serve: rank 0 runs the HTTP server in background threads; its main loop takes the
    queued requests one at a time (`_read_request`) and streams each one's text back. The queue
    (`waiting`, FIFO) holds at most --serve-max-queue requests behind the one decoding."""

    def __init__(self, world, cfg, tokenizer, stop_flag, watch, room: int, err=None):
        super().__init__(world, cfg, tokenizer, stop_flag, watch, room, err)
        self.cond = threading.Condition()
        self.waiting: collections.deque[Pending] = collections.deque()
        self.closing = False
        self.current: Pending | None = None
        self.metrics = ServeMetrics()
        self.model_name = (cfg.target or "default").rstrip("/").rsplit("/", 1)[-1] or "default"
        self.names = tuple(dict.fromkeys([self.model_name, *([cfg.target] if cfg.target else []), "swiftspec"]))
        self.httpd = None
        if self.rank == 0:
            host, port = parse_serve_address(cfg.serve)
            self.httpd = _Server((host, port), make_handler(self))
            self.httpd.connections = Connections(cfg.serve_max_idle, self.metrics)
            self.host, self.port = host, self.httpd.server_address[1]
            threading.Thread(target=self.httpd.serve_forever, name="swiftspec-http", daemon=True).start()

    def banner(self) -> None:
        if self.rank == 0:
            self.say(f"swiftspec: serving http://{self.host}:{self.port}/v1 (completions, chat/completions, "
                     f"models; model {self.model_name!r}), {self.cfg.mode} mode, temperature "
                     f"{self.cfg.temperature:g}; up to {self.room} prompt tokens and {self.cfg.max_new_tokens} "
                     f"new tokens a request, one at a time (up to {self.cfg.serve_max_queue} wait, then 429); "
                     "/health and /metrics tell the queue; SIGTERM or Ctrl-C stops it")

    # -- the queue (handler threads) -----------------------------------------------------------
    def submit(self, p: Pending, admit: bool = True) -> None:
        """Queue `p`. Raises 503 while shutting down, and 429 (with Retry-After) when `admit`
        and --serve-max-queue requests already wait behind one decoding (with none decoding,
        one more may wait: it starts at once); a later answer of an admitted request
        (admit=False) always queues."""
        with self.cond:
            if self.closing:
                raise shutting_down()
            if admit and len(self.waiting) + (self.current is not None) > self.cfg.serve_max_queue:
                ahead = len(self.waiting) + (self.current is not None)
                wait = self.metrics.retry_after(ahead)
                raise api.ApiError(429, f"the queue is full: {len(self.waiting)} requests wait behind the one "
                                        f"decoding (this server's --serve-max-queue); retry in about {wait} s",
                                   etype="rate_limit_error", code="queue_full", headers={"Retry-After": str(wait)})
            p.queued_at = time.monotonic()
            self.waiting.append(p)
            self.cond.notify()

    def leave(self, p: Pending) -> None:
        """`p`'s client left while it queued: out of the queue (and of the depth /health shows)."""
        with self.cond:
            try:
                self.waiting.remove(p)
            except ValueError:
                pass

    def position(self, p: Pending) -> int:
        """1 + the requests ahead of `p` (the one decoding included); 0 once it runs."""
        with self.cond:
            if p.index >= 0:
                return 0
            try:
                return self.waiting.index(p) + 1 + (self.current is not None)
            except ValueError:
                return 0

    def status(self) -> dict:
        """GET /health's body."""
        with self.cond:
            queued, cur, closing = len(self.waiting), self.current, self.closing
        opened, idle = self.httpd.connections.counts() if self.httpd else (0, 0)
        active = None if cur is None else {
            "id": cur.id, "request": cur.index, "seconds": round(time.monotonic() - cur.started_at, 3),
            "stream": cur.ask.stream, "max_tokens": cur.ask.max_tokens, "prompt_tokens": len(cur.ask.ids)}
        return {"status": "shutting_down" if closing else "ok", "queued": queued,
                "max_queue": self.cfg.serve_max_queue, "active": active,
                "connections": {"open": opened, "idle": idle, "max_idle": self.cfg.serve_max_idle}}

    def render_metrics(self) -> str:
        with self.cond:
            queued, in_flight = len(self.waiting), int(self.current is not None)
        opened, idle = self.httpd.connections.counts() if self.httpd else (0, 0)
        return self.metrics.render(queued, self.cfg.serve_max_queue, in_flight, opened, idle)

    # -- the engine side (rank 0's main loop) ---------------------------------------------------
    def _read_request(self) -> Request | None:
        while True:
            check_while_waiting(self.stop_flag, self.watch)
            with self.cond:
                if not self.waiting:
                    self.cond.wait(0.05)
                    continue
                p = self.waiting.popleft()
                if p.gone:                          # its client left while it queued
                    continue
                p.started_at = time.monotonic()
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
            p = self.current
            now = time.monotonic()
            self.metrics.decoded(p.started_at - p.queued_at, now - p.started_at, len(p.ask.ids),
                                 len(result.output_ids))
            p.events.put(("done", result))
            with self.cond:
                self.current = None

    def interrupted(self, results) -> None:
        """Rank 0 at SIGTERM, before the trace is written: the request in flight ends with
        finish_reason "interrupted", the queued ones get 503; waits (SHUTDOWN_WAIT_S at most)
        until their handlers have answered."""
        from swiftspec_mpi.trace.record import RequestResult
        with self.cond:
            self.closing = True
            queued, self.waiting = list(self.waiting), collections.deque()
            p, self.current = self.current, None
        told = []
        if p is not None:
            result = next((r for r in results if r.index == p.index), None)
            if result is None:          # stopped before its first step
                result = RequestResult(p.index, SERVER_CATEGORY, p.ask.shown, list(p.ask.ids))
            p.events.put(("done", result))
            told.append(p)
        for q in queued:
            q.events.put(("refused", shutting_down()))
            told.append(q)
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for q in told:
            if not q.gone:
                q.answered.wait(max(0.0, deadline - time.monotonic()))

    def info(self) -> dict:
        return {"mode": self.cfg.mode, "temperature": self.cfg.temperature, "seed": self.cfg.seed}
