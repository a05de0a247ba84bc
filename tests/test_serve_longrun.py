"""`swiftspec run --serve` over time (tiny checkpoint, CPU, the loopback only).

One server (`async`, 2 ranks, module scope, trace rotated every ROTATE requests) takes, in this
order: a soak of SOAK_REQUESTS requests of 1-4 tokens from one keep-alive client (rank 0's RSS
after the first 500 and at the end within 5 %, the median latency of the last 500 at most 10 %
above the first 500's; the trace's files read back as one by `swiftspec analyze`); clients too slow for
the one deadline a request has (slow headers, slow body, a request line that stops, a silent
connection: 408 or a logged close by --serve-read-timeout); connections held idle beyond
--serve-max-idle; a full queue (429 with Retry-After; a queued stream has its headers at once and
": queued" comments; /health and /metrics show the queue); finally SIGINT: the last file holds
both groups' events and every rank's row. `-m soak` runs the long soak instead (LONG_SOAK
requests, the figures docs/serving.md quotes, printed with -s).
"""
from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import h5py
import pytest

from reliability_helpers import Job
from test_server import assert_both_groups, free_port, raw_request, wait_healthy

SOAK_REQUESTS = 1000      # the default suite's soak: first 500 vs last 500
LONG_SOAK = 10_000        # -m soak
WINDOW = 500
ROTATE = 250              # --trace-rotate of the server
READ_TIMEOUT = 1.5        # --serve-read-timeout
MAX_IDLE = 4              # --serve-max-idle
LONG = 3800               # --max-new-tokens: a request long enough to queue behind


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    """(port, job, trace path, rank 0's pid); the last test stops it with SIGINT."""
    out = tmp_path_factory.mktemp("longrun") / "serve.h5"
    port = free_port()
    job = Job(2, ["--serve", f"127.0.0.1:{port}", "--target", tiny_pair[0], "--draft", tiny_pair[1],
                  "--mode", "async", "--max-new-tokens", str(LONG), "--ignore-eos", "--quiet",
                  "--out", str(out), "--trace-rotate", str(ROTATE), "--serve-read-timeout", str(READ_TIMEOUT),
                  "--serve-max-queue", "1", "--serve-max-idle", str(MAX_IDLE)])
    try:
        wait_healthy(port, job, limit_s=150, poll_s=0.3)
        yield port, job, out, job.wait_ranks(2)[0]
    finally:
        job.kill()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def soak(port: int, pid: int, n: int) -> dict:
    """n completions of 1-4 tokens, one after another on one keep-alive connection ->
    {"rss_mb": [after WINDOW, at the end], "median_ms": [first WINDOW, last WINDOW], ...}."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    lat, rss = [], []
    t0 = time.monotonic()
    for i in range(n):
        body = json.dumps({"prompt": f"def f{i % 97}(x):", "max_tokens": 1 + i % 4})
        t = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        lat.append(time.perf_counter() - t)
        assert r.status == 200 and json.loads(data)["usage"]["completion_tokens"] == 1 + i % 4, data
        if i + 1 == WINDOW:
            rss.append(rss_mb(pid))
    rss.append(rss_mb(pid))
    conn.close()
    first, last = statistics.median(lat[:WINDOW]), statistics.median(lat[-WINDOW:])
    windows = [round(1e3 * statistics.median(lat[i:i + WINDOW]), 1) for i in range(0, n - WINDOW + 1, WINDOW)]
    return {"requests": n, "seconds": time.monotonic() - t0, "rss_mb": rss,
            "median_ms": [1e3 * first, 1e3 * last], "p99_ms": 1e3 * sorted(lat)[int(0.99 * n)],
            "window_medians_ms": windows}


def check_flat(fig: dict) -> None:
    print(f"\nsoak: {json.dumps(fig)}")
    (rss_a, rss_b), (first, last) = fig["rss_mb"], fig["median_ms"]
    assert abs(rss_b - rss_a) <= 0.05 * rss_a, f"rank 0 RSS {rss_a:.1f} -> {rss_b:.1f} MB"
    # grown by at most 10 % (a drop is the shared box's load easing, not the server)
    assert last <= 1.10 * first, f"median latency {first:.2f} -> {last:.2f} ms"


@pytest.mark.mpi
def test_soak_memory_latency_and_the_rotated_trace(server, tmp_path):
    port, job, out, pid = server
    fig = soak(port, pid, SOAK_REQUESTS)
    check_flat(fig)
    # the trace: --out, then STEM.1.h5 ...; the files written so far read back as one
    segments = sorted(out.parent.glob("serve*.h5"))
    assert len(segments) == SOAK_REQUESTS // ROTATE + (SOAK_REQUESTS % ROTATE > 0) or \
        len(segments) == SOAK_REQUESTS // ROTATE, segments
    with h5py.File(out.parent / "serve.1.h5", "r") as f:      # a closed segment: every rank's events
        assert f.attrs["exit_status"] == "rotated" and f.attrs["segment"] == 1
        assert set(f["events"]["role"].tolist()) == {0, 1} and len(f["requests"]) == ROTATE
    r = subprocess.run([sys.executable, "-m", "swiftspec_mpi", "analyze", str(out.parent / "serve*.h5"),
                        "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["n_requests"] >= (SOAK_REQUESTS // ROTATE) * ROTATE and len(s["files"]) == len(segments)
    assert sorted(s["roles"]) == ["draft", "verify"]


@pytest.mark.mpi
@pytest.mark.soak
def test_long_soak(server):
    """-m soak -s: LONG_SOAK requests; the figures docs/serving.md quotes."""
    port, job, out, pid = server
    check_flat(soak(port, pid, LONG_SOAK))


def dribble(port: int, first: bytes, piece: bytes, every_s: float, until_s: float):
    """Send `first`, then `piece` every `every_s` s (until the server closes or `until_s`) ->
    (seconds until the server's answer or close, the bytes it sent)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(first)
    t = time.monotonic()
    got = b""
    s.settimeout(every_s)
    try:
        while time.monotonic() - t < until_s:
            try:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
                if b"\r\n\r\n" in got:
                    break
            except TimeoutError:
                if piece:
                    s.sendall(piece)
    except (ConnectionError, OSError):
        pass
    finally:
        s.close()
    return time.monotonic() - t, got


@pytest.mark.mpi
def test_one_deadline_a_request(server):
    """Headers or a body dribbled a byte at a time, a request line that stops half way: 408 in
    OpenAI's error shape by --serve-read-timeout; a connection that sends nothing: closed by
    then, one line on stderr. (Before, each read had its own timeout: dribbled headers passed.)"""
    port, job, _, _ = server
    cases = {
        "slow headers": (b"GET /health HTTP/1.1\r\n", b"X", 0.2),
        "slow body": (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 400\r\n\r\n{", b" ", 0.2),
        "stalled request line": (b"GET /hea", b"", 0.2),
        "silent": (b"", b"", 0.2),
    }
    got = {}
    threads = [threading.Thread(target=lambda k=k, a=a: got.__setitem__(k, dribble(port, *a, until_s=10)))
               for k, a in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for name, (seconds, data) in got.items():
        assert READ_TIMEOUT - 0.3 < seconds < READ_TIMEOUT + 1.5, (name, seconds, data[:200])
        if name == "silent":
            assert data == b"", data
        else:
            assert data.startswith(b"HTTP/1.1 408 "), (name, data[:300])
            body = data.split(b"\r\n\r\n", 1)[1] if data.count(b"\r\n\r\n") else b""
            if not body:   # the body may come in a later packet
                continue
            e = json.loads(body)["error"]
            assert e["code"] == "timeout" and set(e) == {"message", "type", "param", "code"}
    status, _, _ = raw_request(port, b"GET /health HTTP/1.1\r\n\r\n")
    assert status == 200


@pytest.mark.mpi
def test_idle_connections_are_capped(server):
    """MAX_IDLE + 2 connections that send nothing: the two oldest are closed at once (a line on
    stderr each), the rest by the deadline; the server still answers."""
    port, job, _, _ = server
    conns = []
    for _ in range(MAX_IDLE + 2):
        conns.append(socket.create_connection(("127.0.0.1", port)))
        time.sleep(0.05)
    t = time.monotonic()
    for c in conns[:2]:
        c.settimeout(READ_TIMEOUT + 3)
        assert c.recv(1) == b""
    assert time.monotonic() - t < READ_TIMEOUT / 2
    for c in conns:
        c.close()
    status, _, body = raw_request(port, b"GET /health HTTP/1.1\r\n\r\n")
    assert status == 200 and json.loads(body)["connections"]["max_idle"] == MAX_IDLE


def metrics(port: int) -> dict[str, float]:
    status, headers, body = raw_request(port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.mark.mpi
def test_full_queue_429_and_a_queued_stream_hears_at_once(server):
    """--serve-max-queue 1: a long stream decodes, a second stream queues (200 and its headers at
    once, then ": queued, position 2"), a third request gets 429 with Retry-After in the error
    shape; /health and /metrics show the queue; the first client leaves, the queued one is answered."""
    port, job, _, _ = server
    first = socket.create_connection(("127.0.0.1", port))
    first.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (
        len(b := json.dumps({"prompt": "def f(x):", "stream": True}).encode()), b))
    first.settimeout(30)
    seen = b""
    while b"data: " not in seen:
        seen += first.recv(65536)
    second = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}).encode()
    t = time.monotonic()
    second.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    second.settimeout(30)
    head = b""
    while b"\r\n\r\n" not in head:
        head += second.recv(65536)
    assert head.startswith(b"HTTP/1.1 200 ") and time.monotonic() - t < 1.0, head
    while b": queued, position 2" not in head:
        head += second.recv(65536)
    status, headers, text = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                                        % (len(body), body))
    assert status == 429 and int(headers["retry-after"]) >= 1, (status, headers)
    e = json.loads(text)["error"]
    assert e["code"] == "queue_full" and e["type"] == "rate_limit_error"
    status, _, health = raw_request(port, b"GET /health HTTP/1.1\r\n\r\n")
    h = json.loads(health)
    assert h["queued"] == 1 and h["max_queue"] == 1 and h["active"]["stream"] is True, h
    m = metrics(port)
    assert m["swiftspec_queue_depth"] == 1 and m["swiftspec_requests_in_flight"] == 1
    assert m['swiftspec_http_requests_total{route="/v1/completions",code="429"}'] >= 1
    assert m["swiftspec_queue_rejected_total"] >= 1 and m["swiftspec_generated_tokens_total"] > 0
    assert m['swiftspec_request_duration_seconds_bucket{le="+Inf"}'] == m["swiftspec_request_duration_seconds_count"]
    first.close()                                  # the stream in flight ends, the queued one runs
    while not head.endswith(b"data: [DONE]\n\n"):
        chunk = second.recv(65536)
        assert chunk, head
        head += chunk
    second.close()
    texts = [json.loads(e)["choices"][0]["text"] for e in re.findall(rb"data: (\{.*?\})\n\n", head)]
    assert len(texts) >= 2


@pytest.mark.mpi
def test_sigint_writes_both_groups(server):
    """Last: SIGINT (Ctrl-C) to mpiexec; exit 4, the newest trace file holds both groups' events,
    every rank's row and no missing rank; no traceback."""
    port, job, out, _ = server
    body = b'{"prompt": "x", "max_tokens": 1}'
    status, _, _ = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
                               % (len(body), body))
    assert status == 200
    job.proc.send_signal(signal.SIGINT)
    rc = job.finish(timeout=60)
    assert rc == 4, job.report()
    assert "Traceback" not in job.stderr, job.stderr
    newest = max(out.parent.glob("serve*.h5"), key=lambda p: h5py.File(p, "r").attrs["segment"])
    with h5py.File(newest, "r") as f:
        assert f.attrs["exit_status"] == "interrupted"
    assert_both_groups(newest)
    assert "no request within" in job.stderr and "did not arrive within" in job.stderr
    assert "--serve-max-idle" in job.stderr
