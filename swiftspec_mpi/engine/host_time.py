"""The host time of a decode step: what a step costs beyond its forwards (the scheduler's tree
work, the acceptor, the verdicts, the KV moves, the read-back copies, Python), measured by
running the engine's own loops (single_group.run_request_single; async_loop's, async_loop_step)
on loaded models for a few steps, acceptance replayed, and subtracting the forwards' profiled
times. For `sync`:

  H(n, d) = wall a step - (draft forwards a step) * t_draft(n) - t_target(n)

measured at two expansion counts d1 < d2 (w = n; each the mean of ROUNDS runs) gives the
per-step and per-expansion terms
  h_step(n) = H(n, d1) - d1 * h_expand(n),   h_expand(n) = (H(n, d2) - H(n, d1)) / (d2 - d1),
which engine/throughput.py adds to its step times (negative noise clamped to 0).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from swiftspec_mpi.engine.context import EngineContext
from swiftspec_mpi.engine.decoding import Acceptor, OutputTracker, draft_topk, verify_forward
from swiftspec_mpi.engine.protocol import StopFlag
from swiftspec_mpi.engine.replay import Replay
from swiftspec_mpi.engine.single_group import run_request_single
from swiftspec_mpi.network.transformer import chain_mask
from swiftspec_mpi.trace.record import Clock, EventRecorder, RequestResult

EXPANSIONS = (1, 3)     # d1, d2
WARM_STEPS = 4          # steps of each run not timed (graph captures, caches)
ROUNDS = 2              # runs of each loop, averaged (apart in time: a shared CPU's load varies)


class _CountingModel:
    """A model whose decode forwards (not the prompt's) are counted; everything else passes."""

    def __init__(self, model):
        self._model, self.calls = model, 0
        if getattr(model, "forward_topk_logprobs", None) is not None:
            self.forward_topk_logprobs = self._counted(model.forward_topk_logprobs)
        self.forward = self._counted(model.forward)

    def _counted(self, fn):
        def call(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return call

    def __getattr__(self, name):
        return getattr(self._model, name)


class _OneRank:
    """The topology of a one-rank group (EngineContext.topo as the loops read it)."""
    is_leader = True

    class group:  # noqa: N801 - stands for an MPI communicator of size 1
        @staticmethod
        def Get_size() -> int:  # noqa: N802 - mpi4py's name
            return 1


def loop_step(cfg, target, draft, tokenizer, model: dict, n: int, d: int, steps: int,
              prompt: list[int]) -> tuple[float, float, float]:
    """-> (seconds a step, draft forwards a step, tokens a step) of `steps` timed steps of the
    sync loop with verify size n, width n, d expansions, acceptance replayed from `model` (d = 0:
    the `ar` loop, the target alone, greedy), after WARM_STEPS untimed ones (one request of
    prompt ids `prompt`)."""
    cfg = dataclasses.replace(cfg, mode="sync" if d else "ar", verify_size=n, tree_width=n, expansions=d)
    vocab = min(target.cfg.vocab_size, draft.cfg.vocab_size)
    replay = Replay.of(model, cfg.tree_topk, 0, vocab) if d else None
    counted = _CountingModel(draft)
    clock = Clock()
    ctx = EngineContext(cfg, _OneRank(), clock, EventRecorder(0, 0, clock), StopFlag(), None, target,
                        counted if d else None, tokenizer, expansions=d, replay=replay)
    acceptor = replay.acceptor(0, cfg.tree_topk) if d else Acceptor(0.0, "coupled", 0)
    total = WARM_STEPS + steps + 1
    result = RequestResult(0, "", "", list(prompt))
    tracker = OutputTracker(result, tokenizer, (), 10 ** 9, [], stream=False)
    calls_at = []            # draft forwards so far, after each step (on_progress)
    ctx.on_progress = lambda: calls_at.append(counted.calls)
    _end_request(tracker, result, total, target.max_slots, n)
    acceptor.start_request(0, 1 << 20, n)
    run_request_single(ctx, list(prompt), 0, result, tracker, acceptor)
    warm = _warm_steps(result)
    rows = result.steps[warm:]
    t = np.array([r[3] for r in rows])
    tokens = np.array([r[2] for r in rows[:-1]])
    forwards = np.diff(np.array(calls_at[warm - 1:warm + len(rows) - 1]))
    return float(np.mean(np.diff(t))), float(forwards.mean()), float(tokens.mean())


def _end_request(tracker, result, total: int, slots: int, n: int) -> None:
    """Make `tracker` (OutputTracker) end its request after `total` steps, or once the next
    tree of n nodes might not fit the model's `slots` KV slots."""
    add = tracker.add

    def counted(tokens, logprobs=None):
        taken, done = add(tokens, logprobs)
        full = len(result.prompt_ids) + len(result.output_ids) + 2 * n + 2 > slots
        return taken, done or full or len(result.steps) + 1 >= total
    tracker.add = counted


def _warm_steps(result) -> int:
    """The steps not timed: WARM_STEPS, fewer when the request ended early (KV full), so that 3
    remain (a step's time is the start of the next one minus its own)."""
    if len(result.steps) < 3:
        raise RuntimeError("the host-time loop ended before 3 steps: the KV room is too small")
    return max(1, min(WARM_STEPS, len(result.steps) - 3))


def warm_shapes(target, draft, topk: int, n: int) -> None:
    """One forward of every shape up to n tokens the loops can ask for (CUDA graphs captured
    before the timed steps) of `target` (verify) and `draft` (top-k); None: skipped."""
    for m in range(1, n + 1):
        tokens, pos, mask = torch.zeros(m, dtype=torch.long), torch.arange(m, dtype=torch.long), chain_mask(0, m)
        if target is not None:
            verify_forward(target, tokens, pos, 0, mask, True)
        if draft is not None:
            draft_topk(draft, topk, tokens, pos, 0, mask)


def host_terms(cfg, target, draft, tokenizer, model: dict, sizes: list[int], t_target: dict,
               t_draft: dict, steps: int = 40, prompt: list[int] | None = None) -> tuple[dict[int, dict], float]:
    """-> ({n: {"step_s", "expansion_s", "measured": {d: [seconds a step, forwards a step, tokens
    a step]}}} for each verify size n (w = n): the module doc's terms from loop_step at
    EXPANSIONS, and the `ar` loop's host seconds a step (its step - t_target[1]); t_target[n] /
    t_draft[n] the profiled forwards (one device, seconds)."""
    prompt = prompt or list(range(1, 17))
    warm_shapes(target, draft, cfg.tree_topk, max(sizes))
    out = {}
    for n in sizes:
        meas, excess = {}, []
        for d in EXPANSIONS:
            wall, fwd, tok = np.mean([loop_step(cfg, target, draft, tokenizer, model, n, d, steps, prompt)
                                      for _ in range(ROUNDS)], axis=0).tolist()
            meas[d] = [wall, fwd, tok]
            excess.append(wall - fwd * t_draft[n] - t_target[n])
        (d1, d2), (h1, h2) = EXPANSIONS, excess
        per_x = max(0.0, (h2 - h1) / (d2 - d1))
        out[n] = {"step_s": max(0.0, h1 - d1 * per_x), "expansion_s": per_x, "measured": meas}
    ar = float(np.mean([loop_step(cfg, target, draft, tokenizer, model, 1, 0, steps, prompt)[0]
                        for _ in range(ROUNDS)]))
    return out, max(0.0, ar - t_target[1])


def async_loop_step(ctx: EngineContext, model: dict, n: int, pace: int, steps: int, prompt: list[int],
                    vocab: int) -> tuple[float, float] | None:
    """Every rank of an `async` topology (ctx.topo; ctx.target on the verify group, ctx.draft on
    the draft group, ctx.cfg with mode async and its policy): one request of the async loops with
    verify size n, width n, the draft paced at `pace` expansions a step (0: unpaced), acceptance
    replayed from `model`, for WARM_STEPS + `steps` + 1 steps. -> on the verify leader (seconds
    a step, tokens a step) of the timed steps, None elsewhere."""
    from swiftspec_mpi.core.roles import ROLE_VERIFY
    from swiftspec_mpi.engine.async_loop import draft_loop, verify_loop
    cfg = dataclasses.replace(ctx.cfg, verify_size=n, tree_width=n, expansions=pace or None)
    ctx = dataclasses.replace(ctx, cfg=cfg, draft_pace=pace, scratch={},
                              replay=Replay.of(model, cfg.tree_topk, 0, vocab))
    ctx.clock = Clock()
    ctx.recorder = EventRecorder(ctx.topo.rank, ctx.topo.role, ctx.clock)
    if ctx.topo.role != ROLE_VERIFY:
        draft_loop(ctx, list(prompt), 0)
        return None
    total = WARM_STEPS + steps + 1
    result = tracker = None
    acceptor = ctx.replay.acceptor(0, cfg.tree_topk)
    if ctx.topo.is_leader:
        result = RequestResult(0, "", "", list(prompt))
        tracker = OutputTracker(result, ctx.tokenizer, (), 10 ** 9, [], stream=False)
        _end_request(tracker, result, total, ctx.target.max_slots, n)
        acceptor.start_request(0, 1 << 20, n)
    verify_loop(ctx, list(prompt), 0, result, tracker, acceptor)
    if not ctx.topo.is_leader:
        return None
    rows = result.steps[_warm_steps(result):]
    t = np.array([r[3] for r in rows])
    return float(np.mean(np.diff(t))), float(np.mean([r[2] for r in rows[:-1]]))
