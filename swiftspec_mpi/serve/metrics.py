"""What `--serve` counts, for GET /metrics (the Prometheus text exposition format, version 0.0.4)
and GET /health. Everything here is a fixed set of numbers: counters, gauges read at scrape time
and histograms with fixed buckets, so a server that runs for weeks holds no more than at its start.

    swiftspec_http_requests_total{route,code}     answers sent, by route (the five routes, /metrics,
                                                  or "other") and HTTP status
    swiftspec_queue_depth                          requests waiting behind the one decoding
    swiftspec_queue_limit                          --serve-max-queue
    swiftspec_requests_in_flight                   0 or 1: a request decoding
    swiftspec_queue_rejected_total                 429s (the queue was full)
    swiftspec_generated_tokens_total               tokens generated (all answers)
    swiftspec_prompt_tokens_total                  prompt tokens of the answers decoded
    swiftspec_connections_open                     connections held
    swiftspec_connections_idle                     ... with no request queued or decoding
    swiftspec_connections_closed_total{reason}     closes by the server: idle_limit, read_timeout
    swiftspec_queue_wait_seconds                   histogram: submission to the start of decoding
    swiftspec_request_duration_seconds             histogram: submission to the last token (each
                                                   answer of a request, queue wait included)
    swiftspec_decode_seconds                       histogram: start of decoding to the last token
"""
from __future__ import annotations

import bisect
import threading

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
RECENT_WEIGHT = 0.1      # the decode-time average behind Retry-After: weight of the newest answer


class Histogram:
    """Cumulative-bucket histogram (Prometheus `histogram` type) with a fixed bucket list."""

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)    # the last one: +Inf
        self.total, self.n = 0.0, 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds
        self.n += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for le, c in zip((*map(repr, BUCKETS), "+Inf"), self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total!r}", f"{name}_count {self.n}"]
        return out


class ServeMetrics:
    """The server's counters (handler threads and rank 0's decode loop update them under a lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.answers: dict[tuple[str, int], int] = {}
        self.rejected = 0
        self.generated = 0
        self.prompt_tokens = 0
        self.closed = {"idle_limit": 0, "read_timeout": 0}
        self.queue_wait, self.duration, self.decode = Histogram(), Histogram(), Histogram()
        self.recent_decode_s = None       # moving average of an answer's decode time (Retry-After)

    def answered(self, path: str, code: int) -> None:
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
        with self.lock:
            self.answers[(route, code)] = self.answers.get((route, code), 0) + 1
            if code == 429:
                self.rejected += 1

    def connection_closed(self, reason: str) -> None:
        with self.lock:
            self.closed[reason] += 1

    def decoded(self, queued_s: float, decode_s: float, prompt_tokens: int, new_tokens: int) -> None:
        """One answer done: its wait in the queue, its decode time and its tokens."""
        with self.lock:
            self.queue_wait.observe(queued_s)
            self.decode.observe(decode_s)
            self.duration.observe(queued_s + decode_s)
            self.generated += new_tokens
            self.prompt_tokens += prompt_tokens
            r = self.recent_decode_s
            self.recent_decode_s = decode_s if r is None else r + RECENT_WEIGHT * (decode_s - r)

    def retry_after(self, ahead: int) -> int:
        """Seconds a refused client should wait: the answers ahead of it at the recent decode
        time, at least 1."""
        with self.lock:
            each = self.recent_decode_s or 1.0
        return max(1, int(each * ahead + 0.999))

    def render(self, queued: int, limit: int, in_flight: int, open_conns: int, idle_conns: int) -> str:
        with self.lock:
            out = ["# HELP swiftspec_http_requests_total HTTP answers sent, by route and status.",
                   "# TYPE swiftspec_http_requests_total counter"]
            out += [f'swiftspec_http_requests_total{{route="{r}",code="{c}"}} {n}'
                    for (r, c), n in sorted(self.answers.items())]
            for name, kind, value, text in (
                    ("swiftspec_queue_depth", "gauge", queued, "Requests waiting behind the one decoding."),
                    ("swiftspec_queue_limit", "gauge", limit, "Requests that may wait (--serve-max-queue)."),
                    ("swiftspec_requests_in_flight", "gauge", in_flight, "Requests decoding (0 or 1)."),
                    ("swiftspec_queue_rejected_total", "counter", self.rejected, "Requests refused with 429."),
                    ("swiftspec_generated_tokens_total", "counter", self.generated, "Tokens generated."),
                    ("swiftspec_prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens decoded."),
                    ("swiftspec_connections_open", "gauge", open_conns, "HTTP connections held."),
                    ("swiftspec_connections_idle", "gauge", idle_conns,
                     "HTTP connections held with no request queued or decoding.")):
                out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
            out += ["# HELP swiftspec_connections_closed_total Connections the server closed, by reason.",
                    "# TYPE swiftspec_connections_closed_total counter"]
            out += [f'swiftspec_connections_closed_total{{reason="{k}"}} {v}' for k, v in sorted(self.closed.items())]
            out += self.queue_wait.lines("swiftspec_queue_wait_seconds", "Time from submission to the start of decoding.")
            out += self.duration.lines("swiftspec_request_duration_seconds",
                                       "Time from submission to the last token, queue included.")
            out += self.decode.lines("swiftspec_decode_seconds", "Time from the start of decoding to the last token.")
        return "\n".join(out) + "\n"
