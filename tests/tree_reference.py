"""Pure-Python reference of the token-tree scheduler (tests only).

Same semantics as ``swiftspec_mpi._tree`` (scheduler/tree.pyx), written independently and for
readability: nodes are objects in a list, children are explicit lists, choices are made by
sorting with an explicit key. The tests run both on the same random operation sequences and
compare every output and the resulting tree arrays.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

ALIVE, SENT, ACCEPTED = 0, 1, 2


@dataclass
class Node:
    token: int
    parent: int                # -1 for the root
    depth: int
    logprob: float             # edge log-probability (root 0)
    score: float               # cumulative log-probability from the root (root 0)
    kv_slot: int = -1
    state: int = ALIVE
    expanded: bool = False
    children: list[int] = field(default_factory=list)


def rank_key(node_id: int, node: Node) -> tuple:
    """Sort key: higher score first, then lower depth, then lower id."""
    return (-node.score, node.depth, node_id)


class RefTree:
    def __init__(self, capacity: int, max_depth: int):
        if capacity < 1 or max_depth < 1:
            raise ValueError("capacity and max_depth must be >= 1")
        self.capacity = capacity
        self.max_depth = max_depth
        self.last_k = 1
        self.reset(0, 0)

    # -- state ---------------------------------------------------------------------------------

    def reset(self, root_token: int, root_pos: int) -> None:
        if root_pos < 0:
            raise ValueError("root_pos must be >= 0")
        self.nodes = [Node(root_token, -1, 0, 0.0, 0.0, state=ACCEPTED)]
        self.root_pos = root_pos
        self.prefix_kv_missing = False

    @property
    def size(self) -> int:
        return len(self.nodes)

    @property
    def num_expanded(self) -> int:
        return sum(1 for node in self.nodes if node.expanded)

    def arrays(self) -> dict[str, list]:
        """The tree as columns, for comparison with the Cython views."""
        return {
            "token": [n.token for n in self.nodes],
            "parent": [n.parent for n in self.nodes],
            "depth": [n.depth for n in self.nodes],
            "logprob": [n.logprob for n in self.nodes],
            "score": [n.score for n in self.nodes],
            "kv_slot": [n.kv_slot for n in self.nodes],
            "state": [n.state for n in self.nodes],
            "expanded": [n.expanded for n in self.nodes],
        }

    # -- draft cycle ---------------------------------------------------------------------------

    def select_leaves(self, w: int, k: int = 0) -> list[int]:
        candidates = [i for i, n in enumerate(self.nodes)
                      if not n.expanded and n.depth < self.max_depth]
        candidates.sort(key=lambda i: rank_key(i, self.nodes[i]))
        chosen = candidates[:w]
        per_leaf = k if k > 0 else self.last_k
        if self.size + len(chosen) * per_leaf > self.capacity:
            return []
        return chosen

    def assign_slots(self, leaves: list[int], first_slot: int) -> None:
        if first_slot < self.root_pos:
            raise ValueError("first_slot inside the committed prefix")
        if len(set(leaves)) != len(leaves):
            raise ValueError("repeated node")
        for leaf in leaves:
            if not 0 <= leaf < self.size or self.nodes[leaf].expanded:
                raise ValueError("bad or already expanded node")
        for i, leaf in enumerate(leaves):
            self.nodes[leaf].kv_slot = first_slot + i
            self.nodes[leaf].expanded = True

    def ancestors_and_self(self, node_id: int) -> list[int]:
        chain = []
        while node_id != -1:
            chain.append(node_id)
            node_id = self.nodes[node_id].parent
        return chain

    def masks(self, leaves: list[int], ncols: int) -> tuple[list[int], list[list[bool]]]:
        positions, mask = [], []
        for leaf in leaves:
            positions.append(self.root_pos + self.nodes[leaf].depth)
            visible = {self.nodes[a].kv_slot for a in self.ancestors_and_self(leaf)}
            visible.discard(-1)
            if any(slot >= ncols for slot in visible):
                raise ValueError("slot beyond ncols")
            mask.append([j < self.root_pos or j in visible for j in range(ncols)])
        return positions, mask

    def expand(self, leaves: list[int], topk_ids, topk_logprobs) -> list[int]:
        new_ids = []
        k = len(topk_ids[0]) if len(leaves) else 0
        if len(leaves) and self.size + len(leaves) * k > self.capacity:
            raise ValueError("capacity exceeded")
        for leaf, row_ids, row_lps in zip(leaves, topk_ids, topk_logprobs):
            parent = self.nodes[leaf]
            if not parent.expanded or parent.children:
                raise ValueError("leaf not expandable")
            for token, lp in zip(row_ids, row_lps):
                lp = float(lp)
                if math.isnan(lp):
                    raise ValueError("NaN log-probability")
                self.nodes.append(Node(int(token), leaf, parent.depth + 1, lp, parent.score + lp))
                parent.children.append(self.size - 1)
                new_ids.append(self.size - 1)
        if len(leaves):
            self.last_k = k
        return new_ids

    def best_subtree(self, bs: int) -> tuple[list[int], list[int]]:
        """Best-first growth from the root: always take the best child of the chosen set."""
        chosen: list[int] = []
        local_index: dict[int, int] = {}
        frontier = [(rank_key(0, self.nodes[0]), 0)]
        while frontier and len(chosen) < bs:
            _, node_id = heapq.heappop(frontier)
            local_index[node_id] = len(chosen)
            chosen.append(node_id)
            for child in self.nodes[node_id].children:
                heapq.heappush(frontier, (rank_key(child, self.nodes[child]), child))
        parents_local = [-1] + [local_index[self.nodes[n].parent] for n in chosen[1:]]
        for node_id in chosen[1:]:
            self.nodes[node_id].state = SENT
        return chosen, parents_local

    def tokens_of(self, node_ids: list[int]) -> list[int]:
        return [self.nodes[i].token for i in node_ids]

    def reroot(self, accepted_tokens: list[int]):
        if not accepted_tokens:
            raise ValueError("need the bonus token")
        path = [0]
        for token in accepted_tokens[:-1]:
            match = [c for c in self.nodes[path[-1]].children if self.nodes[c].token == token]
            if not match:
                raise ValueError(f"accepted token {token} is not a child")
            path.append(match[0])
        bonus = accepted_tokens[-1]
        new_root_candidates = [c for c in self.nodes[path[-1]].children
                               if self.nodes[c].token == bonus]
        old_root_pos = self.root_pos
        new_root_pos = old_root_pos + len(accepted_tokens)
        moves = []
        for offset, node_id in enumerate(path):
            node = self.nodes[node_id]
            if node.expanded and node.kv_slot != old_root_pos + offset:
                moves.append((node.kv_slot, old_root_pos + offset))
        self.prefix_kv_missing = not self.nodes[path[-1]].expanded

        if not new_root_candidates:
            self.nodes = [Node(bonus, -1, 0, 0.0, 0.0, state=ACCEPTED)]
        else:
            new_root = new_root_candidates[0]
            keep = set(self.descendants(new_root))
            survivors = sorted(keep)                  # keep the old relative order
            renumber = {old: new for new, old in enumerate(survivors)}
            new_nodes = []
            next_slot = new_root_pos
            for old in survivors:
                node = self.nodes[old]
                is_root = old == new_root
                parent = -1 if is_root else renumber[node.parent]
                logprob = 0.0 if is_root else node.logprob
                score = 0.0 if is_root else new_nodes[parent].score + logprob
                slot = -1
                if node.expanded:
                    slot = next_slot
                    next_slot += 1
                    if node.kv_slot != slot:
                        moves.append((node.kv_slot, slot))
                new_nodes.append(Node(node.token, parent, node.depth - self.nodes[new_root].depth,
                                      logprob, score, slot, ACCEPTED if is_root else ALIVE,
                                      node.expanded, [renumber[c] for c in node.children]))
            self.nodes = new_nodes
        self.root_pos = new_root_pos
        src = [m[0] for m in moves]
        dst = [m[1] for m in moves]
        return src, dst, new_root_pos, not self.nodes[0].expanded

    def descendants(self, node_id: int) -> list[int]:
        out, stack = [], [node_id]
        while stack:
            current = stack.pop()
            out.append(current)
            stack.extend(self.nodes[current].children)
        return out


# -- verification --------------------------------------------------------------------------------


def ref_depths(parents_local: list[int]) -> list[int]:
    depths = []
    for i, p in enumerate(parents_local):
        if (i == 0) != (p == -1) or p >= i:
            raise ValueError("parents_local not topological")
        depths.append(0 if p == -1 else depths[p] + 1)
    return depths


def ref_subtree_masks(parents_local: list[int], root_pos: int):
    depths = ref_depths(parents_local)
    n = len(parents_local)
    positions = [root_pos + d for d in depths]
    mask = []
    for i in range(n):
        chain, node = set(), i
        while node != -1:
            chain.add(node)
            node = parents_local[node]
        mask.append([j < root_pos or (j - root_pos) in chain for j in range(root_pos + n)])
    return positions, mask


def children_in_order(parents_local: list[int], node: int) -> list[int]:
    return [j for j, p in enumerate(parents_local) if p == node]


def ref_verify_greedy(tokens, parents_local, target_argmax):
    ref_depths(parents_local)
    path = [0]
    while True:
        current = path[-1]
        match = [c for c in children_in_order(parents_local, current)
                 if tokens[c] == target_argmax[current]]
        if not match:
            break
        path.append(match[0])
    accepted = [tokens[i] for i in path[1:]] + [target_argmax[path[-1]]]
    return path, accepted


def ref_verify_sample(tokens, parents_local, target_probs, uniforms):
    """Multi-branch residual rule; float arithmetic in the same order as the Cython walk
    (float64 row sum in four lanes, residual mass by subtraction, sequential inverse CDF by
    token id)."""
    ref_depths(parents_local)
    u_iter = iter(float(u) for u in uniforms)
    path = [0]
    accepted = []
    while True:
        current = path[-1]
        row = [float(p) for p in target_probs[current]]
        lanes = [0.0, 0.0, 0.0, 0.0]          # the Cython row sum: lane v % 4, then pairs
        for v, p in enumerate(row):
            lanes[v % 4] += p
        mass = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])
        if not mass > 0.0:
            raise ValueError("row without mass")
        rejected: set[int] = set()
        moved = False
        for child in children_in_order(parents_local, current):
            token = int(tokens[child])
            p_child = 0.0 if token in rejected else row[token]
            u = next(u_iter)
            if p_child > 0.0 and (p_child >= mass or u * mass < p_child):
                accepted.append(token)
                path.append(child)
                moved = True
                break
            if p_child > 0.0:
                mass -= p_child
                rejected.add(token)
        if moved:
            continue
        threshold = next(u_iter) * mass
        running, chosen, last_positive = 0.0, None, None
        for v, p in enumerate(row):
            if v in rejected or not p > 0.0:
                continue
            running += p
            last_positive = v
            if running > threshold:
                chosen = v
                break
        if chosen is None:
            chosen = last_positive
        if chosen is None:
            chosen = max(range(len(row)), key=lambda v: (row[v], -v))
        accepted.append(chosen)
        return path, accepted
