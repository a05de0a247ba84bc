"""The expected-throughput model behind `swiftspec plan` (docs/internals.md, "Choosing the split").

Tokens a step come from simulating the engine's own draft tree (decoding.DraftSide with the
scheduler's TokenTree, replay-calibrated log-probabilities) against the acceptance model
(replay.ReplayAcceptor): no model runs, only the tree policy and the model's draws. Two loops:

  sync   each step: d expansions of w leaves, verify the best n nodes, re-root on the result;
         the expansions all grow the tree under the committed tokens.
  async  the draft expands d times while the verify group checks the tree it sent, and only then
         learns the result and re-roots: expansions under rejected branches are lost.

Step times come from profiled forwards (t_target(n), t_draft(w) of the group's size g) and the
host time a step adds to them, measured by running the engine's sync loop for a few steps
(engine/host_time.py: h_s(n) a step, h_x(n) an expansion):

  sync                 t_step = (d + s) * t_draft(w) + t_target(n) + h_s + d * h_x
  async, own devices   t_step = t_target(n) + t_x + h_s + s * (t_draft(w) + h_x)
                       d = max(1, floor((t_target(n) + t_x + h_s) / (t_draft(w) + h_x)))
  async, one device    t_step = t_target(n) + (d + s) * t_draft(w) + t_x + h_s + d * h_x   (the
                       groups share the device's bandwidth: no overlap is counted, a lower bound)

where s counts the extra draft forwards a step on the critical path: in sync the re-root's
hole fills (the target took a leaf the draft had not expanded: its KV and the new root's
children take one more forward, of 2 tokens, counted as one of w), in async the steps whose
re-rooted tree is the bare root (the target's token was none of the draft's children), so that
the verify group waits for one expansion. The host terms of async are those of its own loops
where the profile ran them for this split and n (plan_profile.async_host: h_s is then all the
step waits for beyond t_target + t_x, the stalls included, so s * (t_draft + h_x) is dropped on
own devices and s * t_draft on a shared one); elsewhere (--gpus predictions) the sync loop's.
Where the async loops ran, their tokens a step also scale the simulation's (`token_scale`, the
mean of measured / simulated at the paces they ran): the simulation models the `fresh` policy's
trees, the engine's default `rate` sends others.

  tokens/s = E[tokens a step] / t_step

t_x is one result plus one tree message between the leaders (a measured round trip).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from swiftspec_mpi.engine.decoding import DraftSide
from swiftspec_mpi.engine.replay import Replay


SIM_VOCAB = 1 << 40     # token ids of the simulated tree (replay.child_tokens)


class _TreeOnlyDraft:
    """A stand-in draft model for the simulation: DraftSide's fast path (forward_topk_logprobs)
    runs nothing; the replay sets the children's tokens and log-probabilities."""

    device = "cpu"
    max_slots = 1 << 30
    calls = 0

    def forward_topk_logprobs(self, tokens, positions, start, mask, k):
        self.calls += 1
        return np.zeros((len(tokens), k), dtype=np.int64), np.zeros((len(tokens), k), dtype=np.float32)

    def compact_kv(self, src, dst):
        pass


def simulate(model: dict, mode: str, n: int, w: int, d: int, steps: int = 300, topk: int = 8,
             max_depth: int = 16, seed: int = 0) -> tuple[float, float]:
    """-> (mean tokens committed a step: accepted draft tokens + the bonus; extra draft forwards
    a step on the critical path: in sync the re-root's hole fills (the target took a leaf the
    draft never expanded: DraftSide.reroot forwards it with the new root), in async the steps
    whose re-rooted tree was the bare root, which the draft must expand before the verify group
    can start) over `steps` steps of the `mode` loop (sync | async) with verify size n, width w,
    d expansions a step."""
    replay = Replay.of(model, topk, seed, SIM_VOCAB)
    acceptor = replay.acceptor(seed, topk)
    acceptor.start_request(0, 0, n)
    fake = _TreeOnlyDraft()
    draft = DraftSide(fake, w, topk, max(1024, 4 * d * w * topk + 64), max_depth, replay=replay)
    draft.tree.reset(0, 0)
    total, stalls = 0, 0
    accepted = None
    for _ in range(steps):
        if mode == "sync" and accepted is not None:
            before = fake.calls
            draft.reroot(accepted)
            stalls += fake.calls - before
        if mode == "sync" or accepted is None:
            _grow(draft, d)
        tokens, parents, scores = draft.best_subtree(4 * n)     # the tree at hand, its best n verified
        _path, accepted = acceptor.accept(tokens[:n], parents[:n], None, 0, (parents, scores))
        total += len(accepted)
        if mode == "async":                # the draft grew the tree while the target verified
            _grow(draft, d)
            draft.reroot(accepted)
            if draft.tree.size < 2:        # nothing under the new root: one expansion first
                stalls += 1
                _grow(draft, 1)
        if draft.tree.size > draft.tree.capacity - 2 * w * topk - 2:
            tokens, parents, _ = draft.best_subtree(1)
            draft.tree.reset(int(tokens[0]), 0)     # keep the simulation's tree bounded
            draft.kv_used = 0
    return total / steps, stalls / steps


def _grow(draft: DraftSide, d: int) -> None:
    for _ in range(d):
        leaves = draft.select()
        if len(leaves) == 0:
            return
        draft.expand(leaves)


@dataclass
class Candidate:
    """One configuration `plan` weighs: the mode, draft / verify ranks, verify size n, width w,
    expansions a step d; what the model expects of it."""
    mode: str
    draft_ranks: int
    verify_ranks: int
    n: int
    w: int
    d: int
    tokens: float = 0.0           # expected tokens a step
    stall: float = 0.0            # extra draft forwards a step on the critical path (simulate)
    step_s: float = 0.0           # expected seconds a step
    shared: bool = False          # async with both groups on one device
    host_s: float = 0.0           # h_s: host seconds a step (engine/host_time.py)
    host_x: float = 0.0           # h_x: host seconds an expansion
    host_measured: bool = False   # async: h_s timed on the async loops themselves (stalls in it)
    token_scale: float = 1.0      # async: measured / simulated tokens a step where the loops ran

    @property
    def host_total(self) -> float:
        """Host seconds a step (step_seconds' host part)."""
        if self.mode == "sync" or self.shared:
            return self.host_s + self.host_x * self.d
        return self.host_s + (0.0 if self.host_measured else self.host_x * self.stall)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0


def async_expansions(t_target: float, t_draft: float, t_x: float, host_s: float = 0.0,
                     host_x: float = 0.0) -> int:
    """Expansions an unpaced draft on its own devices makes while the verify group runs a step."""
    return max(1, int((t_target + t_x + host_s) // max(t_draft + host_x, 1e-12)))


def step_seconds(c: Candidate, t_target: float, t_draft: float, t_x: float) -> float:
    """A step's seconds by the module doc's rules (t_target = t_target(n) at the verify group's
    size, t_draft = t_draft(w) at the draft group's), c.stall and the host terms known."""
    if c.mode == "sync":
        return (c.d + c.stall) * t_draft + t_target + c.host_s + c.d * c.host_x
    stall = 0.0 if c.host_measured else c.stall
    if c.shared:
        return t_target + (c.d + stall) * t_draft + t_x + c.host_s + c.d * c.host_x
    return t_target + t_x + c.host_s + stall * (t_draft + c.host_x)


def candidates(world: int, sizes: list[int], heads: tuple[int, int], max_d: int, shared: bool) -> list[Candidate]:
    """Every configuration of `world` ranks: sync on all of them (TP = world) for each n and
    d = 1..max_d, async for each draft group size D (TP D) and verify group size world - D, each
    n (w = n), d from the timing (own devices) or 1..max_d (one device). Groups whose size does
    not divide the model's heads (target, draft) are left out."""
    th, dh = heads
    out = []
    if th % world == 0 and dh % world == 0:
        out += [Candidate("sync", 0, world, n, n, d) for n in sizes for d in range(1, max_d + 1)]
    for D in range(1, world):
        V = world - D
        if th % V or dh % D:
            continue
        ds = range(1, max_d + 1) if shared else (0,)
        out += [Candidate("async", D, V, n, n, d, shared=shared) for n in sizes for d in ds]
    return out


def evaluate(cands: list[Candidate], model: dict, t_target: dict, t_draft: dict, t_x: float,
             topk: int = 8, max_depth: int = 16, steps: int = 300, cache: dict | None = None,
             host: dict | None = None, host_async: dict | None = None) -> list[Candidate]:
    """Fill tokens / step_s of each candidate; t_target[g][n], t_draft[g][w] seconds measured at
    group size g; host {n: {"step_s", "expansion_s"}} the sync loop's host terms
    (engine/host_time.py; none: 0), host_async {draft ranks: {n: {...}}} the async loops' where
    they were timed (plan_profile.async_host). -> the candidates, best tok/s first. Simulations
    are shared between candidates with the same (mode, n, w, d), and between calls given the
    same `cache`."""
    cache = {} if cache is None else cache
    for c in cands:
        tt, td = t_target[c.verify_ranks][c.n], t_draft[c.draft_ranks or c.verify_ranks][c.w]
        h = (host or {}).get(c.n) or {}
        c.host_s, c.host_x = h.get("step_s", 0.0), h.get("expansion_s", 0.0)
        ha = ((host_async or {}).get(c.draft_ranks) or {}).get(c.n) if c.mode == "async" else None
        if ha is not None:
            c.host_s, c.host_measured = ha["step_s"], True
            c.host_x = ha["expansion_s"] if c.shared else c.host_x
        if c.mode == "async" and not c.shared:
            c.d = async_expansions(tt, td, t_x, c.host_s, c.host_x)
        def sim(d: int, c=c) -> tuple[float, float]:
            key = (c.mode, c.n, c.w, d)
            if key not in cache:
                cache[key] = simulate(model, c.mode, c.n, c.w, d, steps, topk, max_depth)
            return cache[key]
        c.tokens, c.stall = sim(c.d)
        if ha is not None and ha.get("measured"):
            c.token_scale = float(np.mean([v[1] / sim(int(p) if c.shared else c.d)[0]
                                           for p, v in ha["measured"].items()]))
            c.tokens *= c.token_scale
        c.step_s = step_seconds(c, tt, td, t_x)
    return sorted(cands, key=lambda c: (-c.tok_s, c.mode, c.draft_ranks, c.n, c.d))


def scaled_times(times: dict[int, float], g: int, layers: int, allreduce_s: float) -> dict[int, float]:
    """Step times at tensor-parallel size g from those of one device: the weights a step reads
    split g ways, plus two all-reduces a layer (attention and MLP outputs): t / g + 2 L t_ar."""
    return {n: t / g + (2 * layers * allreduce_s if g > 1 else 0.0) for n, t in times.items()}


def fmt_ms(s: float) -> str:
    return f"{1e3 * s:.2f}" if math.isfinite(s) else "-"
