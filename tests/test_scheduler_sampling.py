"""Statistical test: ``verify_sample`` (the multi-branch residual rule on a deterministic top-k
tree) leaves the target distribution unchanged.

Small vocabulary, fixed target distributions, a 2-level tree whose root children include a
high-probability token, a zero-probability token and middling ones. Over many trials the first
committed token must follow p_root, and the second (when the first is a tree child) p_child.
Bounds shrink as 1/sqrt(trials); a slightly wrong distribution must be rejected at full size.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from swiftspec_mpi._tree import verify_sample

VOCAB = 6
P_ROOT = np.array([0.05, 0.40, 0.00, 0.25, 0.20, 0.10])

# local tree: 0 root; its children in local order: token 1 (p .40), 2 (p 0), 3 (.25), 5 (.10);
# under token 1: tokens 0 and 4; under token 3: token 3.
TOKENS = np.array([9, 1, 2, 3, 5, 0, 4, 3], dtype=np.int64)
PARENTS = np.array([-1, 0, 0, 0, 0, 1, 1, 3], dtype=np.int32)
ROWS = np.array([
    P_ROOT,
    [0.10, 0.10, 0.10, 0.10, 0.50, 0.10],      # after token 1 (its children 0 and 4 are tried)
    [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],      # after token 2 (never reached: p 0)
    [0.00, 0.30, 0.00, 0.60, 0.00, 0.10],      # after token 3 (its child 3 holds .6)
    [1 / 6] * 6,                               # after token 5 (no children: bonus only)
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
], dtype=np.float32)
CHILD_ROW = {int(TOKENS[i]): i for i in range(1, 5)}     # first token -> its node's row

TRIALS = 200_000


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularized upper incomplete gamma)."""
    import torch
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def tv_bound(p: np.ndarray, n: int) -> float:
    """4x the expected total-variation distance of an n-sample empirical distribution from p
    (E|X - np| ~ sqrt(2 n p (1-p) / pi)); it shrinks as 1/sqrt(n)."""
    return 4 * 0.5 * float(np.sum(np.sqrt(2 * p * (1 - p) / (math.pi * n))))


def check_matches(counts: np.ndarray, p: np.ndarray, label: str) -> float:
    """Assert the counts look like samples of p (chi-square p-value and TV bound); returns TV."""
    n = int(counts.sum())
    freq = counts / n
    tv = 0.5 * float(np.abs(freq - p).sum())
    assert np.all(counts[p == 0] == 0), f"{label}: zero-probability token committed"
    support = p > 0
    expected = n * p[support]
    stat = float(np.sum((counts[support] - expected) ** 2 / expected))
    p_value = chi2_sf(stat, int(support.sum()) - 1)
    assert p_value > 1e-4, f"{label}: chi-square {stat:.1f} (p-value {p_value:.2e}), TV {tv:.4f}"
    assert tv < tv_bound(p, n), f"{label}: TV {tv:.4f} >= bound {tv_bound(p, n):.4f} at n={n}"
    return tv


@pytest.fixture(scope="module")
def samples() -> tuple[np.ndarray, np.ndarray]:
    """First and second committed tokens (-1 if none) of TRIALS independent verifications."""
    rng = np.random.default_rng(20240917)
    uniforms = rng.random((TRIALS, len(TOKENS) + 1))
    probs = ROWS.copy()
    probs.flags.writeable = False          # a write would raise: the target is never touched
    first = np.empty(TRIALS, np.int64)
    second = np.full(TRIALS, -1, np.int64)
    for t in range(TRIALS):
        _, accepted = verify_sample(TOKENS, PARENTS, probs, uniforms[t])
        first[t] = accepted[0]
        if len(accepted) > 1:
            second[t] = accepted[1]
    assert np.array_equal(probs, ROWS)
    return first, second


def test_first_token_follows_target(samples):
    first, _ = samples
    tv_small = check_matches(np.bincount(first[:20_000], minlength=VOCAB), P_ROOT, "first@20k")
    tv_full = check_matches(np.bincount(first, minlength=VOCAB), P_ROOT, "first@200k")
    # the error shrinks with trials: expected ratio 1/sqrt(10) ~ 0.32 (allow noise; if the 20k
    # error happened to be small, the full one must at least be near its own expectation)
    expected_full = tv_bound(P_ROOT, TRIALS) / 4
    assert tv_full < 0.75 * tv_small or tv_full < 1.5 * expected_full, (tv_small, tv_full)


def test_second_token_follows_child_rows(samples):
    first, second = samples
    # a tree child is committed first iff it was accepted; then a second token always follows
    is_child = np.isin(first, list(CHILD_ROW))
    assert np.array_equal(second >= 0, is_child)
    for token, row in CHILD_ROW.items():
        if P_ROOT[token] == 0:
            continue
        after = second[first == token]
        check_matches(np.bincount(after, minlength=VOCAB), ROWS[row].astype(np.float64),
                      f"second|first={token}")


def test_check_has_power(samples):
    """The same samples against a distribution off by 0.01 on two tokens must be rejected."""
    first, _ = samples
    wrong = P_ROOT.copy()
    wrong[1] -= 0.01
    wrong[4] += 0.01
    with pytest.raises(AssertionError):
        check_matches(np.bincount(first, minlength=VOCAB), wrong, "wrong")


def test_naive_rule_would_fail():
    """Sanity of the rule itself: without the residual (bonus drawn from p, rejected children
    included) the first-token law is distorted far beyond the bound. Computed exactly."""
    children = [1, 2, 3, 5]
    accept_first = {}
    reach = 1.0
    residual_mass = 1.0
    for c in children:                       # the correct rule's acceptance probabilities
        a = P_ROOT[c] / residual_mass if residual_mass > 0 else 0.0
        accept_first[c] = reach * a
        reach *= 1 - a
        residual_mass -= P_ROOT[c]
    naive = np.array([accept_first.get(v, 0.0) for v in range(VOCAB)]) + reach * P_ROOT
    assert 0.5 * np.abs(naive - P_ROOT).sum() > 10 * tv_bound(P_ROOT, TRIALS)
