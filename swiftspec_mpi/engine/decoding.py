"""The pieces every decoding loop shares: the target side (verify a token tree on top of the
committed KV), the draft side (grow the token tree, re-root it on accepted tokens), acceptance
(greedy, or sampling at temperature > 0) and the output tracker (stop conditions, streaming).

Invariant on both sides: the model's KV slots [0, P) hold every committed token but the last;
the last committed token is the tree root, at position P, and is forwarded by the next step.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from swiftspec_mpi import _tree
from swiftspec_mpi.engine.replay import calibrate, child_tokens, draft_children
from swiftspec_mpi.gpu.graphs import logits_argmax, logits_topk_logprobs
from swiftspec_mpi.network.transformer import chain_mask


def prompt_bucket(n: int, max_slots: int) -> int:
    """The length a GPU prompt forward of n tokens is padded to: a multiple of 16 up to 256,
    of 64 up to 1024, then of 256; n itself if that would not fit in max_slots."""
    step = 16 if n <= 256 else 64 if n <= 1024 else 256
    b = -(-n // step) * step
    return b if b <= max_slots else n


def prompt_buckets(max_slots: int, upto: int = 4096) -> list[int]:
    """Every bucket length up to min(max_slots, upto) (benchmarks/bench_ttft.py prepares them all;
    the engine's warm-up only those of its job's prompts)."""
    out, n = [], 1
    while True:
        b = prompt_bucket(n, max_slots)
        if b != prompt_bucket(n, 1 << 62) or b > upto:     # past max_slots, or past upto
            return out
        out.append(b)
        n = b + 1


def _prefill(model, prompt_ids: list[int]) -> int:
    """Forward prompt[:-1] into slots [0, P). Returns P = len(prompt) - 1.

    `Transformer.forward` with the causal flag (SDPA's causal kernel, no mask). On a GPU the
    prompt is padded at its end to `prompt_bucket` tokens, and the CUDA-graph wrapper replays
    the prompt graph the warm-up captured for that length (`GraphedModel.forward_prompt`; eager
    above graphs.PROMPT_GRAPH_MAX, each such length of the job run once by the warm-up,
    since the first eager forward of a new length costs ~50 ms more than the next ones on an
    H200). Padding is
    harmless: the real rows do not see the later padded ones (causal), whose KV lands in slots
    [P, bucket) that the decode steps overwrite before anything attends to them. The logits are
    not needed (the last prompt token is the first step's root): one row is computed. (A graph
    captured per exact prompt length, as before, cost a capture in each request.)"""
    n = len(prompt_ids) - 1
    if n > 0:
        dev = model_device(model)
        m = prompt_bucket(n, model.max_slots) if dev.type == "cuda" else n
        ids = list(prompt_ids[:-1]) + [0] * (m - n)
        model.forward_prompt(ids, n - 1)       # a CUDA-graph wrapper: its prompt graph of m tokens
        if dev.type == "cuda":   # the trace's prefill event then covers the GPU work, not its launch
            torch.cuda.current_stream(dev).synchronize()
    return n


def model_device(model) -> torch.device:
    """The device a model (or a GraphedModel) runs on; CPU when it does not say."""
    return torch.device(getattr(model, "device", "cpu"))


class TargetSide:
    """Target model state for one request. P = committed KV length = position of the root."""

    def __init__(self, model):
        self.model = model
        self.device = model_device(model)
        self.P = 0

    def prefill(self, prompt_ids: list[int]) -> None:
        """Write the KV of prompt_ids[:-1] (P = len - 1 tokens) in slots [0, P); the last prompt
        token is the first tree's root."""
        self.P = _prefill(self.model, prompt_ids)

    def forward_tree(self, tokens: np.ndarray, parents: np.ndarray, greedy: bool = False):
        """tokens int64[n] (tokens[0] = root), parents int32[n] (-1 for the root, parents before
        children) -> target logits float32[n, vocab], or with `greedy` only their argmax int64[n]
        (computed inside the CUDA graph when the model has one: GraphedModel.forward_argmax).
        KV of the n nodes goes to [P, P+n)."""
        positions, mask = _tree.subtree_masks(np.ascontiguousarray(parents, dtype=np.int32), self.P)
        # host tensors: the model (or its CUDA-graph wrapper) moves them in one go
        return verify_forward(self.model, torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64)),
                              torch.from_numpy(positions), self.P, torch.from_numpy(mask), greedy)

    def commit(self, path: np.ndarray) -> None:
        """Keep the KV of the accepted path (local node indices, root first) contiguous at
        [P, P + len(path)); the rest of the tree's KV is dead."""
        a = len(path)
        src = torch.as_tensor(self.P + np.asarray(path, dtype=np.int64))
        dst = torch.arange(self.P, self.P + a, dtype=torch.long)
        moved = src != dst
        if bool(moved.any()):
            self.model.compact_kv(src[moved], dst[moved])
        self.P += a


def verify_forward(model, tokens, positions, start: int, mask, greedy: bool):
    """The target's forward as verification reads it: float32 logits [N, vocab], or with
    `greedy` only their argmax int64 [N] (inside the CUDA graph when the model has one)."""
    if not greedy:
        return model.forward(tokens, positions, start, mask)
    fast = getattr(model, "forward_argmax", None)
    return fast(tokens, positions, start, mask) if fast is not None else \
        logits_argmax(model.forward(tokens, positions, start, mask))


class DraftSide:
    """Draft model + token tree for one request. `replay` (replay.Replay; `run --accept-from`):
    the children's log-probabilities are the acceptance model's (replay.calibrate)."""

    def __init__(self, model, width: int, topk: int, capacity: int, max_depth: int, replay=None):
        self.model = model
        self.replay = replay
        self.device = model_device(model)
        self.width, self.topk = width, topk
        self.tree = _tree.TokenTree(capacity, max_depth)
        self.kv_used = 0
        self.max_slots = model.max_slots

    def prefill(self, prompt_ids: list[int]) -> None:
        """Write the draft's KV of prompt_ids[:-1] in slots [0, P) and root a fresh tree at the
        last prompt token (position P)."""
        P = _prefill(self.model, prompt_ids)
        self.tree.reset(int(prompt_ids[-1]), P)
        self.kv_used = P

    def root_expanded(self) -> bool:
        """Whether the root has children and its KV slot is written."""
        return self.tree.num_expanded > 0 and int(self.tree.kv_slot[0]) >= 0

    def select(self) -> np.ndarray:
        """The leaves to expand next (empty when the tree or the KV buffer is full)."""
        room = self.max_slots - self.kv_used
        if room <= 0:
            return np.zeros(0, dtype=np.int32)
        leaves = self.tree.select_leaves(min(self.width, room))
        return leaves

    def expand(self, leaves: np.ndarray, share=None, between_layers=None) -> bool:
        """One batched draft forward over `leaves` (int32[n]); adds top-k children to each.
        Returns True, or False when `between_layers` abandoned it.

        Every rank of a tensor-parallel group runs the same forward (its all-reduces pair up);
        `share(ids int64[n, k], lps float32[n, k]) -> (ids, lps)` then makes the group adopt the
        leader's top-k (a broadcast), so the trees of all ranks stay bit-identical.

        `between_layers(done, total) -> bool` (Transformer.forward; the engine's is
        abandon.LayerCheck) may stop the forward after any layer: the expansion is then
        abandoned and the draft side is as before it. The tree is restored from a copy taken
        before `assign_slots` (kv_slot, expanded, num_expanded of the leaves); kv_used is
        unchanged, so the K/V the stopped forward wrote in slots [kv_used, kv_used + n) lies in
        free slots, which no mask shows and the next forward into them rewrites in every layer.
        A graphed model (CUDA graph: `forward_topk_logprobs`) runs its forward whole."""
        n = len(leaves)
        if getattr(self.model, "forward_topk_logprobs", None) is not None:
            between_layers = None        # a graphed forward runs whole: no check, no tree copy
        before = self.tree.copy() if between_layers is not None else None
        self.tree.assign_slots(leaves, self.kv_used)
        positions, mask = self.tree.masks(leaves, self.kv_used + n)
        tokens = torch.from_numpy(self.tree.tokens_of(leaves))
        top = draft_topk(self.model, self.topk, tokens, torch.from_numpy(positions), self.kv_used,
                         torch.from_numpy(mask), between_layers=between_layers)
        if top is None:
            self.tree = before
            return False
        ids, lps = top
        if share is not None:
            ids, lps = share(ids, lps)
        if self.replay is not None:
            ids, lps = draft_children(self.replay, self.tree, leaves, ids.shape[1])
        self.tree.expand(leaves, ids, lps)
        self.kv_used += n
        return True

    def expansion_survives(self, leaves: np.ndarray, accepted: np.ndarray) -> bool:
        """Whether any of `leaves` (int32[n], being expanded) keeps its place after
        `reroot(accepted)` (int64[k]: k-1 accepted draft tokens, then the bonus): a leaf does iff
        its root path (the tokens of depths 1..d) runs along `accepted` (d >= k: it lies under
        the new root, or is it) or is the accepted draft tokens themselves (d = k-1: its KV
        fills the slot the re-root commits it to). When none does, the re-root drops every
        node (and KV) the expansion would add, so finishing it is wasted work."""
        tok, par = self.tree.token, self.tree.parent
        depth = self.tree.depth
        k = len(accepted)
        for leaf in np.asarray(leaves).tolist():
            d = int(depth[leaf])
            if d < k - 1:
                continue
            path = []
            node = leaf
            while node > 0:
                path.append(int(tok[node]))
                node = int(par[node])
            path.reverse()                                   # tokens of depths 1..d
            m = min(d, k)
            if all(path[j] == int(accepted[j]) for j in range(m)):
                return True
        return False

    def best_subtree(self, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The `bs` most likely nodes as a subtree: (tokens int64[n], parents int32[n], scores
        float64[n]), n <= bs, node 0 the root, parents before children (-1 for the root), scores
        the nodes' path log-probabilities under the draft (0 at the root)."""
        nodes, parents = self.tree.best_subtree(bs)
        return self.tree.tokens_of(nodes), parents, np.asarray(self.tree.score)[nodes]

    def reroot(self, accepted: np.ndarray, share=None) -> int:
        """Re-root on the accepted tokens (draft tokens + bonus); move the surviving KV.
        Returns the number of KV slots kept for the surviving subtree.

        When the target accepted a leaf the draft never forwarded (its KV is missing at slot
        P-1, P = the new root position), that token and the new root are forwarded as one
        2-token chain: the hole is filled and the root expanded in the same pass."""
        src, dst, new_root_pos, _needs_forward = self.tree.reroot(np.ascontiguousarray(accepted, dtype=np.int64))
        if len(src):
            self.model.compact_kv(torch.from_numpy(src), torch.from_numpy(dst))
        self.kv_used = new_root_pos + self.tree.num_expanded
        if self.tree.prefix_kv_missing:
            self._fill_hole_and_expand_root(int(accepted[-2]) if len(accepted) > 1 else None, share)
        return int(self.tree.num_expanded)

    def _fill_hole_and_expand_root(self, last_committed: int | None, share) -> None:
        P = self.tree.root_pos
        if last_committed is None:
            raise RuntimeError("draft KV hole without an accepted draft token (scheduler bug)")
        tokens = torch.tensor([last_committed, int(self.tree.token[0])], dtype=torch.long)
        positions = torch.tensor([P - 1, P], dtype=torch.long)
        ids, lps = draft_topk(self.model, self.topk, tokens, positions, P - 1, chain_mask(P - 1, 2),
                              logits_row=1)      # the root's row
        if share is not None:
            ids, lps = share(ids, lps)
        if self.replay is not None:
            lps = calibrate(self.replay, np.zeros(1, dtype=np.int64), lps.shape[1])
            ids = child_tokens(self.tree.token[:1], ids.shape[1], self.replay.vocab)
        root = np.zeros(1, dtype=np.int32)
        self.tree.assign_slots(root, P)
        self.tree.expand(root, ids, lps)
        self.kv_used = P + 1


def draft_topk(model, k: int, tokens, positions, start: int, mask, logits_row: int | None = None,
               between_layers=None) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids int64[n, k], log-probs float32[n, k]): the top-k of log_softmax of each row's logits
    (only row `logits_row`'s, [1, k], if given), inside the CUDA graph when the model has one
    (GraphedModel.forward_topk_logprobs, which ignores `between_layers`). None when
    `between_layers` stopped the forward (Transformer.forward)."""
    fast = getattr(model, "forward_topk_logprobs", None)
    if fast is not None:
        ids, lps = fast(tokens, positions, start, mask, k)
        return (ids, lps) if logits_row is None else (ids[logits_row:logits_row + 1], lps[logits_row:logits_row + 1])
    rows = None if logits_row is None else torch.tensor([logits_row])
    logits = model.forward(tokens, positions, start, mask, logits_rows=rows,
                           **({} if between_layers is None else {"between_layers": between_layers}))
    return None if logits is None else logits_topk_logprobs(logits, k)


class Acceptor:
    """Chooses the accepted path of a verified tree (on the verify leader).

    greedy (temperature 0): a child is accepted iff it is the target's argmax at its parent.
    coupled (temperature > 0, default): the target's token at output position t is the inverse
    CDF of its distribution at the uniform u[t] drawn from (seed, request); a child is accepted
    iff it equals that token. Every committed token is an exact sample of the target, the
    acceptance probability equals the multi-branch residual rule's, and the output is the same
    whatever tree the draft happened to send (so async runs are reproducible and equal `ar`).
    residual: the EAGLE/SpecInfer multi-branch rule (scheduler `verify_sample`), consuming a
    per-request uniform stream in order (reproducible in sync/ar, not in async)."""

    def __init__(self, temperature: float, rule: str, seed: int):
        self.temperature, self.rule, self.seed = temperature, rule, seed
        self.top_logprobs: int | None = None   # the request in flight wants log-probabilities
                                               # (and this many alternatives); every verify rank

    @property
    def greedy(self) -> bool:
        """Temperature 0: `accept` needs only the target's argmax per node, not its logits."""
        return self.temperature == 0.0

    @property
    def argmax_only(self) -> bool:
        """The verify forward may return the argmax alone (greedy, and no log-probabilities
        asked): on a GPU the argmax is read inside the CUDA graph."""
        return self.greedy and self.top_logprobs is None

    def start_request(self, request_index: int, max_new_tokens: int, verify_size: int) -> None:
        """Seed the request's random streams from (seed, request_index): the same request gives
        the same samples in every mode."""
        rng = np.random.default_rng([self.seed, request_index])
        self.uniforms = rng.random(max_new_tokens + verify_size + 2)
        self.residual_rng = np.random.default_rng([self.seed, request_index, 1])

    def accept(self, tokens: np.ndarray, parents: np.ndarray, logits: torch.Tensor,
               out_len: int, hand=None) -> tuple[np.ndarray, np.ndarray]:
        """-> (path int32[a] local indices from the root, accepted int64[a]: draft tokens + bonus).
        `logits`: the target's float32[n, vocab], or when greedy its argmax int64[n]; `hand` (the
        tree at hand, replay.ReplayAcceptor reads the draft's confidence there) is not needed here."""
        if self.greedy:
            choice = logits if isinstance(logits, np.ndarray) else logits_argmax(logits)
            return _tree.verify_greedy(tokens, parents, choice)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.rule == "residual":
            uni = self.residual_rng.random(len(tokens) + 1)
            return _tree.verify_sample(tokens, parents, probs.cpu().numpy().astype(np.float32), uni)
        depth = np.zeros(len(tokens), dtype=np.int64)
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
        u = torch.from_numpy(self.uniforms[np.minimum(out_len + depth, len(self.uniforms) - 1)])
        cdf = torch.cumsum(probs.double().cpu(), dim=-1)
        choice = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
        choice = torch.clamp(choice, max=probs.shape[-1] - 1).numpy().astype(np.int64)
        return _tree.verify_greedy(tokens, parents, choice)


def committed_logprobs(logits: torch.Tensor, path: np.ndarray, accepted: np.ndarray,
                       k: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """The target's log-probabilities (log_softmax of its logits, before any temperature) of a
    step's committed tokens: accepted[j] was chosen from the distribution at tree node path[j].
    logits float[n, vocab], path int32[a], accepted int64[a] -> a entries (token, logprob,
    the k most likely tokens [(token, logprob)] best first)."""
    rows = torch.log_softmax(logits[torch.as_tensor(np.asarray(path, dtype=np.int64), device=logits.device)]
                             .float(), dim=-1)                                  # [a, vocab]
    chosen = torch.as_tensor(np.asarray(accepted, dtype=np.int64), device=rows.device)
    lp = rows.gather(1, chosen.view(-1, 1)).squeeze(1).cpu().tolist()
    top_lp, top_id = (rows.topk(k, dim=-1) if k > 0 else (rows[:, :0], rows[:, :0].long()))
    top = [list(zip(i, v)) for i, v in zip(top_id.cpu().tolist(), top_lp.cpu().tolist())]
    return [(int(t), float(v), alt) for t, v, alt in zip(np.asarray(accepted).tolist(), lp, top)]


class OutputTracker:
    """Appends committed tokens to a request's output, applies stop conditions, streams text."""

    def __init__(self, result, tokenizer, eos_ids, max_new_tokens: int, stop: list[str],
                 stream: bool, sink=None, abandoned=None):
        from swiftspec_mpi.checkpoints.tokenizer import StreamDecoder
        self.sink = sink        # callable(text piece, logprob entries of the tokens it completes)
                                # instead of stdout (an HTTP response; --serve)
        self.abandoned = abandoned   # callable() -> True when nobody reads the answer any more
        self.result = result
        self.tokenizer = tokenizer
        self.eos = set(eos_ids)
        self.max_new = max_new_tokens
        self.stop = stop
        self.stream = stream
        self.decoder = StreamDecoder(tokenizer)
        self.text = ""
        self.unsent: list = []  # logprob entries of tokens whose text is not complete yet

    def add(self, tokens, logprobs=None) -> tuple[int, bool]:
        """Take tokens in order until a stop condition. -> (tokens taken, done). `logprobs`:
        their committed_logprobs entries, kept in result.logprobs (end of sequence excluded)."""
        taken = 0
        for j, t in enumerate(tokens):
            t = int(t)
            self.result.output_ids.append(t)
            taken += 1
            if t in self.eos:
                self.result.stop_reason = "eos"
                return taken, True
            if logprobs is not None:
                self.result.logprobs.append(logprobs[j])
                self.unsent.append(logprobs[j])
            piece = self.decoder.push([t])
            if piece:
                self.text += piece
                if self.sink is not None:
                    self.sink(piece, self.unsent)
                    self.unsent = []
                elif self.stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            if self.stop and any(s in self.text[-(len(s) + len(piece) + 8):] for s in self.stop):
                self.result.stop_reason = "stop_string"
                return taken, True
            if len(self.result.output_ids) >= self.max_new:
                self.result.stop_reason = "max_new_tokens"
                return taken, True
            if self.abandoned is not None and self.abandoned():   # the HTTP client left (--serve)
                self.result.stop_reason = "cancelled"
                return taken, True
        return taken, False

    def finish(self) -> None:
        """The request ended: its text without EOS tokens into the result; end the streamed line."""
        ids = [t for t in self.result.output_ids if t not in self.eos]
        self.result.text = self.tokenizer.decode(ids)
        if self.stream and self.sink is None:
            sys.stdout.write("\n")
            sys.stdout.flush()
