"""`swiftspec run --interactive`: prompts from rank 0's standard input, one request each.

Unit tests of the input parsing, the conversation's trimming and the line reader; then sessions
under mpiexec on the tiny checkpoint (CPU float32): a piped session equals the batch run of the
same prompts token for token, a --chat session carries the conversation and /reset starts a new
one, too-long turns are refused or trim the conversation, and a signal while rank 0 waits for
input stops every rank with the file written.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from engine_helpers import MPIEXEC, env_for_tests, read_outputs, read_requests, read_root, run_swiftspec
from engine_helpers import batch_ar as batch_ar_run
from reliability_helpers import Job

from swiftspec_mpi.engine.protocol import Interrupted, StopFlag
from swiftspec_mpi.serve.interactive import Conversation, LineReader, TurnTooLong, read_turn

PROMPTS = ["Write a haiku about message passing.", "def add(a, b):\n    return"]
NEW = 24


def turns_of(text: str) -> list[tuple[str, str]]:
    lines = iter(text.split("\n"))
    out = []
    while True:
        kind, t = read_turn(lambda: next(lines, None))
        out.append((kind, t))
        if kind == "exit":
            return out


# ----------------------------------------------------------------------------- without MPI

def test_read_turn_commands_blocks_continuations_and_json():
    text = "\n".join(["Hello there", '"""', "def f():", "    return 1", '"""', '{"prompt": "a\\nb"}',
                      '{"turns": ["spec bench"], "category": "x"}', "/reset", "one \\", "two", "",
                      "   ", "/help", "{bad", '{"prompt": 3}', "/quit", "never read"])
    assert turns_of(text) == [
        ("prompt", "Hello there"), ("prompt", "def f():\n    return 1"), ("prompt", "a\nb"),
        ("prompt", "spec bench"), ("reset", ""), ("prompt", "one \ntwo"), ("skip", ""), ("skip", ""),
        ("help", ""), ("error", turns_of("{bad")[0][1]), ("error", turns_of('{"prompt": 3}')[0][1]),
        ("exit", "")]
    assert "not valid JSON" in turns_of("{bad")[0][1]
    assert turns_of('"""\nunclosed block')[0] == ("prompt", "unclosed block")   # end of input closes it
    assert turns_of("")[0] == ("skip", "") and turns_of("x")[-1] == ("exit", "")


def test_read_turn_refuses_json_lines_that_hold_no_text():
    """Lines a JSON parser accepts (or chokes on) that are not a prompt: one error each."""
    for line, says in (('{"prompt": "a\\ud800"}', "lone surrogate"), ('{"turns": ["\\udfff"]}', "lone surrogate"),
                       ('{"a": ' * 100000 + "1" + "}" * 100000, "nested too deeply"),
                       ('{"prompt": 1' + "0" * 5000 + "}", "number too large"),
                       ('{"prompt": [1, 2]}', '"prompt" string'), ('{"turns": []}', '"prompt" string')):
        kind, why = turns_of(line)[0]
        assert kind == "error" and says in why, (line[:40], why)
    assert turns_of('{"prompt": "\\ud83d\\ude00"}')[0] == ("prompt", "\U0001f600")   # a pair is fine


class _CharTokenizer:
    """One token per character; the 'template' tags each message."""

    def encode(self, text):
        return [ord(c) for c in text]

    def render_conversation(self, messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_conversation_trims_oldest_turns_and_refuses_a_turn_too_long_alone():
    tok = _CharTokenizer()
    conv = Conversation(chat=True)
    ids, dropped = conv.prompt_ids(tok, "hi", room=100)
    assert "".join(map(chr, ids)) == "<user>hi<assistant>" and dropped == 0
    conv.add_reply("hi", "hello")
    ids, dropped = conv.prompt_ids(tok, "more", room=100)
    assert "".join(map(chr, ids)) == "<user>hi<assistant>hello<user>more<assistant>" and dropped == 0
    conv.add_reply("more", "x" * 40)
    ids, dropped = conv.prompt_ids(tok, "third", room=90)      # the two turns together do not fit
    assert dropped == 1 and len(ids) <= 90
    assert "".join(map(chr, ids)).startswith("<user>more<assistant>" + "x" * 40)
    assert conv.turns == [("more", "x" * 40)]                  # the left-out turn is forgotten
    with pytest.raises(TurnTooLong):
        conv.prompt_ids(tok, "y" * 100, room=90)
    conv.reset()
    assert conv.turns == []
    plain = Conversation(chat=False)
    plain.add_reply("a", "b")                                  # without --chat: no memory
    assert plain.prompt_ids(tok, "abc", room=5) == ([97, 98, 99], 0)
    with pytest.raises(TurnTooLong):
        plain.prompt_ids(tok, "abcdef", room=5)


def test_line_reader_reads_lines_and_a_signal_ends_the_wait():
    r, w = os.pipe()
    flag = StopFlag()
    reader = LineReader(r, flag, poll_s=0.01)
    os.write(w, "first\nsecond line\r\nthird é".encode())
    assert reader.readline() == "first" and reader.readline() == "second line"
    os.write(w, b"\n")
    assert reader.readline() == "third é"
    flag.set(signal.SIGTERM)
    t = time.monotonic()
    with pytest.raises(Interrupted):
        reader.readline()                 # nothing to read: the flag ends the wait
    assert time.monotonic() - t < 1.0
    flag.signum = 0
    os.write(w, b"last, no newline")
    os.close(w)
    assert reader.readline() == "last, no newline" and reader.readline() is None
    os.close(r)


# ----------------------------------------------------------------------------- sessions under mpiexec

def session(n: int, args: list[str], stdin: str, timeout: float = 240):
    cmd = [*MPIEXEC, "-n", str(n), sys.executable, "-m", "swiftspec_mpi", "run", "--threads", "1",
           "--interactive", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout,
                          env=env_for_tests())


@pytest.fixture(scope="module")
def batch_ar(tiny_pair, tmp_path_factory):
    return [q["output_ids"] for q in batch_ar_run(tiny_pair[0], tmp_path_factory.mktemp("batch"), PROMPTS, NEW)]


@pytest.mark.mpi
def test_piped_session_equals_the_batch_run_and_survives_bad_lines(tiny_pair, batch_ar, tmp_path):
    """async on 2 ranks, prompts piped in (a JSON line, a block), with an empty line, /help and a
    bad JSON line between them, ended by the end of input: the outputs are the batch `ar`
    outputs, token for token."""
    out = tmp_path / "s.h5"
    block = ['"""', *PROMPTS[1].split("\n"), '"""']
    stdin = "\n".join(["", "/help", "{not json", json.dumps({"prompt": PROMPTS[0]}), *block]) + "\n"
    r = session(2, ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--mode", "async",
                    "--max-new-tokens", str(NEW), "--ignore-eos", "--out", str(out)], stdin)
    assert r.returncode == 0, r.stderr
    assert read_outputs(out) == batch_ar
    reqs = read_requests(out)
    assert [q["category"] for q in reqs] == ["interactive"] * 2
    assert [q["prompt_text"] for q in reqs] == PROMPTS
    root = read_root(out)
    assert bool(root["complete"]) and root["config"]["interactive"] is True
    assert r.stderr.count(f"[{NEW} tokens, ") == 2, r.stderr        # a summary line per request
    assert "not valid JSON" in r.stderr and "/exit or /quit" in r.stderr
    assert "swiftspec run: error" not in r.stderr, r.stderr


@pytest.mark.mpi
def test_bad_lines_of_every_kind_between_good_prompts(tiny_pair, batch_ar, tmp_path):
    """ar on 1 rank, bytes on stdin: each bad line gets one error line and the session goes
    on; the good prompts' outputs are the batch run's. Lines that are text after all (invalid
    UTF-8 read with replacement characters, a NUL) are answered like any prompt."""
    out = tmp_path / "bad.h5"
    lines = [b'{"prompt": "\\ud800"}', PROMPTS[0].encode(), b'{"a": ' * 1500 + b"1" + b"}" * 1500,
             b'{"prompt": 1' + b"0" * 5000 + b"}", b'{"prompt": 3}', b"{not json", b"word " * 400,
             b"\xff\xfe bytes", b"nul \x00 inside", b'{"prompt": "   "}', b"\x1b[31m\x07",
             json.dumps({"prompt": PROMPTS[1]}).encode()]
    cmd = [*MPIEXEC, "-n", "1", sys.executable, "-m", "swiftspec_mpi", "run", "--threads", "1", "--interactive",
           "--target", tiny_pair[0], "--mode", "ar", "--max-new-tokens", str(NEW), "--ignore-eos",
           "--max-context", "512", "--out", str(out), "--quiet"]   # a short input: hydra fails on a large
    # one that arrives while rank 0 is still loading
    r = subprocess.run(cmd, input=b"\n".join(lines) + b"\n", capture_output=True, timeout=240,
                       env=env_for_tests())
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err
    assert "Traceback" not in err and "swiftspec run: error" not in err, err
    reqs = read_requests(out)
    assert [q["prompt_text"] for q in reqs] == [PROMPTS[0], "\ufffd\ufffd bytes", "nul \u2400 inside",
                                                 "\x1b[31m\x07", PROMPTS[1]]
    assert [reqs[0]["output_ids"], reqs[-1]["output_ids"]] == batch_ar
    for says in ("lone surrogate", "nested too deeply", "number too large", '"prompt" string', "not valid JSON",
                 "shorten it"):
        assert err.count(says) == 1, (says, err)


@pytest.mark.mpi
def test_chat_session_carries_the_conversation_and_reset_starts_over(tiny_pair, tmp_path):
    """ar with --chat: the second turn's prompt holds the first turn and its reply; after /reset
    the same first prompt gives the same prompt and output as at the start."""
    from swiftspec_mpi.checkpoints.tokenizer import TextTokenizer
    out = tmp_path / "chat.h5"
    stdin = "Hi there\nAnd then?\n/reset\nHi there\n/exit\nnot read\n"
    r = session(1, ["--target", tiny_pair[0], "--mode", "ar", "--chat", "--max-new-tokens", str(NEW),
                    "--ignore-eos", "--out", str(out)], stdin)
    assert r.returncode == 0, r.stderr
    reqs = read_requests(out)
    assert len(reqs) == 3 and "new conversation" in r.stderr
    tok = TextTokenizer.from_hf_folder(tiny_pair[0])
    first, second, again = reqs
    reply = tok.decode(first["output_ids"])
    assert second["prompt_ids"] == tok.encode(tok.render_conversation([
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": reply},
        {"role": "user", "content": "And then?"}]))
    assert first["prompt_ids"] == tok.encode(tok.apply_chat_template("Hi there"))
    assert again["prompt_ids"] == first["prompt_ids"] and again["output_ids"] == first["output_ids"]


@pytest.mark.mpi
def test_long_turns_are_refused_or_leave_out_old_turns(tiny_pair, tmp_path):
    """A KV cache with room for ~60 prompt tokens: a turn longer than that alone is refused with
    the fix and the session goes on; a growing conversation leaves out its oldest turns."""
    out = tmp_path / "long.h5"
    margin = 16 + 2 * 16 + 1024 // 8          # job.tree_margin before the profile fixes bs and w
    turns = ["Hello", "Again", "Once more", "And more", "Still more", "The last one"]
    stdin = " ".join(["word"] * 300) + "\n" + "\n".join(turns) + "\n"
    r = session(1, ["--target", tiny_pair[0], "--mode", "ar", "--chat", "--max-new-tokens", "8",
                    "--max-context", str(8 + margin + 40), "--out", str(out)], stdin)
    assert r.returncode == 0, r.stderr
    room = int(re.search(r"up to (\d+) prompt tokens", r.stderr).group(1))
    assert room == 40, r.stderr          # the flags alone fix it, whatever the profile chose
    assert "shorten it, or start the session with a larger --max-context" in r.stderr
    assert "left out its" in r.stderr
    reqs = read_requests(out)
    assert len(reqs) == len(turns) and all(len(q["prompt_ids"]) <= room for q in reqs)
    assert max(len(q["prompt_ids"]) for q in reqs) > room // 2       # the history was carried


@pytest.mark.mpi
def test_interactive_refuses_prompt_flags(tiny_pair, tmp_path):
    r = run_swiftspec(2, ["--target", tiny_pair[0], "--mode", "ar", "--interactive", "--prompt", "x",
                          "--out", str(tmp_path / "x.h5")], check=False)
    assert r.returncode == 2 and r.stderr.count("swiftspec run: error:") == 1, r.stderr
    assert "--interactive reads the prompts from standard input" in r.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("to", ["all", "rank0"])
def test_signal_while_waiting_for_input_stops_every_rank(tiny_pair, tmp_path, to):
    """async on 2 ranks, one prompt answered, then the session waits for input: SIGTERM (to every
    rank through mpiexec, or to rank 0 only, the one reading) ends both ranks with exit 4 and the
    answered request in the file."""
    out = tmp_path / f"sig-{to}.h5"
    job = Job(2, ["--interactive", "--target", tiny_pair[0], "--draft", tiny_pair[1], "--mode", "async",
                  "--max-new-tokens", str(NEW), "--out", str(out), "--quiet"], stdin=subprocess.PIPE)
    try:
        job.proc.stdin.write(PROMPTS[0] + "\n")
        job.proc.stdin.flush()
        job.wait_file(out, min_requests=1)
        time.sleep(0.5)                      # rank 0 back at the prompt, the others waiting
        if to == "all":
            job.proc.send_signal(signal.SIGTERM)
        else:
            os.kill(job.wait_ranks(2)[0], signal.SIGTERM)
        t = time.monotonic()
        rc = job.proc.wait(timeout=60)       # stdin stays open: the signal alone ends it
        took = time.monotonic() - t
        job.communicate(10)
    finally:
        job.kill()
    assert rc == 4, job.report()
    assert took < 15, job.report()
    root = read_root(out)
    assert root["exit_status"] == "interrupted" and not bool(root["complete"])
    reqs = read_requests(out)
    assert len(reqs) == 1 and reqs[0]["stop_reason"] != "interrupted"
