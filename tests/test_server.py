"""`swiftspec run --serve`: the OpenAI-style HTTP endpoint on rank 0 (tiny checkpoint, CPU).

One server (`async`, 2 ranks) answers: a completion equal to the batch `ar` run's text, a
streamed chat completion equal to the same request unstreamed, a stop string cut out, two
requests at once (queued, both answered), the models list and the errors (400 / 404); SIGTERM
then ends it with exit 4 and every answered request in the trace. Refusals before any rank
loads weights: --serve with --prompt, a bad address, a port in use.
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine_helpers import batch_ar, read_requests, read_root, run_swiftspec
from reliability_helpers import Job

from swiftspec_mpi.serve.http_server import cut_at_stop

pytestmark = pytest.mark.mpi
PROMPTS = ["Write a haiku about message passing.", "def add(a, b):"]
NEW = 24
LONG = 3000          # the server's --max-new-tokens: a long answer to walk away from


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, path: str, body=None, raw: bytes | None = None, timeout: float = 60):
    """-> (status, parsed JSON or the raw text of a stream)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, (text if text.startswith("data:") else json.loads(text))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def sse_text(stream: str, chat: bool) -> tuple[str, str]:
    """Concatenated deltas and the finish reason of an event stream."""
    text, finish = "", None
    events = [e[len("data: "):] for e in stream.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", stream
    for e in events[:-1]:
        c = json.loads(e)["choices"][0]
        text += (c["delta"].get("content", "") if chat else c["text"])
        finish = c["finish_reason"] or finish
    return text, finish


def test_cut_at_stop():
    assert cut_at_stop("abc STOP def", ["STOP"]) == "abc " and cut_at_stop("abc", ["x", "b"]) == "a"
    assert cut_at_stop("abc", []) == "abc"


@pytest.fixture(scope="module")
def batch_texts(tiny_pair, tmp_path_factory):
    return [q["text"] for q in batch_ar(tiny_pair[0], tmp_path_factory.mktemp("batch"), PROMPTS, NEW)]


def test_server_answers_like_the_batch_run_streams_queues_and_stops(tiny_pair, batch_texts, tmp_path):
    out = tmp_path / "serve.h5"
    port = free_port()
    job = Job(2, ["--serve", f"127.0.0.1:{port}", "--target", tiny_pair[0], "--draft", tiny_pair[1],
                  "--mode", "async", "--max-new-tokens", str(LONG), "--ignore-eos", "--out", str(out)])
    try:
        deadline = time.monotonic() + 150
        while True:
            try:
                if call(port, "/health", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            assert job.proc.poll() is None and time.monotonic() < deadline, job.communicate(5)
            time.sleep(0.3)
        status, models = call(port, "/v1/models")
        assert status == 200 and models["data"][0]["id"] == "target"

        # a completion: the batch run's text, token for token
        status, r = call(port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW})
        assert status == 200, r
        assert r["choices"][0]["text"] == batch_texts[0] and r["choices"][0]["finish_reason"] == "length"
        assert r["usage"]["completion_tokens"] == NEW and r["swiftspec"]["mode"] == "async"

        # a stop string from inside that text: cut before it, finish "stop"
        stop = batch_texts[0][len(batch_texts[0]) // 2:][:4]
        status, r = call(port, "/v1/completions", {"prompt": PROMPTS[0], "stop": [stop]})
        assert status == 200 and r["choices"][0]["finish_reason"] == "stop", r
        assert r["choices"][0]["text"] == cut_at_stop(batch_texts[0], [stop])
        status, s = call(port, "/v1/completions", {"prompt": PROMPTS[0], "stop": stop, "stream": True})
        assert status == 200 and sse_text(s, chat=False) == (cut_at_stop(batch_texts[0], [stop]), "stop")

        # a chat completion, streamed and not: the same text
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
        status, whole = call(port, "/v1/chat/completions", body)
        assert status == 200 and whole["object"] == "chat.completion"
        status, s = call(port, "/v1/chat/completions", {**body, "stream": True})
        assert status == 200
        assert sse_text(s, chat=True) == (whole["choices"][0]["message"]["content"], "length")

        # two at once: queued, both answered in full
        got = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, call(port, "/v1/completions",
                                                                                {"prompt": PROMPTS[i], "max_tokens": NEW})))
                   for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got[i][1]["choices"][0]["text"] for i in (0, 1)] == batch_texts

        # a streaming client that leaves after the first event: its request ends early
        # ("cancelled"), and the next one is answered at once
        conn = socket.create_connection(("127.0.0.1", port))
        body = json.dumps({"prompt": PROMPTS[1], "stream": True}).encode()
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got_bytes = b""
        conn.settimeout(60)
        while b"data: " not in got_bytes:          # the headers come first, then the events
            chunk = conn.recv(4096)
            assert chunk, got_bytes
            got_bytes += chunk
        conn.close()
        t = time.monotonic()
        status, r = call(port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW})
        assert status == 200 and r["choices"][0]["text"] == batch_texts[0]
        left = time.monotonic() - t

        # refusals: 400 with OpenAI's error shape, 404
        for raw in (b"{bad", json.dumps({"prompt": ""}).encode(), json.dumps({"prompt": "x", "max_tokens": LONG + 1}).encode(),
                    json.dumps({"prompt": "x", "stop": [3]}).encode()):
            status, e = call(port, "/v1/completions", raw=raw)
            assert status == 400 and e["error"]["type"] == "invalid_request_error", (raw, e)
        assert call(port, "/v1/chat/completions", {"messages": []})[0] == 400
        assert call(port, "/v1/embeddings", {"input": "x"})[0] == 404

        job.proc.send_signal(signal.SIGTERM)
        rc = job.finish(timeout=60)
    finally:
        job.kill()
    assert rc == 4, job.report()
    root = read_root(out)
    assert root["exit_status"] == "interrupted"
    reqs = read_requests(out)
    assert len(reqs) == 9 and {q["category"] for q in reqs} == {"server"}
    assert reqs[7]["stop_reason"] == "cancelled" and len(reqs[7]["output_ids"]) < LONG, reqs[7]["stop_reason"]
    assert left < 30, left
    assert "serving http://127.0.0.1:" in job.stderr


@pytest.mark.parametrize("extra, pattern", [
    (["--prompt", "x"], "--serve takes its prompts from HTTP requests"),
    (["--serve-bad"], None),
])
def test_serve_refusals(tiny_pair, tmp_path, extra, pattern):
    if extra == ["--serve-bad"]:
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            for spec, expect in ((f"127.0.0.1:{port}", "cannot listen on"), ("host:notaport", "give [HOST:]PORT")):
                r = run_swiftspec(2, ["--serve", spec, "--target", tiny_pair[0], "--mode", "ar",
                                      "--out", str(tmp_path / "x.h5")], check=False)
                assert r.returncode == 2 and expect in r.stderr, r.stderr
                assert r.stderr.count("swiftspec run: error:") == 1
        finally:
            taken.close()
        return
    r = run_swiftspec(2, ["--serve", "0", "--target", tiny_pair[0], "--mode", "ar", *extra,
                          "--out", str(tmp_path / "x.h5")], check=False)
    assert r.returncode == 2 and pattern in r.stderr, r.stderr
