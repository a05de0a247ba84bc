"""The lifecycle of one `swiftspec run` job on every rank: validate (rank 0, cli/validate.py) ->
topology -> load, profile, warm up (cli/loading.py) -> decode every request -> gather the trace
-> write HDF5. Failure handling lives here:

- bad input: rank 0 raises UserError before any heavy work; the verdict is broadcast and every
  rank exits with EXIT_USER_ERROR; the message is printed once.
- a rank failing while loading: all ranks agree on the first error (allgather) and exit together.
- a rank failing later: rank 0 writes what was generated and aborts the job; another rank tells
  rank 0 (abort notice), then aborts the job itself after a grace period.
- SIGTERM/SIGINT (Slurm time limit, scancel): every rank finishes its step, rank 0 writes the
  partial file (complete=False, exit_status "interrupted"), all exit EXIT_INTERRUPTED.
"""
from __future__ import annotations

import os
import platform
import signal
import sys
import threading
import time
import traceback
import uuid

import numpy as np
import numpy.random  # noqa: F401 - the first request would otherwise import it (~7 ms of its TTFT)
from mpi4py import MPI

from swiftspec_mpi.cli.validate import interactive_room, prepare_config
from swiftspec_mpi.core import config as C
from swiftspec_mpi.core.errors import (EXIT_INTERRUPTED, EXIT_RUNTIME_ERROR, EXIT_USER_ERROR, PeerError,
                                       UserError, one_line)
from swiftspec_mpi.core.topology import build_topology, pin_threads
from swiftspec_mpi.engine.context import EngineContext
from swiftspec_mpi.engine.protocol import (AbortWatch, Interrupted, RemoteFailure, StopFlag,
                                           collect_trace_parts, notify_rank0_and_abort, send_trace_part,
                                           wait_for)
from swiftspec_mpi.gpu.sharing import check_gpu_sharing
from swiftspec_mpi.trace.record import (EVENT_DTYPE, RANK_DTYPE, ROLE_VERIFY, Clock, EventRecorder,
                                        RequestResult, TraceFile)

CHECKPOINT_EVERY_S = 2.0   # seconds between checkpoints of the request in flight (at least)
SHUTDOWN_GATHER_S = 15.0   # ... of C.SHUTDOWN_S, rank 0 waits this long, from the signal, for the other ranks' events
ERROR_GATHER_S = 3.0       # a failure: rank 0 waits this long for the others' events (within the
                           # 5 s a failing rank gives rank 0 before it aborts the job itself)


def run_job(flags: dict, config_path: str | None) -> int:
    """Every rank: rank 0 validates (prepare_config) and broadcasts its verdict; then the Job runs.
    -> the process exit code (0, EXIT_USER_ERROR, EXIT_RUNTIME_ERROR or EXIT_INTERRUPTED)."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    stop_flag = StopFlag()
    signal.signal(signal.SIGTERM, stop_flag.set)
    signal.signal(signal.SIGINT, stop_flag.set)

    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    ranks_on_node = node.Get_size()
    node.Free()
    verdict = None
    if rank == 0:
        try:
            verdict = ("ok", prepare_config(flags, config_path, world.Get_size(), ranks_on_node))
        except UserError as exc:
            verdict = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug: still end every rank, not just this one
            traceback.print_exc()
            verdict = ("crash", f"{type(exc).__name__}: {exc}")
    status, payload = world.bcast(verdict, root=0)
    if status != "ok":
        # srun with a PMI mismatch starts N singletons (each a world of 1, each its own rank 0)
        # that all fail the same way: only Slurm's task 0 prints, so the message shows once
        twin = world.Get_size() == 1 and os.environ.get("SLURM_PROCID", "0") not in ("", "0")
        if rank == 0 and not twin:
            print(f"swiftspec run: error: {one_line(payload)}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR if status == "error" else EXIT_RUNTIME_ERROR
    cfg: C.RunConfig = payload
    if cfg.auto_split:
        from swiftspec_mpi.cli.plan import auto_split
        auto_split(world, cfg)
    job = Job(cfg, world, stop_flag, AbortWatch(world))
    return job.run()


class Job:
    """One rank's job after validation: `run()` = setup (topology, models, profile, warm-up) ->
    `decode_all()` -> `finish()` (gather the events, rank 0 writes the HDF5 trace); any failure
    goes to `fail()`, a signal to `interrupted()`. Rank 0 keeps the RequestResults and rewrites
    the trace as it goes (`maybe_checkpoint`), so a failed job keeps what it generated."""

    def __init__(self, cfg, world, stop_flag, watch):
        self.cfg, self.world, self.stop_flag, self.watch = cfg, world, stop_flag, watch
        self.rank = world.Get_rank()
        self.results = []
        self.ctx = None
        self.env = {}
        self.last_write = 0.0
        self.rows = None              # rank 0: every rank's RANK_DTYPE row, gathered after loading
        self.trace = None             # rank 0: the record.TraceFile behind cfg.out
        self.checkpoint_every = CHECKPOINT_EVERY_S
        self.source = None      # --interactive / --serve: where the requests come from
        # --trace-rotate: a new file every `rotate` = (requests, seconds); segment k of trace_id
        self.rotate = C.parse_trace_rotate(cfg.trace_rotate if cfg.trace_rotate is not None
                                           else C.DEFAULT_TRACE_ROTATE) \
            if C.requests_stream_in(cfg) else (None, None)
        self.trace_id = uuid.uuid4().hex if self.rotate != (None, None) else None
        self.segment = 0
        self.segment_requests = 0
        self.segment_t0 = time.monotonic()
        self.sent_part = None   # a rank other than 0: its trace part on its way to rank 0
        # before the profile fixes bs and w: the room depends on the flags and models alone
        self.prompt_room = interactive_room(cfg) if C.requests_stream_in(cfg) else 0

    # -- phases ----------------------------------------------------------------------------------
    def run(self) -> int:
        """The whole job on this rank -> its exit code."""
        try:
            failed = self.setup()
            if failed:
                return failed
            self.decode_all()
            self.finish(complete=True, status="ok")
            return 0
        except Interrupted:
            return self.interrupted()
        except Exception as exc:  # noqa: BLE001 - any failure ends the whole job, loudly
            return self.fail(exc)

    def setup(self) -> int:
        """Topology, device, models (every rank agrees on the first load error), the engine
        context, the profile and the graph warm-up. -> 0, or the exit code of a load failure."""
        # torch and the engine take seconds to import: only once rank 0's validation passed, so
        # that a bad flag is reported at once (the same modules serve decode_all)
        from swiftspec_mpi.cli.loading import (choose_device, environment, kv_bytes_estimate,
                                               load_models, profile_expansions)
        from swiftspec_mpi.engine import async_loop, single_group  # noqa: F401
        cfg = self.cfg
        self.topo = topo = build_topology(self.world, cfg.mode, cfg.draft_ranks)
        self.threads = pin_threads(topo, cfg.threads)
        self.device = choose_device(cfg, topo)
        gpu_sharing = check_gpu_sharing(self.world, topo.role_name, self.device)
        error = None      # (exit code, one-line message) of this rank's load failure
        target = draft = tokenizer = None
        try:
            target, draft, tokenizer = load_models(cfg, topo, self.device, chain_reason=mps_shared(gpu_sharing, self.rank))
        except UserError as exc:
            error = (EXIT_USER_ERROR, str(exc))
        except (MemoryError, RuntimeError) as exc:
            if "memory" not in str(exc).lower() and not isinstance(exc, MemoryError):
                traceback.print_exc()
                error = (EXIT_RUNTIME_ERROR, f"rank {self.rank} ({topo.role_name}) failed while "
                                             f"loading: {type(exc).__name__}: {exc}")
            else:
                error = (EXIT_USER_ERROR,
                         f"out of memory while allocating the model and its KV cache of "
                         f"{cfg.max_context} slots ({kv_bytes_estimate(cfg, topo) / 2**30:.2f} GiB "
                         f"of KV per rank); lower --max-context / --max-new-tokens or use more ranks")
        except Exception as exc:  # noqa: BLE001 - a bug: every rank still leaves together
            traceback.print_exc()
            error = (EXIT_RUNTIME_ERROR, f"rank {self.rank} ({topo.role_name}) failed while "
                                         f"loading: {type(exc).__name__}: {exc}")
        errors = self.world.allgather(error)
        first = next((e for e in errors if e), None)
        if first:
            if self.rank == 0:
                print(f"swiftspec run: error: {one_line(first[1])}", file=sys.stderr, flush=True)
            return first[0]
        self.world.Barrier()
        clock = Clock()
        role = topo.role
        rec = EventRecorder(self.rank, role, clock)
        self.ctx = EngineContext(cfg, topo, clock, rec, self.stop_flag, self.watch, target, draft,
                                 tokenizer)
        if cfg.accept_model is not None:
            from swiftspec_mpi.engine.replay import Replay
            self.ctx.replay = Replay.of(cfg.accept_model, cfg.tree_topk, cfg.seed,
                                       int(cfg.accept_model["replay_vocab"]))
        profiled = profile_expansions(self.ctx)      # also fixes bs and w when they are auto
        self.ctx.expansions = cfg.expansions or profiled
        if cfg.mode == "async":      # paced when asked, or when a draft rank shares a verify rank's GPU
            shares = any(min(g) < topo.verify_size <= max(g) for g in gpu_sharing["shared_gpu_ranks"])
            self.ctx.draft_pace = cfg.expansions or (profiled if shares else 0)
        self.env = environment(cfg, topo, self.device, self.threads, self.ctx.expansions)
        self.env["draft_pace"] = self.ctx.draft_pace
        self.env["profile"] = self.ctx.scratch.get("profile", {})
        self.env["graphs"] = self.ctx.scratch.get("graphs", {})
        self.env["gpu_sharing"] = gpu_sharing
        # every rank's row (host, device) from the start, so that checkpoints, and so the file
        # of a job killed mid-run, say where each rank ran; refreshed at the end
        self.rows = self.world.gather(self.rank_row(), root=0)
        if self.rank == 0:
            self.ctx.on_progress = self.maybe_checkpoint
        else:   # rank 0 may ask for this rank's events when it fails (engine.protocol.AbortWatch)
            self.watch.trace_part = self.trace_part
        return 0

    def decode_all(self) -> None:
        """Decode every request in order: the prompts of the run (cfg.requests), or those that
        arrive on rank 0's stdin (--interactive) or over HTTP (--serve) until the source ends.
        The verify group's leader tracks each request's output (streaming, stop strings) and
        records its RequestResult; the loops are engine.async_loop (draft_loop / verify_loop) in
        `async`, engine.single_group otherwise."""
        from swiftspec_mpi.engine.async_loop import draft_loop, verify_loop   # imported by setup
        from swiftspec_mpi.engine.decoding import Acceptor, OutputTracker
        from swiftspec_mpi.engine.single_group import run_request_single
        from swiftspec_mpi.serve.http_server import HttpSource
        from swiftspec_mpi.serve.interactive import PromptSource
        cfg, ctx, topo = self.cfg, self.ctx, self.topo
        acceptor = Acceptor(cfg.temperature, cfg.sampling_rule, cfg.seed)
        if ctx.replay is not None:
            acceptor = ctx.replay.acceptor(cfg.seed, cfg.tree_topk)
            if self.rank == 0:
                print(f"swiftspec run: acceptance replayed from {cfg.accept_from} on dummy weights "
                      "(the generated text is meaningless)", file=sys.stderr, flush=True)
        # the file exists from here on (a run in progress shows up), written before any request
        # so that none pays the write; the next checkpoint comes after some decoding
        self.write(complete=False, status="running", events=None)
        # every rank starts the first request together (rank 0's file write above would otherwise
        # start the verify group late, and a draft group's first tree would wait on it)
        wait_for(self.world.Ibarrier(), self.cfg.peer_timeout, "ranks before the first request",
                 self.stop_flag, self.watch, collective=True)
        leader_of_verify = topo.role == ROLE_VERIFY and topo.is_leader
        source = None
        if cfg.interactive:
            source = PromptSource(self.world, cfg, ctx.tokenizer, self.stop_flag, self.watch,
                                  self.prompt_room)
        elif cfg.serve is not None:
            source = HttpSource(self.world, cfg, ctx.tokenizer, self.stop_flag, self.watch,
                                self.prompt_room)
        self.source = source
        if source is not None:
            source.segment_due = self.segment_due
            source.banner()
        for req in (cfg.requests if source is None else iter(source.next, None)):
            if req.new_segment:     # every rank, between two requests
                self.rotate_trace()
            self.segment_requests += 1
            ctx.check_stop_together()
            result = tracker = None
            acceptor.top_logprobs = req.logprobs       # every verify rank: logits, not argmax
            if leader_of_verify:
                result = RequestResult(req.index, req.category, req.prompt, list(req.ids))
                result.t_start = ctx.clock.now()
                self.results.append(result)
                eos = (() if cfg.ignore_eos else tuple(ctx.tokenizer.eos_token_ids)) + \
                    tuple(cfg.stop_token_ids)
                sink = source.stream_sink() if source is not None else None
                tracker = OutputTracker(result, ctx.tokenizer, eos, req.max_new_tokens or cfg.max_new_tokens,
                                        list(cfg.stop) + list(req.stop), stream=not cfg.quiet, sink=sink,
                                        abandoned=source.abandoned() if source is not None else None)
                acceptor.start_request(req.index, cfg.max_new_tokens, cfg.verify_size)
                self.tracker = tracker
            if cfg.mode == "async":
                if topo.role == ROLE_VERIFY:
                    verify_loop(ctx, req.ids, req.index, result, tracker, acceptor)
                else:
                    draft_loop(ctx, req.ids, req.index)
            else:
                run_request_single(ctx, req.ids, req.index, result, tracker, acceptor)
            if leader_of_verify:
                result.t_end = ctx.clock.now()
                tracker.finish()
                self.tracker = None
                if source is None:   # every finished request reaches the file
                    self.write(complete=False, status="running", events=None, sync=False)
            if source is not None:
                source.finished(result)
                if self.rank == 0:     # the file holds the answer before the next request starts;
                    # the disk write overlaps it (saver thread): the time a request pays for the
                    # trace is bounded by the segment's size (--trace-rotate), not the job's
                    self.write(complete=False, status="running", events=None, sync=cfg.serve is None)

    # -- trace segments (--trace-rotate) -----------------------------------------------------------
    def segment_due(self) -> bool:
        """Rank 0, as the next request arrives: has the current file its share (--trace-rotate)?"""
        count, seconds = self.rotate
        return self.segment_requests > 0 and (
            (count is not None and self.segment_requests >= count)
            or (seconds is not None and time.monotonic() - self.segment_t0 >= seconds))

    def rotate_trace(self) -> None:
        """Every rank, between two requests: gather every rank's events and rows into the
        current file (exit_status "rotated"), then start the next one with empty recorders, so
        that no rank keeps more than a segment's events and results."""
        wait_for(self.world.Ibarrier(), self.cfg.peer_timeout, "ranks at a trace rotation",
                 self.stop_flag, self.watch, collective=True)
        events = self.world.gather(self.ctx.recorder.snapshot(), root=0)
        rows = self.world.gather(self.rank_row(), root=0)
        if self.rank == 0:
            self.rows = rows
            self.write(False, "rotated", np.concatenate(events), np.array(rows, dtype=RANK_DTYPE))
            self.trace.close()
            self.trace = None
            self.results = [r for r in self.results if r.t_end is None]
        self.ctx.recorder.reset()
        self.segment += 1
        self.segment_requests = 0
        self.segment_t0 = time.monotonic()

    def trace_part(self) -> tuple:
        """This rank's share of the trace: (its events, its RANK_DTYPE row)."""
        return (self.ctx.recorder.snapshot().copy() if self.ctx else np.zeros(0, EVENT_DTYPE), self.rank_row())

    def gather_parts(self, deadline: float, ask: bool = False) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Rank 0 at a signal or failure: every rank's events and rows that arrive by `deadline`
        (time.monotonic()); a rank that sends none is named on stderr (and, by the caller, in the
        file), keeping its row from the start. -> (events, ranks table, missing ranks)."""
        parts, missing = collect_trace_parts(self.world, self.trace_part(), deadline, ask)
        events = np.concatenate([np.asarray(p[0], dtype=EVENT_DTYPE) for p in parts])
        rows = {int(p[1][0]): p[1] for p in parts}
        for r in (self.rows or []):
            rows.setdefault(int(r[0]), r)
        for r in missing:
            role = next((("verify", "draft")[int(row[1])] for row in (self.rows or []) if int(row[0]) == r), "?")
            print(f"swiftspec run: rank {r} ({role}) sent no events within the shutdown time; the "
                  f"trace ({self.cfg.out}) names it in ranks_missing and lacks its events",
                  file=sys.stderr, flush=True)
        return events, np.array([rows[k] for k in sorted(rows)], dtype=RANK_DTYPE), missing

    # -- output ----------------------------------------------------------------------------------
    def maybe_checkpoint(self) -> None:
        """After a step of the request in flight: save what exists so far (its committed tokens,
        stop_reason still 'interrupted'), at most every `checkpoint_every` seconds:
        CHECKPOINT_EVERY_S, or 100x the last such write's stall of rank 0's loop if that is
        longer, so checkpoints stay under 1 % of the time. A hard kill (SIGKILL of a lost rank's
        job step) then loses at most those seconds."""
        now = time.perf_counter()
        if now - self.last_write >= self.checkpoint_every:
            self.write(complete=False, status="running", events=None, sync=False)
            took = time.perf_counter() - now
            self.checkpoint_every = max(CHECKPOINT_EVERY_S, 100.0 * took)

    def close_open_requests(self, reason: str) -> None:
        """Before the last write of a failed or interrupted job: the request that was running
        gets its end time, its text so far and `reason` as stop_reason, unless its tokens were
        already complete (the signal came while the leaders closed it: keep its real reason)."""
        for r in self.results:
            if r.t_end is None:
                r.t_end = self.ctx.clock.now() if self.ctx else 0.0
                r.text = self.ctx.tokenizer.decode(r.output_ids) if self.ctx else ""
                if r.stop_reason not in ("eos", "stop_string", "max_new_tokens", "cancelled"):
                    r.stop_reason = reason

    def write(self, complete: bool, status: str, events, ranks=None, sync: bool = True,
              ranks_missing=()) -> None:
        """Rank 0: save the HDF5 trace atomically (events None: rank 0's own so far) through
        record.TraceFile, which adds only what changed; sync=False hands the disk write to its
        saver thread (checkpoints)."""
        if self.rank != 0:
            return
        if self.trace is None:
            self.trace = TraceFile(C.segment_path(self.cfg.out, self.segment),
                                   (self.trace_id, self.segment) if self.trace_id else None)
        if events is None:
            events = self.ctx.recorder.snapshot() if self.ctx else np.zeros(0)
        if ranks is None:
            rows = self.rows or [self.rank_row()]
            ranks = np.array(rows, dtype=RANK_DTYPE)
        for r in self.results:   # a request still running: keep what it produced so far
            if r.t_end is None:
                r.text = self.ctx.tokenizer.decode(r.output_ids) if self.ctx else ""
        self.trace.write(mode=self.cfg.mode, config_json=self.cfg.to_json(), env=self.env,
                         requests=self.results, events=events, ranks=ranks, complete=complete,
                         exit_status=status, sync=sync, ranks_missing=ranks_missing)
        self.last_write = time.perf_counter()

    def rank_row(self):
        """This rank's row of the trace's ranks table (trace.record.RANK_DTYPE)."""
        topo, rec = self.topo, self.ctx.recorder if self.ctx else None
        models = (self.ctx.target, self.ctx.draft) if self.ctx else ()
        late = sum(getattr(m, "late_captures", 0) for m in models if m is not None)
        return (self.rank, topo.role, topo.group.Get_rank(), topo.group.Get_size(),
                platform.node()[:64].encode(), str(self.device)[:32].encode(),
                rec.dropped if rec else 0, late)

    def finish(self, complete: bool, status: str) -> None:
        """Every rank: gather the events and rank rows to rank 0, which writes the final trace."""
        # the gathers below block: first make sure every rank got here, so a rank that hangs
        # at the very end is reported by the deadline (and the file written) like anywhere else
        wait_for(self.world.Ibarrier(), self.cfg.peer_timeout, "ranks at the end of the job",
                 self.stop_flag, self.watch, collective=True)
        events = self.world.gather(self.ctx.recorder.snapshot(), root=0)
        rows = self.world.gather(self.rank_row(), root=0)
        if self.rank == 0:
            events = np.concatenate(events) if events else np.zeros(0)
            self.write(complete, status, events, np.array(rows, dtype=RANK_DTYPE))

    def interrupted(self) -> int:
        """SIGTERM / SIGINT: every other rank sends rank 0 its events and row, rank 0 writes the
        partial file with them (a rank silent SHUTDOWN_GATHER_S after the signal is named); all
        ranks leave together, non-zero, within C.SHUTDOWN_S."""
        start = time.monotonic()
        if self.rank == 0:
            print("\nswiftspec run: interrupted (signal); writing what was generated", file=sys.stderr,
                  flush=True)
            self.close_open_requests("interrupted")
            if self.source is not None:   # --serve: the last chunk of a stream, 503 to the queue
                self.source.interrupted(self.results)
            events = ranks = None
            missing = ()
            if self.ctx is not None:     # (a signal during loading: rank 0's file as it stands)
                events, ranks, missing = self.gather_parts(start + SHUTDOWN_GATHER_S)
            self.write(complete=False, status="interrupted", events=events, ranks=ranks,
                       ranks_missing=missing)
        elif self.ctx is not None and self.watch.sent is None:
            self.sent_part = send_trace_part(self.world, self.trace_part())
        together = False
        try:   # let rank 0 finish writing before anyone leaves (a leaving rank may end the job)
            wait_for(self.world.Ibarrier(), max(1.0, start + C.SHUTDOWN_S - time.monotonic()),
                     "ranks at shutdown", StopFlag(), collective=True)
            together = True
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush(), sys.stderr.flush()
        for sent in (self.sent_part, self.watch.sent):   # rank 0 has them all: it passed the barrier
            if together and sent is not None:
                sent.Wait()
        if together:   # finalize (frees MPICH's /dev/shm segment) unless it would hang
            t = threading.Thread(target=MPI.Finalize, daemon=True)
            t.start()
            t.join(5.0)
        os._exit(EXIT_INTERRUPTED)

    def fail(self, exc: BaseException) -> int:
        """Any exception: one line from rank 0 (naming the failing rank), the partial trace
        written, the job aborted. -> EXIT_RUNTIME_ERROR (when the abort returns at all)."""
        role = self.topo.role_name if getattr(self, "topo", None) else "?"
        role = f"{role} on {platform.node()}"
        if isinstance(exc, (UserError, PeerError)):
            msg = str(exc)
        else:
            msg = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        line = f"swiftspec run: error on rank {self.rank} ({role}): {msg}"
        if isinstance(exc, RemoteFailure):   # relayed: name the rank that failed, not rank 0
            line = f"swiftspec run: error on rank {exc.rank} ({exc.role}): {exc.message}"
        if self.rank == 0:   # other ranks leave the one-line message to rank 0 (see below)
            print(line, file=sys.stderr, flush=True)
        if self.rank == 0:
            self.close_open_requests("error")
            try:
                events = ranks = None
                missing = ()
                if self.ctx is not None:   # the others' events, from their waits (AbortWatch)
                    events, ranks, missing = self.gather_parts(time.monotonic() + ERROR_GATHER_S, ask=True)
                self.write(complete=False, status=f"error: {msg}", events=events, ranks=ranks,
                           ranks_missing=missing)
            except Exception as write_exc:  # noqa: BLE001
                print(f"swiftspec run: could not write {self.cfg.out}: {write_exc}", file=sys.stderr)
            sys.stdout.flush(), sys.stderr.flush()
            self.world.Abort(EXIT_RUNTIME_ERROR)
            os._exit(EXIT_RUNTIME_ERROR)     # an abort that returned (its launcher is going away)
        if self.ctx is not None and self.watch.sent is None:   # its events first, then the notice
            self.sent_part = send_trace_part(self.world, self.trace_part())
        notify_rank0_and_abort(self.world, f"{role}: {msg}", EXIT_RUNTIME_ERROR, fallback_line=line)
        return EXIT_RUNTIME_ERROR


def mps_shared(gpu_sharing: dict | None, rank: int) -> str | None:
    """Why this rank's GPU steps must not be persistent kernels, or None: ranks that share a GPU
    under MPS run their kernels side by side, and two persistent kernels each holding part of
    the SMs while waiting for blocks that cannot start would stall (time-sliced sharing is safe)."""
    sharing = gpu_sharing or {}
    mps = sharing.get("mps_daemon") or []
    for group in sharing.get("shared_gpu_ranks") or []:
        if rank in group and rank < len(mps) and mps[rank]:
            return "ranks " + ",".join(map(str, group)) + " share this GPU under MPS"
    return None
