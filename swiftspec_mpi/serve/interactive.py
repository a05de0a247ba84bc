"""Interactive sessions (`swiftspec run --interactive`): prompts read from world rank 0's standard
input, each decoded as one request as soon as it arrives, on models loaded and warmed up once.

    mpiexec -n 2 swiftspec run --interactive --chat --mode async          # type, Enter; Ctrl-D ends
    printf 'def fib(n):\\n/exit\\n' | mpiexec -n 2 swiftspec run --interactive   # or from a program

Rank 0 reads its standard input (a terminal, a pipe from another program, or what `srun --input=0`
forwards); every other rank waits for the next request without spinning a core. Input is one
line per prompt, except:

    /exit, /quit        end the session (so does the end of the input)
    /reset              start a new conversation (--chat)
    /help               this list
    \"\"\"                 a line of three double quotes opens a block of several lines, the next
                        such line closes it (pasted code)
    text \\              a line ending in a backslash continues on the next one
    {"prompt": "..."}   a JSON object, as a line of a --prompts file (newlines as \\n)

A line that cannot be a prompt (a JSON line that does not parse or holds no prompt text, a lone
surrogate escape, a prompt longer than the room or one the tokenizer or chat template refuses)
gets one line on stderr and the session goes on; bytes that are not UTF-8 are read as U+FFFD.

With --chat the prompts form one conversation: each is the next user turn, and the model sees the
earlier turns and its own replies through its chat template. When the conversation no longer fits
the KV cache (--max-context, less the new tokens and the tree's room), its oldest turns are left
out. Without --chat every prompt stands alone. Each request ends with a one-line summary on
stderr, and the HDF5 trace (--out) is rewritten after each one (a new file every --trace-rotate
turns or minutes: run.h5, run.1.h5, ...). Ctrl-C (SIGINT) or SIGTERM ends
the session at once like any job: the trace keeps the answers so far, exit code 4. (A Ctrl-C that
ends only the answer in progress cannot ride on SIGINT: MPICH's mpiexec aborts the job at the
second one, and srun --quit-on-interrupt ends the step.)
"""
from __future__ import annotations

import json
import os
import pickle
import select
import sys
import time

import numpy as np

from swiftspec_mpi.core.config import Request

HELP = ("/exit or /quit (or end of input): end the session;  /reset: new conversation (--chat);  "
        '""" opens and closes a block of lines;  a line ending in \\ continues;  '
        '{"prompt": ...}: a JSON prompt')
BLOCK = '"""'
INTERACTIVE_CATEGORY = "interactive"
_KIND_END, _KIND_REQUEST, _KIND_STOP = 0, 1, 2
_IDLE_SLEEP_S = 0.001      # a rank waiting for the next prompt polls this often (its delay to
                           # start the request: 20 ms here added 10 ms to an async TTFT on the H200)


class TurnTooLong(Exception):
    """The newest turn alone does not fit the room for a prompt."""


def check_while_waiting(stop_flag, watch) -> None:
    """Rank 0 waiting for the next request (stdin or HTTP): a signal ends the wait
    (Interrupted), a failing rank's notice is picked up (`watch`)."""
    from swiftspec_mpi.engine.protocol import Interrupted
    if stop_flag:
        raise Interrupted()
    if watch is not None:
        watch.check()


class LineReader:
    """Lines of a file descriptor, read without blocking past `poll_s`, so that a signal (the
    stop flag) or a failing rank (`watch`) is noticed while the user thinks. -> str without
    the newline, or None at end of input."""

    def __init__(self, fd: int, stop_flag, watch=None, poll_s: float = 0.1):
        self.fd, self.stop_flag, self.watch, self.poll_s = fd, stop_flag, watch, poll_s
        self.buf = b""
        self.eof = False

    def readline(self) -> str | None:
        from swiftspec_mpi.engine.protocol import Interrupted
        while b"\n" not in self.buf and not self.eof:
            check_while_waiting(self.stop_flag, self.watch)
            ready, _, _ = select.select([self.fd], [], [], self.poll_s)
            if ready:
                chunk = os.read(self.fd, 65536)
                if chunk:
                    self.buf += chunk
                else:
                    self.eof = True
        if self.stop_flag:         # a signal that came with the last bytes still wins
            raise Interrupted()
        if not self.buf:
            return None
        line, sep, rest = self.buf.partition(b"\n")
        self.buf = rest
        return line.decode("utf-8", "replace").rstrip("\r")


def read_turn(readline) -> tuple[str, str]:
    """The next input item from `readline()` (str or None at end): ("prompt", text), ("reset",
    ""), ("help", ""), ("exit", ""), ("skip", "") for an empty line, or ("error", why) for a bad
    JSON line."""
    line = readline()
    if line is None:
        return "exit", ""
    stripped = line.strip()
    if stripped in ("/exit", "/quit"):
        return "exit", ""
    if stripped == "/reset":
        return "reset", ""
    if stripped == "/help":
        return "help", ""
    if stripped == BLOCK:
        lines = []
        while True:
            more = readline()
            if more is None or more.strip() == BLOCK:
                break
            lines.append(more)
        text = "\n".join(lines)
        return ("prompt", text) if text.strip() else ("skip", "")
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError as exc:
            return "error", f"not valid JSON ({exc.msg}); a line starting with {{ is read as a JSON prompt"
        except RecursionError:
            return "error", "not a JSON prompt: nested too deeply"
        except ValueError as exc:     # e.g. an integer of more than 4300 digits
            return "error", f"not a JSON prompt: a number too large ({' '.join(str(exc).split())[:80]})"
        text = obj.get("prompt") if isinstance(obj, dict) else None
        if text is None and isinstance(obj, dict) and isinstance(obj.get("turns"), list) and obj["turns"]:
            text = obj["turns"][0]
        if not isinstance(text, str):
            return "error", 'a JSON prompt needs a "prompt" string (or Spec-Bench "turns")'
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return "error", (f"the JSON prompt holds an invalid Unicode character ({exc.object[exc.start]!r}, "
                             "a lone surrogate escape); send UTF-8 text")
        return ("prompt", text) if text.strip() else ("skip", "")
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        more = readline()
        if more is None:
            break
        lines.append(more)
    text = "\n".join(lines)
    return ("prompt", text) if text.strip() else ("skip", "")


class Conversation:
    """The turns of a --chat session (user text, reply text), and the prompt ids of the next turn."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.turns: list[tuple[str, str]] = []

    def reset(self) -> None:
        self.turns = []

    def prompt_ids(self, tokenizer, user_text: str, room: int) -> tuple[list[int], int]:
        """Token ids of the prompt for `user_text` (with --chat: the conversation so far plus this
        turn, through the chat template) of at most `room` tokens, leaving out the oldest turns
        as needed. -> (ids, turns left out; they are forgotten). Raises TurnTooLong when even
        the turn alone is longer than `room`."""
        if not self.chat:
            ids = tokenizer.encode(user_text)
            if len(ids) > room:
                raise TurnTooLong(f"{len(ids)} tokens")
            return ids, 0
        for start in range(len(self.turns) + 1):
            messages = []
            for user, reply in self.turns[start:]:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            messages.append({"role": "user", "content": user_text})
            ids = tokenizer.encode(tokenizer.render_conversation(messages))
            if len(ids) <= room:
                self.turns = self.turns[start:]
                return ids, start
        raise TurnTooLong(f"{len(ids)} tokens")

    def add_reply(self, user_text: str, reply: str) -> None:
        if self.chat:
            self.turns.append((user_text, reply))


class SharedRequests:
    """Requests that arrive while the job runs: world rank 0 gets the next one (`_read_request`,
    a subclass's), every rank receives it from `next()` (None at the end). The other ranks wait
    in a polled nonblocking broadcast; a signal seen by rank 0 while it waits is shared too, so
    every rank stops together (Interrupted). Subclasses: PromptSource (stdin), http_server.HttpSource."""

    def __init__(self, world, cfg, tokenizer, stop_flag, watch, room: int, err=None):
        self.world, self.cfg, self.tokenizer = world, cfg, tokenizer
        self.stop_flag, self.watch, self.room = stop_flag, watch, room
        self.rank = world.Get_rank()
        self.err = err or sys.stderr
        self.index = 0
        self.segment_due = None    # rank 0: a callable -> True when the trace starts its next file

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def banner(self) -> None:
        """Rank 0: one line on stderr when the requests may come."""

    def _read_request(self) -> Request | None:
        raise NotImplementedError

    def stream_sink(self):
        """Rank 0: where the request in flight streams its text (None: stdout, unless --quiet)."""
        return None

    def abandoned(self):
        """Rank 0: a callable that says the request in flight has lost its reader (None: never)."""
        return None

    def finished(self, result) -> None:
        """Every rank, after a request (`result` on rank 0 only)."""

    def interrupted(self, results) -> None:
        """Rank 0 at a signal, before the trace is written: tell whoever waits (`results`: the
        job's RequestResults so far)."""

    def _share(self, kind: int, payload: bytes) -> None:
        header = np.array([kind, len(payload)], dtype=np.int64)
        self.world.Ibcast(header, root=0).Wait()    # the others wait in Ibcast: a nonblocking
        if payload:                                 # collective matches only its own kind
            self.world.Bcast(np.frombuffer(payload, dtype=np.uint8).copy(), root=0)

    def next(self) -> Request | None:
        """The next request on every rank, or None when the job is over."""
        from swiftspec_mpi.engine.protocol import Interrupted
        if self.rank == 0:
            try:
                req = self._read_request()
            except Interrupted:
                self._share(_KIND_STOP, b"")
                raise
            if req is None:
                self._share(_KIND_END, b"")
                return None
            req.new_segment = bool(self.segment_due and self.segment_due())
            self._share(_KIND_REQUEST, pickle.dumps(req))
            return req
        header = np.zeros(2, dtype=np.int64)
        pending = self.world.Ibcast(header, root=0)
        spins = 0
        while not pending.Test():       # rank 0 decides when the job stops: no timeout here
            spins += 1
            if spins > 2000:
                time.sleep(_IDLE_SLEEP_S)
                if self.watch is not None and spins % 64 == 0:   # rank 0 failed: it may ask for
                    self.watch.check()                           # this rank's events
        kind, nbytes = int(header[0]), int(header[1])
        if kind == _KIND_STOP:
            raise Interrupted()
        if kind == _KIND_END:
            return None
        buf = np.zeros(nbytes, dtype=np.uint8)
        self.world.Bcast(buf, root=0)
        return pickle.loads(buf.tobytes())


class PromptSource(SharedRequests):
    """An --interactive session: rank 0 reads the prompts from its standard input and handles
    the commands and the too-long turns itself (a line on stderr)."""

    def __init__(self, world, cfg, tokenizer, stop_flag, watch, room: int, fd: int | None = None,
                 err=None):
        super().__init__(world, cfg, tokenizer, stop_flag, watch, room, err)
        self.conversation = Conversation(cfg.chat)
        self.user_text = ""        # the turn in flight (rank 0), for the conversation
        if self.rank == 0:
            self.reader = LineReader(sys.stdin.fileno() if fd is None else fd, stop_flag, watch)

    def banner(self) -> None:
        if self.rank == 0:
            chat = "one conversation (--chat)" if self.cfg.chat else "each prompt on its own"
            self.say(f"swiftspec: interactive session, {self.cfg.mode} mode, {chat}; up to {self.room} "
                     f"prompt tokens and {self.cfg.max_new_tokens} new tokens a turn.\n{HELP}")

    def _read_request(self) -> Request | None:
        while True:
            # always: under mpiexec / srun rank 0's stdin and stderr are pipes even when the
            # user types at a terminal (checked with hydra under a pty), so isatty cannot tell
            print("> ", end="", file=self.err, flush=True)
            kind, text = read_turn(self.reader.readline)
            if kind == "exit":
                return None
            if kind == "reset":
                self.conversation.reset()
                self.say("swiftspec: new conversation")
            elif kind == "help":
                self.say(HELP)
            elif kind == "error":
                self.say(f"swiftspec: {text}")
            elif kind == "prompt":
                try:
                    ids, dropped = self.conversation.prompt_ids(self.tokenizer, text, self.room)
                except TurnTooLong as exc:
                    self.say(f"swiftspec: this prompt has {exc} and the session has room for {self.room}; "
                             "shorten it, or start the session with a larger --max-context")
                    continue
                except Exception as exc:  # noqa: BLE001 - a line must not end the session
                    self.say(f"swiftspec: this prompt cannot be tokenized or rendered ({type(exc).__name__}: "
                             f"{' '.join(str(exc).splitlines())[:200]}); the session goes on")
                    continue
                if not ids:
                    continue
                if dropped:
                    self.say(f"swiftspec: the conversation no longer fits {self.room} tokens; "
                             f"left out its {dropped} oldest turn(s)")
                self.user_text = text
                req = Request(self.index, text, INTERACTIVE_CATEGORY, ids, question_id=self.index)
                self.index += 1
                return req

    def finished(self, result) -> None:
        """Rank 0, after a request: remember the reply (--chat) and print the summary line."""
        if self.rank != 0 or result is None:
            return
        self.conversation.add_reply(self.user_text, result.text)
        n = len(result.output_ids)
        secs = result.seconds
        ttft = f"{1e3 * (result.t_first - result.t_start):.0f} ms" if result.t_first is not None else "-"
        per_step = f", {n / len(result.steps):.2f} tokens a step" if result.steps else ""
        rate = f"{n / secs:.1f} tokens/s" if secs > 0 else "- tokens/s"
        self.say(f"[{n} tokens, {rate}, first token {ttft}{per_step}, stop: {result.stop_reason}]")
