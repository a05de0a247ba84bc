"""`swiftspec run --serve`: the OpenAI-style HTTP endpoint on rank 0 (tiny checkpoint, CPU).

One server (`async`, 2 ranks, module scope) answers, in this order: a completion equal to the
batch `ar` run's text, a streamed chat completion equal to the same request unstreamed, a stop
string cut out, two requests at once, a streaming client that leaves; the official `openai`
client's calls (content parts, n, logprobs checked against transformers' forward of the target,
stream_options.include_usage, models.retrieve, the refusals it surfaces as exceptions); raw
sockets for what a client library never sends (bad Unicode, deep nesting, a 100 MB body, lying
Content-Lengths, slow clients, wrong methods, broken request lines), each followed by a good
request; a seeded loop of malformed requests; finally SIGTERM with a stream in flight and two
requests queued (a last chunk with finish_reason "interrupted" and [DONE]; 503s), exit 4,
every answered request in the trace and no traceback on stderr. Plus the unit checks of the
request parsing (openai_api) and the refusals before any rank loads weights.
"""
from __future__ import annotations

import json
import random
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine_helpers import batch_ar, read_requests, read_root, run_swiftspec
from reliability_helpers import Job

from swiftspec_mpi.serve import openai_api as api
from swiftspec_mpi.serve.http_server import cut_at_stop

PROMPTS = ["Write a haiku about message passing.", "def add(a, b):"]
NEW = 24
LONG = 3800          # the server's --max-new-tokens: a long answer to walk away from
MAX_BODY = 65536     # the server's --serve-max-body
READ_TIMEOUT = 2.0   # the server's --serve-read-timeout
SEED = 20261202


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(port: int, path: str, body=None, raw: bytes | None = None, timeout: float = 60, method=None):
    """-> (status, parsed JSON or the raw text of a stream)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            stream = r.headers.get("Content-Type", "").startswith("text/event-stream")
            return r.status, (text if stream else json.loads(text))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def wait_healthy(port: int, job: Job, limit_s: float, poll_s: float) -> None:
    """Poll GET /health until it answers 200; fail with the job's output if it dies or `limit_s` passes."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            if call(port, "/health", timeout=2)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        assert job.proc.poll() is None and time.monotonic() < deadline, job.communicate(5)
        time.sleep(poll_s)


def raw_request(port: int, data: bytes, timeout: float = 30, after=None) -> tuple[int, dict, bytes]:
    """Send `data` on a fresh connection (then `after(sock)` in a thread, if given) and read one
    response -> (status, headers lower-cased, body bytes). The status line must be there."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(timeout)
    try:
        s.sendall(data)
    except OSError:
        pass
    if after is not None:
        threading.Thread(target=after, args=(s,), daemon=True).start()
    got = b""
    try:
        while True:
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep:
                m = re.search(rb"(?i)content-length: *(\d+)", head)
                if data.startswith(b"HEAD ") or (m and len(body) >= int(m.group(1))):
                    break
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert re.match(r"HTTP/1\.[01] \d{3} ", lines[0]), got[:300]
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def post_bytes(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def error_of(status: int, body: bytes, want: int) -> dict:
    """The OpenAI error object of a refusal, checked."""
    assert status == want, (status, body[:300])
    e = json.loads(body)["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    return e


def assert_both_groups(path) -> None:
    """The trace of a stopped server has events of the verify and the draft group and every
    rank's row (a signal gathers them all), and names no rank as missing."""
    import h5py
    with h5py.File(path, "r") as f:
        assert set(f["events"]["role"].tolist()) == {0, 1}, "a group's events are missing"
        assert sorted(f["ranks"]["rank"].tolist()) == [0, 1]
        assert json.loads(f.attrs["ranks_missing"]) == []


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


class _Tok:
    """One token per character; the 'template' tags each message."""

    def encode(self, text):
        return [ord(c) for c in text]

    def render_conversation(self, messages):
        if messages[-1]["content"] == "raise":
            raise ValueError("Conversation roles must alternate")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def _ask(kind, body, room=100):
    return api.parse_ask(kind, body, _Tok(), room, 50, {"temperature": 0.0, "seed": 0}, ("m", "/x/m", "swiftspec"))


def test_request_parsing_accepts_what_clients_send_and_refuses_the_rest():
    chat = _ask("chat", {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]},
                                      {"role": "assistant", "content": None},
                                      {"role": "developer", "content": "d"}],
                         "model": "swiftspec", "temperature": 0, "seed": 0, "top_p": 1, "n": 3,
                         "logprobs": True, "top_logprobs": 2, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert "".join(map(chr, chat.ids)) == "<system>a\nb<assistant><system>d"
    assert (chat.n, chat.logprobs, chat.include_usage, chat.max_tokens) == (3, 2, True, 50)
    assert _ask("text", {"prompt": ["p"], "logprobs": 0}).logprobs == 0
    assert _ask("text", {"prompt": "p"}).logprobs is None
    refused = [
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         400, "messages[0].content[0]"),
        ("chat", {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
        ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]}, 400,
         "messages[0].tool_calls"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": "raise"}]}, 400, "messages"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
        ("text", {"prompt": "p", "model": "gpt-4"}, 404, "model"),
        ("text", {"prompt": "p", "temperature": 0.7}, 400, "temperature"),
        ("text", {"prompt": "p", "seed": 1}, 400, "seed"),
        ("text", {"prompt": "p", "top_p": 0.9}, 400, "top_p"),
        ("text", {"prompt": "p", "n": 9}, 400, "n"),
        ("text", {"prompt": "p", "logprobs": 6}, 400, "logprobs"),
        ("text", {"prompt": "p", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("text", {"prompt": "p", "tools": [{}]}, 400, "tools"),
        ("text", {"prompt": "p", "echo": True}, 400, "echo"),
        ("text", {"prompt": "p" * 101}, 400, "prompt"),
        ("text", {"prompt": "p", "max_tokens": 51}, 400, "max_tokens"),
    ]
    for kind, body, status, param in refused:
        with pytest.raises(api.ApiError) as e:
            _ask(kind, body)
        assert (e.value.status, e.value.param) == (status, param), (body, e.value.message)
    for raw, param in ((b'{"prompt": "\\ud800"}', "prompt"), (b'{"a": {"\\udfff": 1}}', "a"),
                       (b"[" * 100 + b"]" * 100, "[0]" * 33), (b"[" * 100000, None), (b"\xff{}", None),
                       (b'{"n": 1' + b"0" * 5000 + b"}", None)):
        with pytest.raises(api.ApiError) as e:
            api.parse_body(raw)
        assert e.value.status == 400 and e.value.param == param, (raw[:20], e.value.message, e.value.param)


# ----------------------------------------------------------------------------- one server

@pytest.fixture(scope="module")
def batch_texts(tiny_pair, tmp_path_factory):
    return [q["text"] for q in batch_ar(tiny_pair[0], tmp_path_factory.mktemp("batch"), PROMPTS, NEW)]


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory):
    """(port, job, trace path) of the module's server; the last test stops it with SIGTERM."""
    out = tmp_path_factory.mktemp("serve") / "serve.h5"
    port = free_port()
    job = Job(2, ["--serve", f"127.0.0.1:{port}", "--target", tiny_pair[0], "--draft", tiny_pair[1],
                  "--mode", "async", "--max-new-tokens", str(LONG), "--ignore-eos", "--out", str(out),
                  "--serve-max-body", str(MAX_BODY), "--serve-read-timeout", str(READ_TIMEOUT)])
    try:
        wait_healthy(port, job, limit_s=150, poll_s=0.3)
        yield port, job, out
    finally:
        job.kill()


def good(port: int) -> None:
    """A request that must succeed after whatever came before."""
    status, r = call(port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 200 and r["usage"]["completion_tokens"] == 2, r


@pytest.mark.mpi
def test_server_answers_like_the_batch_run_streams_queues_and_cancels(server, batch_texts):
    port, job, _ = server
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

    # clients that leave: a stream after its first event, an unstreamed request while it runs;
    # each ends early ("cancelled"), and the next request is answered at once
    for stream in (True, False):
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(post_bytes("/v1/completions", json.dumps({"prompt": PROMPTS[1], "stream": stream}).encode()))
        if stream:
            got_bytes = b""
            conn.settimeout(60)
            while b"data: " not in got_bytes:          # the headers come first, then the events
                chunk = conn.recv(4096)
                assert chunk, got_bytes
                got_bytes += chunk
        else:
            time.sleep(0.5)
        conn.close()
        t = time.monotonic()
        status, r = call(port, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": NEW})
        assert status == 200 and r["choices"][0]["text"] == batch_texts[0]
        assert time.monotonic() - t < 30


@pytest.mark.mpi
def test_openai_client(server, tiny_pair):
    import openai
    port, job, _ = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.models.retrieve("target").id == "target"
    assert [m.id for m in client.models.list()] == ["target"]

    # content parts and an assistant turn without content; the same prompt as plain strings
    parts = client.chat.completions.create(model="target", max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "Go on"}])
    plain = client.chat.completions.create(model="swiftspec", max_tokens=8, messages=[
        {"role": "user", "content": "Hello\nthere"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "Go on"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens == 8

    # n = 2, streamed with usage: two full answers (equal at temperature 0), then the usage chunk
    chunks = list(client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=6, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        texts[c.choices[0].index] += c.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert texts[0] == texts[1] and texts[0]
    whole = client.completions.create(model="target", prompt=PROMPTS[1], max_tokens=6, n=2)
    assert [c.text for c in whole.choices] == [texts[0]] * 2 and [c.index for c in whole.choices] == [0, 1]

    # log-probabilities: the target's own (transformers' forward of the same checkpoint)
    r = client.chat.completions.create(model="target", max_tokens=6, logprobs=True, top_logprobs=3,
                                       messages=[{"role": "user", "content": "Hello"}])
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 3 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == r.choices[0].message.content
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)      # greedy: the best
    comp = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=NEW, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == NEW
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    _check_logprobs_against_transformers(tiny_pair[0], PROMPTS[0], lp.token_logprobs, lp.top_logprobs)
    streamed = list(client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=NEW, logprobs=2,
                                              stream=True))
    # (the same tokens; the values agree to float32 rounding: each step's tree batches other rows)
    assert sum((c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else [] for c in streamed), []) \
        == pytest.approx(lp.token_logprobs, abs=1e-4)

    # what the client surfaces as exceptions
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    for kwargs in ({"temperature": 0.7}, {"seed": 7}, {"n": 9}, {"top_p": 0.5}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="target", prompt="x", max_tokens=2, **kwargs)
        assert e.value.body["param"] == next(iter(kwargs)), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="target", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "text only" in e.value.body["message"]
    assert client.completions.create(model="target", prompt="x", max_tokens=2, temperature=0, seed=0).choices
    good(port)


def _check_logprobs_against_transformers(target: str, prompt: str, token_logprobs, top_logprobs) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from swiftspec_mpi.checkpoints.tokenizer import TextTokenizer
    tok = TextTokenizer.from_hf_folder(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt_ids = tok.encode(prompt)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(len(token_logprobs)):      # greedy, as the server at temperature 0
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for j, got in enumerate(token_logprobs):
        row = lps[len(prompt_ids) - 1 + j]
        assert abs(got - float(row[ids[len(prompt_ids) + j]])) < 1e-3, (j, got)
        best = sorted(top_logprobs[j].values(), reverse=True)      # two tokens may print alike
        assert abs(best[0] - float(row.max())) < 1e-3 and 1 <= len(best) <= 2


@pytest.mark.mpi
def test_raw_requests_are_refused_in_the_error_shape_and_the_server_goes_on(server):
    port, job, _ = server
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    cases = [  # (request bytes, status, what the message says)
        (post_bytes("/v1/completions", b'{"prompt": "a\\ud800b"}'), 400, "lone surrogate"),
        (post_bytes("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'), 400,
         "lone surrogate"),
        (post_bytes("/v1/completions", b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}"), 400, "nested"),
        (post_bytes("/v1/completions", b'{"prompt": "\xff\xfe"}'), 400, "UTF-8"),
        (post_bytes("/v1/completions", b"{bad"), 400, "not valid JSON"),
        (post_bytes("/v1/completions", json.dumps({"prompt": "x" * 30000}).encode()), 400, "bytes, more than"),
        (post_bytes("/v1/completions", json.dumps({"prompt": "word " * 130}).encode()), 400, "has room for 120"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -4\r\n\r\n", 400, "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 12abc\r\n\r\n", 400, "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
         "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\n\r\n", 411, "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "Transfer-Encoding"),
        (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "chunk size"),
        (post_bytes("/v1/completions", b"x" * (MAX_BODY + 1)), 413, "--serve-max-body"),
        (b"PUT /v1/completions HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405, "POST"),
        (b"DELETE /v1/models HTTP/1.1\r\n\r\n", 405, "GET"),
        (b"OPTIONS /v1/chat/completions HTTP/1.1\r\n\r\n", 405, "POST"),
        (b"BREW /v1/completions HTTP/1.1\r\n\r\n", 405, "not allowed"),
        (b"GET /v1/completions HTTP/1.1\r\n\r\n", 405, "POST"),
        (b"GET /v1/embeddings HTTP/1.1\r\n\r\n", 404, "no route"),
        (b"GET /v1/models/gpt-4o HTTP/1.1\r\n\r\n", 404, "does not exist"),
        (post_bytes("/v1/completions", b'{"prompt": "x", "model": "gpt-4o"}'), 404, "does not exist"),
        (b"\x00\xff\r\n\r\n", 400, "HTTP"),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414, "HTTP 414"),
        (b"GET /health HTTP/1.1\r\n" + b"X-A: b\r\n" * 150 + b"\r\n", 431, "headers"),
        (b"GET /health HTTP/7.0\r\n\r\n", 505, "HTTP"),
    ]
    for data, status, says in cases:
        got, headers, text = raw_request(port, data)
        e = error_of(got, text, status)
        assert says in e["message"], (data[:60], e)
        if status == 405:
            assert headers.get("allow"), headers
        good(port)
    # a chunked body is read like any other
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    status, _, text = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  + chunked + b"0\r\n\r\n")
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
    # HEAD: the headers of GET
    status, headers, text = raw_request(port, b"HEAD /v1/models HTTP/1.1\r\n\r\n", timeout=5)
    assert status == 200 and text == b"" and int(headers["content-length"]) > 0

    # a Content-Length larger than the body, a client too slow: 408 after --serve-read-timeout
    for data in (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + body[:20],
                 b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n"):
        t = time.monotonic()
        status, _, text = raw_request(port, data)
        error_of(status, text, 408)
        assert READ_TIMEOUT - 0.5 < time.monotonic() - t < READ_TIMEOUT + 5
        good(port)
    # the body ends early (the client closes its side): 400
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + body[:20])
    s.shutdown(socket.SHUT_WR)
    s.settimeout(30)
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    s.close()
    assert reply.startswith(b"HTTP/1.1 400 ") and b"ended after 20 of the 100 bytes" in reply, reply

    # 100 MB announced and sent: 413 from the headers; the server stops reading long before
    sent = [0]

    def flood(sock):
        block = b"x" * (1 << 20)
        try:
            for _ in range(100):
                sock.sendall(block)
                sent[0] += len(block)
        except OSError:
            pass
    t = time.monotonic()
    status, _, text = raw_request(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 104857600\r\n\r\n",
                                  after=flood)
    assert "104857600 bytes" in error_of(status, text, 413)["message"]
    time.sleep(1.0)
    assert sent[0] < 30 * (1 << 20) and time.monotonic() - t < 10, sent[0]
    good(port)


def _hostile(rng: random.Random, body: bytes) -> tuple[bytes, set[int]]:
    """One malformed request and the statuses it may get."""
    pick = rng.randrange(9)
    if pick == 0:      # random bytes as the body
        return post_bytes("/v1/completions", rng.randbytes(rng.randrange(1, 300))), {400}
    if pick == 1:      # a valid body cut short
        return post_bytes("/v1/chat/completions", body[:rng.randrange(1, len(body) - 1)]), {400}
    if pick == 2:      # bytes of a valid body flipped (may stay valid, or name another model)
        b = bytearray(body)
        for _ in range(rng.randrange(1, 4)):          # after "max_tokens": 1 (keeps answers short)
            b[rng.randrange(len(b'{"max_tokens": 1, '), len(b))] = rng.randrange(256)
        return post_bytes("/v1/completions", bytes(b)), {200, 400, 404}
    if pick == 3:      # escapes that JSON allows but Unicode does not
        esc = rng.choice(["\\ud800", "\\udfff", "\\udbff\\u0041", "\\u0000", "\\ud83d\\ude00"])
        ok = esc in ("\\u0000", "\\ud83d\\ude00")
        return post_bytes("/v1/completions", b'{"max_tokens": 1, "prompt": "a' + esc.encode() + b'"}'), \
            ({200} if ok else {400})
    if pick == 4:      # a lying or broken Content-Length (never larger than the body: no 408 wait)
        v = rng.choice(["-1", "abc", "1e3", "0x10", " ", "99999999999999999999", "+5"])
        return f"POST /v1/completions HTTP/1.1\r\nContent-Length: {v}\r\n\r\n".encode() + body, {400, 413}
    if pick == 5:      # wrong types in a well-formed body
        key = rng.choice(["prompt", "max_tokens", "stop", "stream", "n", "logprobs", "model", "stream_options"])
        val = rng.choice([None, [], {}, -1, 1e308, True, "x" * 3, [1, 2], {"a": [1]}])
        val = 0 if key == "max_tokens" and val is None else val
        obj = {"prompt": "hi", "max_tokens": 1, key: val}
        return post_bytes("/v1/completions", json.dumps(obj).encode()), {200, 400, 404}
    if pick == 6:      # a method, a path, a version of any kind
        method = rng.choice(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "X" * 20, "g\x01t"])
        path = rng.choice(["/", "/v1", "/v1/models/%ff%fe", "/v1/completions?x=\xff", "*", "/../../etc/passwd"])
        return f"{method} {path} HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode("latin-1"), {400, 404, 405}
    if pick == 7:      # headers in odd encodings and shapes
        h = rng.choice([b"X: \xff\xfe\r\n", b"NoColon\r\n", b" folded: x\r\n", b"X: " + b"a" * 70000 + b"\r\n"])
        return b"GET /health HTTP/1.1\r\n" + h + b"\r\n", {200, 400, 431}
    depth = rng.choice([40, 1000, 20000, 100000])      # deep nesting in a field
    nested = b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"
    return post_bytes("/v1/completions", nested), {413 if len(nested) > MAX_BODY else 400}


@pytest.mark.mpi
def test_hostile_input_loop(server):
    """A seeded, bounded loop of malformed requests: every answer has a status line and, but for
    HEAD, JSON (an OpenAI error object on a refusal); the server answers a good request after."""
    port, job, _ = server
    rng = random.Random(SEED)
    body = json.dumps({"max_tokens": 1, "model": "target", "messages": [{"role": "user", "content": "hé"}]}).encode()
    for i in range(120):
        data, allowed = _hostile(rng, body)
        status, _, text = raw_request(port, data)
        assert status in allowed, (i, data[:80], status, text[:200])
        if data.startswith(b"HEAD "):
            continue
        if status == 200 and b"data: " in text[:6]:          # a stream ("stream": true)
            events = [e[len("data: "):] for e in text.decode().split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e)["choices"] is not None for e in events[:-1])
            continue
        obj = json.loads(text)
        if status >= 400:
            error_of(status, text, status)
        else:
            assert "error" not in obj
        assert job.proc.poll() is None
    good(port)


@pytest.mark.mpi
def test_sigterm_ends_the_stream_in_flight_and_refuses_the_queue(server):
    """Last in the module: SIGTERM while a stream runs and two requests queue. The stream gets
    a last chunk (finish_reason "interrupted") and [DONE], the queued ones 503 in the error
    shape (the streamed one as an error event after its headers), the job exits 4 with every
    request in the trace; rank 0 printed no traceback."""
    port, job, out = server
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(post_bytes("/v1/completions", json.dumps({"prompt": PROMPTS[1], "stream": True}).encode()))
    conn.settimeout(60)
    stream = b""
    while b"data: " not in stream:
        chunk = conn.recv(65536)
        assert chunk, stream
        stream += chunk
    queued = {}
    threads = [threading.Thread(target=lambda i=i, s=s: queued.__setitem__(i, call(
        port, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": s}))) for i, s in ((0, False), (1, True))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while call(port, "/health")[1]["queued"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    job.proc.send_signal(signal.SIGTERM)
    while chunk := conn.recv(65536):
        stream += chunk
    conn.close()
    for t in threads:
        t.join(30)
    rc = job.finish(timeout=60)
    assert rc == 4, job.report()
    text = stream.decode()
    events = [e[len("data: "):] for e in text.split("\r\n\r\n", 1)[1].split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "interrupted", text[-500:]
    status, e = queued[0]           # unstreamed: 503 in the error shape
    assert status == 503 and e["error"]["code"] == "server_shutting_down", queued[0]
    status, s = queued[1]           # streamed: its headers came at once, then the error as an event
    assert status == 200 and json.loads(s.split("data: ", 1)[1])["error"]["code"] == "server_shutting_down", s
    assert "[DONE]" not in s
    assert "Traceback" not in job.stderr, job.stderr
    assert "serving http://127.0.0.1:" in job.stderr
    assert "disconnected" in job.stderr                 # the clients that left: one line each
    root = read_root(out)
    assert root["exit_status"] == "interrupted"
    assert_both_groups(out)
    reqs = read_requests(out)
    assert {q["category"] for q in reqs} == {"server"}
    assert [q["stop_reason"] for q in reqs].count("cancelled") == 2
    assert reqs[-1]["stop_reason"] == "interrupted" and 0 < len(reqs[-1]["output_ids"]) < LONG
    room = int(re.search(r"up to (\d+) prompt tokens", job.stderr).group(1))
    assert room == 4096 - LONG - (16 + 2 * 16 + 1024 // 8)      # the flags alone fix it (job.interactive_room)


@pytest.mark.mpi
@pytest.mark.parametrize("extra, pattern", [
    (["--prompt", "x"], "--serve takes its prompts from HTTP requests"),
    (["--serve-max-body", "10"], "--serve-max-body must be at least 1024 bytes"),
    (["--serve-read-timeout", "0"], "--serve-read-timeout must be positive"),
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


@pytest.mark.gpu
@pytest.mark.mpi
def test_gpu_serve_logprobs_through_the_graphs(tmp_path):
    """bf16 on a GPU (CUDA graphs, the argmax read inside them): a request with log-probabilities
    takes the logits graphs instead (captured at its first step) and commits the same tokens;
    its log-probabilities are the best of their top_logprobs (greedy). Skipped without CUDA."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import subprocess
    import sys
    d = tmp_path / "tiny64"
    subprocess.run([sys.executable, "-m", "swiftspec_mpi", "tiny-checkpoint", str(d), "--hidden", "256",
                    "--heads", "4", "--kv-heads", "2", "--intermediate", "512"], check=True, timeout=300)
    out, port = tmp_path / "gpu.h5", free_port()
    job = Job(2, ["--serve", f"127.0.0.1:{port}", "--target", str(d / "target"), "--draft", str(d / "draft"),
                  "--mode", "async", "--device", "cuda", "--dtype", "bfloat16", "--max-new-tokens", "64",
                  "--ignore-eos", "--out", str(out)])
    try:
        wait_healthy(port, job, limit_s=300, poll_s=0.5)
        body = {"prompt": PROMPTS[0], "max_tokens": 64}
        timed = {}
        for name, extra in (("plain", {}), ("logprobs", {"logprobs": 3}), ("plain again", {}),
                            ("logprobs again", {"logprobs": 3})):
            t = time.perf_counter()
            status, r = call(port, "/v1/completions", {**body, **extra})
            timed[name] = time.perf_counter() - t
            assert status == 200, r
            timed[name + " text"] = r["choices"][0]["text"]
            if extra:
                lp = r["choices"][0]["logprobs"]
                assert len(lp["token_logprobs"]) == 64
                assert all(max(top.values()) >= v - 1e-2 for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
        assert timed["plain text"] == timed["logprobs text"] == timed["logprobs again text"]
        print("seconds per 64-token request:", {k: round(v, 4) for k, v in timed.items() if "text" not in k})
        job.proc.send_signal(signal.SIGTERM)
        rc = job.finish(timeout=120)
    finally:
        job.kill()
    # the ranks exit 4 (EXIT_INTERRUPTED), which MPICH's mpiexec and srun pass on; Open MPI's
    # mpirun, signalled itself, reports 1: the trace says how the run ended
    assert rc != 0, job.report()
    assert "Traceback" not in job.stderr, job.stderr
    assert read_root(out)["exit_status"] == "interrupted" and len(read_requests(out)) == 4, job.report()
