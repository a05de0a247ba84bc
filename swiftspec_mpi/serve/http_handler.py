"""The HTTP side of `--serve` (one handler thread a connection): routes, bounded and timed body
reading, JSON answers and errors, server-sent event streams, and noticing a client that left.
The engine side (the queue rank 0 decodes from) is http_server.HttpSource, passed in as `source`.
"""
from __future__ import annotations

import io
import json
import queue
import select
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

from swiftspec_mpi.serve import openai_api as api

SERVER_CATEGORY = "server"
ALLOW = {"/health": "GET, HEAD", "/metrics": "GET, HEAD", "/v1/models": "GET, HEAD",
         "/v1/completions": "POST", "/v1/chat/completions": "POST"}
KINDS = {"/v1/completions": "text", "/v1/chat/completions": "chat"}
POLL_S = 0.25            # a waiting handler checks this often whether its client is still there
DRAIN_S = 0.5            # after refusing a body unread: time its sender gets to see the answer
QUEUE_NOTE_S = 1.0       # a queued stream gets a ": queued, position N" comment this often (and on a move)
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ClientGone(Exception):
    """The client closed its connection while its request waited or ran."""


class Pending:
    """One decode of an HTTP request (one of its n answers) on its way through the engine."""

    def __init__(self, ask: api.Ask, rid: str):
        self.ask, self.id = ask, rid
        self.index = -1                              # the job's request index, once it starts
        self.queued_at = self.started_at = 0.0       # time.monotonic() of submission and of start
        self.gone = False                            # the client closed the connection
        self.events: queue.Queue = queue.Queue()     # ("text", (piece, logprobs)) ..., then
        self.answered = threading.Event()            # ("done", result) or ("refused", ApiError)

    def push_text(self, piece: str, logprobs) -> None:   # the engine's thread (rank 0's main loop)
        self.events.put(("text", (piece, logprobs)))


def shutting_down() -> api.ApiError:
    return api.ApiError(503, "the server is shutting down (it received a signal); send the request to "
                        "another server or restart this one", etype="server_error", code="server_shutting_down")


def log(line: str) -> None:
    print(f"swiftspec: {line}", file=sys.stderr, flush=True)


class RequestDeadline(TimeoutError):
    """The request's --serve-read-timeout passed while its head or body was still arriving."""


class DeadlineReader(io.RawIOBase):
    """The connection's input with one deadline for a whole request (`deadline`, time.monotonic();
    the handler sets it per request): each receive waits at most until then, so a client that
    dribbles its bytes cannot stretch a request past it. `got` counts the bytes received."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self.got = sock, deadline, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RequestDeadline()
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buf)
        except TimeoutError:
            raise RequestDeadline() from None
        self.got += n
        return n


class _Answer:
    """One answer's text, finish and log-probabilities as its events arrive; `marks` pair each
    log-probability entry with the text length its token completes, so a stop cut drops the
    tokens after it."""

    def __init__(self):
        self.seen, self.sent, self.marks, self.lp_sent = "", 0, [], 0

    def add(self, piece: str, entries) -> None:
        self.seen += piece
        self.marks += [(len(self.seen), e) for e in entries]

    def entries_upto(self, upto: int) -> list:
        """The entries not yet sent whose token's text ends at or before `upto`."""
        n = self.lp_sent
        while n < len(self.marks) and self.marks[n][0] <= upto:
            n += 1
        out, self.lp_sent = [m[1] for m in self.marks[self.lp_sent:n]], n
        return out

    def close(self, result) -> None:
        """Tokens whose text never completed (a cut UTF-8 sequence) end with the whole text."""
        extra = result.logprobs[len(self.marks):]
        self.marks += [(len(result.text), e) for e in extra]


def make_handler(source):
    cfg, tok = source.cfg, source.tokenizer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "swiftspec-mpi"
        timeout = cfg.serve_read_timeout          # the socket's default (each read sets its own: DeadlineReader)
        head_only = False
        in_flight: Pending | None = None          # the decode this handler waits on
        next_check = 0.0                          # when _next_event next asks whether the client left

        def log_message(self, fmt, *args):       # no per-request lines on rank 0's stderr
            pass

        # -- one deadline a request (--serve-read-timeout) -------------------------------------------
        def setup(self):
            super().setup()
            self.reader = DeadlineReader(self.connection, time.monotonic() + cfg.serve_read_timeout)
            self.rfile = io.BufferedReader(self.reader, 65536)
            self.served = 0                        # requests answered on this connection

        def handle_one_request(self):
            """One request: its line, headers and body must all arrive within --serve-read-timeout
            of the connection's opening (its first request) or of the previous answer. A request
            begun and unfinished by then gets 408; a connection that sent nothing is closed (with a
            line on stderr when it never sent a request)."""
            self.reader.deadline = time.monotonic() + cfg.serve_read_timeout
            self.reader.got = 0
            self.raw_requestline = b""
            try:
                self.raw_requestline = self.rfile.readline(65537)
                if len(self.raw_requestline) > 65536:
                    self.requestline, self.request_version, self.command = "", "", ""
                    self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                    return
                if not self.raw_requestline:
                    self.close_connection = True
                    return
                if not self.parse_request():
                    return
                self.connection.settimeout(cfg.serve_read_timeout)     # the answer's writes
                method = getattr(self, "do_" + self.command, None)
                if method is None:
                    self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"Unsupported method ({self.command!r})")
                    return
                method()
                self.wfile.flush()
            except RequestDeadline:
                self._request_timed_out()
            except TimeoutError:           # a write to a client that stopped reading
                self.close_connection = True
                log(f"HTTP client {self.client()}: an answer could not be written within "
                    f"{cfg.serve_read_timeout:g} s; connection closed")
            finally:
                self.served += 1

        def _request_timed_out(self) -> None:
            """The deadline passed before the request line and headers were whole."""
            self.close_connection = True
            try:
                buffered = len(self.rfile.peek(0))      # a pipelined request's first bytes
            except OSError:                             # (past the deadline: no read waits)
                buffered = 0
            if self.reader.got == 0 and not self.raw_requestline and not buffered:
                if not self.served:
                    log(f"HTTP client {self.client()}: no request within {cfg.serve_read_timeout:g} s of "
                        "connecting (--serve-read-timeout); connection closed")
                    source.metrics.connection_closed("read_timeout")
                return                      # an idle keep-alive connection: closed quietly
            source.metrics.connection_closed("read_timeout")
            log(f"HTTP client {self.client()}: the request line and headers did not arrive within "
                f"{cfg.serve_read_timeout:g} s (--serve-read-timeout); 408, connection closed")
            self.request_version = "HTTP/1.1"      # the request line may be unread or half read
            self.command = self.command if isinstance(getattr(self, "command", None), str) else ""
            self.requestline = getattr(self, "requestline", "")
            self._error(api.ApiError(408, f"the request did not arrive within {cfg.serve_read_timeout:g} s "
                                          "(the server's --serve-read-timeout)", code="timeout"))
            self._linger()

        def send_response(self, code, message=None):
            source.metrics.answered(self._path() if getattr(self, "path", "") else "other", int(code))
            super().send_response(code, message)

        def client(self) -> str:
            return f"{self.client_address[0]}:{self.client_address[1]}"

        # -- answers ---------------------------------------------------------------------------
        def _json(self, code: int, obj: dict, headers: dict | None = None) -> None:
            self._bytes(code, json.dumps(obj).encode(), "application/json", headers)

        def _bytes(self, code: int, data: bytes, ctype: str, headers: dict | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if not self.head_only:
                self.wfile.write(data)

        def _error(self, e: api.ApiError, headers: dict | None = None) -> None:
            self._json(e.status, e.body(), {**e.headers, **(headers or {})})

        def send_error(self, code, message=None, explain=None):
            """What the base class refuses itself (a bad request line or header, an unknown
            method), in the JSON error shape; an unknown method is 405."""
            if self.request_version == "HTTP/0.9":
                self.request_version = "HTTP/1.1"     # always a status line
            self.close_connection = True
            headers = {}
            if code == HTTPStatus.NOT_IMPLEMENTED:    # no do_<METHOD>
                code, message = 405, f"method {self.command!r} is not allowed"
                headers["Allow"] = self._allow() or "GET, HEAD, POST"
            phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "error"
            self._json(code, api.error_body(f"{message or phrase} (HTTP {code})"), headers)
            self._linger()

        def _path(self) -> str:
            return urllib.parse.unquote(self.path.split("?", 1)[0]).rstrip("/") or "/"

        def _allow(self) -> str | None:
            path = self._path() if getattr(self, "path", "") else ""
            return ALLOW.get(path) or ("GET, HEAD" if path.startswith("/v1/models/") else None)

        def _not_allowed(self) -> None:
            allow = self._allow()
            if allow is None:
                self._error(api.ApiError(404, f"no route {self.command} {self._path()}; use /v1/completions, "
                                              "/v1/chat/completions, /v1/models, /health or /metrics",
                                         etype="not_found_error"))
            else:
                self._error(api.ApiError(405, f"{self.command} is not allowed on {self._path()}; use {allow}"),
                            {"Allow": allow})

        def _guard(self, work) -> None:
            """Run `work`; every failure becomes an answer or one log line."""
            try:
                work()
            except api.ApiError as e:
                self._error(e)
                if self.close_connection:     # the body was not read whole
                    self._linger()
            except ClientGone:
                self.close_connection = True
            except (ConnectionError, TimeoutError) as exc:
                self.close_connection = True
                p = self.in_flight
                if p is not None:              # the engine ends it at its next token
                    p.gone = True
                    source.leave(p)            # or it leaves the queue
                log(f"HTTP client {self.client()} disconnected ({type(exc).__name__})"
                    + (f"; request {p.id} ends" if p is not None else ""))
            except Exception as exc:  # noqa: BLE001 - a bug must not reach a client's socket as a traceback
                self.close_connection = True
                log(f"HTTP {self.command} {self._path()} from {self.client()} failed: {type(exc).__name__}: {exc}")
                try:
                    self._error(api.ApiError(500, f"the server failed on this request ({type(exc).__name__})",
                                             etype="server_error"))
                except OSError:
                    pass

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _not_allowed

        # -- GET -------------------------------------------------------------------------------
        def do_HEAD(self):
            self.head_only = True
            self.do_GET()

        def do_GET(self):
            self._busy(True)                  # its answer is being written: not idle
            try:
                self._guard(self._get)
            finally:
                self._busy(False)

        def _get(self):
            if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get("Transfer-Encoding"):
                self.close_connection = True       # a body nobody reads must not become a request
            path = self._path()
            if path == "/health":
                self._json(200, source.status())
            elif path == "/metrics":
                self._bytes(200, source.render_metrics().encode(), PROMETHEUS_TYPE)
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [self._model()]})
            elif path.startswith("/v1/models/"):
                name = path[len("/v1/models/"):]
                api.check_model({"model": name}, source.names)
                self._json(200, self._model())
            else:
                self._not_allowed()

        def _model(self) -> dict:
            return {"id": source.model_name, "object": "model", "created": 0, "owned_by": "swiftspec-mpi"}

        # -- POST ------------------------------------------------------------------------------
        def do_POST(self):
            try:
                self._guard(self._post)
            finally:
                self._busy(False)

        def _post(self):
            self.in_flight = None
            kind = KINDS.get(self._path())
            if kind is None:
                self._not_allowed()
                return
            body = api.parse_body(self._read_body())
            ask = api.parse_ask(kind, body, tok, source.room, cfg.max_new_tokens, source.info(), source.names)
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
            self._busy(True)
            (self._stream if ask.stream else self._whole)(ask, rid, int(time.time()))

        def _read_body(self) -> bytes:
            """The body, at most cfg.serve_max_body bytes, all of it before the request's deadline
            (--serve-read-timeout, DeadlineReader); a refusal closes the connection (what is left
            of the body is not read)."""
            limit, deadline = cfg.serve_max_body, self.reader.deadline
            te = (self.headers.get("Transfer-Encoding") or "").strip().lower()
            lengths = self.headers.get_all("Content-Length") or []
            self.close_connection = True                 # until the body is read whole
            if te == "chunked" and not lengths:
                data = self._read_chunked(limit, deadline)
            elif te:
                raise api.ApiError(400, f"Transfer-Encoding {te!r} is not supported (send Content-Length)")
            else:
                if not lengths:
                    raise api.ApiError(411, "a POST needs a Content-Length header (or chunked encoding)")
                if len(set(lengths)) > 1 or not lengths[0].strip().isdigit():
                    raise api.ApiError(400, f"Content-Length {', '.join(lengths)!r} is not one "
                                            "non-negative integer")
                n = int(lengths[0])
                if n > limit:
                    self._refuse_unread(api.ApiError(
                        413, f"the body has {n} bytes; this server takes at most {limit} "
                             "(its --serve-max-body)", code="request_too_large"))
                data = self._read_exactly(n, deadline)
            self.close_connection = False
            self.connection.settimeout(cfg.serve_read_timeout)
            return data

        def _read_exactly(self, n: int, deadline: float) -> bytes:
            parts, got = [], 0
            while got < n:
                if deadline - time.monotonic() <= 0:
                    raise self._too_slow(got, n)
                try:
                    chunk = self.rfile.read1(min(65536, n - got))
                except TimeoutError:
                    raise self._too_slow(got, n) from None
                if not chunk:
                    raise api.ApiError(400, f"the body ended after {got} of the {n} bytes its "
                                            "Content-Length announced")
                parts.append(chunk)
                got += len(chunk)
            return b"".join(parts)

        def _read_line(self, deadline: float) -> bytes:
            try:
                line = self.rfile.readline(1026)
            except TimeoutError:
                raise self._too_slow(None, None) from None
            if not line.endswith(b"\n"):
                raise api.ApiError(400, "a chunked body ended early or has a line over 1 KiB")
            return line

        def _read_chunked(self, limit: int, deadline: float) -> bytes:
            parts, got = [], 0
            while True:
                size = self._read_line(deadline).split(b";", 1)[0].strip()
                try:
                    n = int(size, 16)
                except ValueError:
                    raise api.ApiError(400, f"bad chunk size {size[:20]!r} in a chunked body") from None
                if n < 0 or got + n > limit:
                    self._refuse_unread(api.ApiError(413, f"the body is over {limit} bytes, the most this "
                                                          "server takes (its --serve-max-body)",
                                                     code="request_too_large"))
                if n == 0:
                    while self._read_line(deadline).strip():     # trailers
                        pass
                    return b"".join(parts)
                parts.append(self._read_exactly(n, deadline))
                got += n
                if self._read_line(deadline).strip():
                    raise api.ApiError(400, "a chunk of a chunked body is longer than its size says")

        def _too_slow(self, got, n) -> api.ApiError:
            had = f" ({got} of {n} bytes came)" if n is not None else ""
            source.metrics.connection_closed("read_timeout")
            log(f"HTTP client {self.client()}: the body did not arrive within {cfg.serve_read_timeout:g} s "
                f"(--serve-read-timeout){had}; 408, connection closed")
            return api.ApiError(408, f"the request did not arrive whole within {cfg.serve_read_timeout:g} s "
                                     f"(the server's --serve-read-timeout){had}; a Content-Length larger than "
                                     "the body ends this way", code="timeout")

        def _refuse_unread(self, e: api.ApiError) -> None:
            """Answer `e` and close without reading the rest of the body."""
            self._error(e)
            self._linger()
            raise ClientGone()

        def _linger(self) -> None:
            """Before closing a connection whose input may not have been read whole: shut the
            writing side, then discard what the client still sends for DRAIN_S seconds (1 MiB
            at most), so it reads the answer instead of a connection reset."""
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                end, drained = time.monotonic() + DRAIN_S, 0
                while drained < (1 << 20) and time.monotonic() < end:
                    self.connection.settimeout(max(0.001, end - time.monotonic()))
                    chunk = self.connection.recv(65536)
                    if not chunk:
                        break
                    drained += len(chunk)
            except OSError:
                pass

        # -- waiting for the engine ------------------------------------------------------------
        def _gone(self) -> bool:
            """The client closed its side (a readable socket with nothing to read)."""
            try:
                ready, _, _ = select.select([self.connection], [], [], 0)
                return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def _submit(self, ask: api.Ask, rid: str, admit: bool = True) -> Pending:
            p = Pending(ask, rid)
            source.submit(p, admit)
            self.in_flight = p
            return p

        def _busy(self, busy: bool) -> None:
            """This connection has a request queued or decoding (not counted against --serve-max-idle)."""
            if source.httpd is not None:
                source.httpd.connections.set_busy(self.connection, busy)

        def _next_event(self, p: Pending, waiting=None):
            """The next event of `p`; raises ClientGone (one log line) when the client left.
            `waiting()` is called every POLL_S while no event comes."""
            while True:
                now = time.monotonic()
                if now >= self.next_check:           # events may come without pause: check anyway
                    self.next_check = now + POLL_S
                    if self._gone():
                        p.gone = True
                        source.leave(p)
                        log(f"HTTP client {self.client()} disconnected; request {p.id} "
                            f"{'ends at its next token' if p.index >= 0 else 'leaves the queue'}")
                        raise ClientGone()
                try:
                    return p.events.get(timeout=POLL_S)
                except queue.Empty:
                    if waiting is not None:
                        waiting()

        def _submit_nth(self, ask: api.Ask, rid: str, i: int) -> Pending | None:
            """Queue the request of answer i of ask.n (only the first can find the queue full: the
            request was admitted); a refusal raises for the first answer and returns None for a
            later one (shutting down: the answers so far stand)."""
            try:
                return self._submit(ask, rid, admit=i == 0)
            except api.ApiError:
                if i == 0:
                    raise
                return None

        def _whole(self, ask: api.Ask, rid: str, created: int) -> None:
            choices, done_tokens, last = [], 0, None
            for i in range(ask.n):
                p = self._submit_nth(ask, rid, i)
                if p is None:
                    break
                try:
                    ans = _Answer()
                    while True:
                        what, value = self._next_event(p)
                        if what == "text":
                            ans.add(*value)
                        elif what == "refused":
                            if i == 0:
                                raise value
                            break
                        else:
                            result = last = value
                            ans.close(result)
                            text = api.cut_at_stop(result.text, ask.stop)
                            lp = None
                            if ask.logprobs is not None:
                                lp = api.logprobs_object(ask.kind, ans.entries_upto(len(text)), tok)
                            choices.append(api.choice(ask.kind, i, text, api.FINISH.get(result.stop_reason, "stop"),
                                                      lp))
                            done_tokens += len(result.output_ids)
                            break
                finally:
                    p.answered.set()
                if last is None or last.stop_reason == "interrupted":
                    break
            self._json(200, {"id": rid, "object": "chat.completion" if ask.kind == "chat" else "text_completion",
                             "created": created, "model": source.model_name, "choices": choices,
                             "usage": api.usage(len(ask.ids), done_tokens), "swiftspec": source.info()})

        def _stream(self, ask: api.Ask, rid: str, created: int) -> None:
            obj = "chat.completion.chunk" if ask.kind == "chat" else "text_completion"
            started = [False]
            hold = max((len(s) for s in ask.stop), default=1) - 1     # a stop string may be starting

            def start() -> None:
                """The headers, as soon as the request is queued: a client that waits its turn
                has its answer begun (and queue comments), so its read timeout does not fire."""
                started[0] = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                self.wfile.flush()

            def send(msg) -> None:
                data = "[DONE]" if msg is None else json.dumps(msg)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

            def queue_note(p: Pending) -> None:
                """While `p` waits: ": queued, position N" (N = 1 + the requests ahead of it,
                the one decoding included) when N changes, and every QUEUE_NOTE_S."""
                pos = source.position(p)
                now = time.monotonic()
                if pos and (pos != note[0] or now - note[1] >= QUEUE_NOTE_S):
                    note[:] = [pos, now]
                    self.wfile.write(f": queued, position {pos}\n\n".encode())
                    self.wfile.flush()

            def chunk(i: int, text, finish=None, lp=None, role=False) -> None:
                c = api.choice(ask.kind, i, text, finish, lp, delta=True)
                if role:
                    c["delta"] = {"role": "assistant", "content": ""}
                msg = {"id": rid, "object": obj, "created": created, "model": source.model_name, "choices": [c]}
                if ask.include_usage:
                    msg["usage"] = None
                send(msg)

            def lp_of(ans: _Answer, upto: int, offset: int):
                if ask.logprobs is None:
                    return None
                return api.logprobs_object(ask.kind, ans.entries_upto(upto), tok, offset)

            total, note = 0, [0, 0.0]
            for i in range(ask.n):
                p = self._submit_nth(ask, rid, i)
                if p is None:
                    break
                try:
                    if not started[0]:
                        start()
                    ans, result, first = _Answer(), None, True
                    while result is None:
                        what, value = self._next_event(p, lambda p=p: queue_note(p))
                        if what == "refused":
                            if i == 0:          # refused while queued (shutting down): an error event
                                send(value.body())
                                return
                            break
                        if ask.kind == "chat" and first:      # OpenAI's first chunk: the role
                            chunk(i, None, role=True)
                            first = False
                        if what == "done":
                            result = value
                            break
                        ans.add(*value)
                        safe = api.cut_at_stop(ans.seen, ask.stop)
                        upto = len(safe) if len(safe) < len(ans.seen) else max(ans.sent, len(safe) - hold)
                        if upto > ans.sent:
                            chunk(i, safe[ans.sent:upto], lp=lp_of(ans, upto, ans.sent))
                            ans.sent = upto
                    if result is None:
                        break
                    ans.close(result)
                    final = api.cut_at_stop(result.text, ask.stop)
                    rest = final[ans.sent:] if final.startswith(ans.seen[:ans.sent]) else ""
                    lp = lp_of(ans, len(final), ans.sent)
                    if rest or (lp and (lp.get("content") or lp.get("tokens"))):
                        chunk(i, rest, lp=lp)
                    chunk(i, None, api.FINISH.get(result.stop_reason, "stop"))
                    total += len(result.output_ids)
                finally:
                    p.answered.set()
                if result.stop_reason == "interrupted":
                    break
            if ask.include_usage:
                send({"id": rid, "object": obj, "created": created, "model": source.model_name, "choices": [],
                      "usage": api.usage(len(ask.ids), total)})
            send(None)

    return Handler
