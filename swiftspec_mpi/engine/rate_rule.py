"""The `rate` async policy's choice: verify the tree at hand now, or wait for the draft's tree
re-rooted on the latest result (sent once it is --floor-depth deep)?

Whichever gives more expected tokens per second of the verify group:

    go on:  (1 + c * mass_hand) / T            wait:  (1 + c * mass_fresh) / (T + W)

mass_*  the draft's expected count of accepted draft tokens in the bs nodes to verify (the sum of
        their path probabilities under the draft, sent_tree.draft_mass); mass_fresh is the mean
        over the re-rooted trees seen so far (each arrives, waited for or not);
c       calibration: draft tokens the target accepted per unit of verified mass, so far;
1       the bonus token every step commits;
T       mean verify forward, seconds;
W       mean time from sending a result to receiving the tree re-rooted on it, less the time
        since the latest result was sent (what waiting still costs).

Every figure is a running mean over the job (requests alike), and the rule falls back to a
depth test (go on when the tree at hand is --floor-depth deep) until each has MIN_OBS
observations. The choice never changes the output (greedy acceptance commits the target's tokens
whatever tree it checks); only tok/s moves.
"""
from __future__ import annotations

MIN_OBS = 4


class ExpectedRate:
    """Running means of the rule's figures (one per job, kept across requests)."""

    def __init__(self):
        self.n_verify, self.verify_s, self.mass_verified, self.accepted = 0, 0.0, 0.0, 0
        self.n_fresh, self.fresh_wait_s, self.fresh_mass = 0, 0.0, 0.0

    def observe_verify(self, seconds: float, mass: float, accepted_draft: int) -> None:
        """A verify step: its forward time, the verified nodes' draft mass, the draft tokens it
        accepted (bonus not counted)."""
        self.n_verify += 1
        self.verify_s += seconds
        self.mass_verified += mass
        self.accepted += accepted_draft

    def observe_fresh(self, turnaround_s: float, mass: float) -> None:
        """A tree re-rooted on a result arrived: seconds from sending that result to the draft's
        sending of the tree, and the draft mass of its best bs nodes."""
        self.n_fresh += 1
        self.fresh_wait_s += max(0.0, turnaround_s)
        self.fresh_mass += mass

    def ready(self) -> bool:
        return self.n_verify >= MIN_OBS and self.n_fresh >= MIN_OBS and self.mass_verified > 0

    def prefers_wait(self, mass_hand: float, since_result_s: float) -> bool:
        """Whether waiting for the re-rooted tree gives more expected tokens per second than
        verifying the tree at hand (draft mass `mass_hand`) now. Call only when ready()."""
        T = self.verify_s / self.n_verify
        W = max(0.0, self.fresh_wait_s / self.n_fresh - since_result_s)
        c = self.accepted / self.mass_verified
        e_hand = 1.0 + c * mass_hand
        e_fresh = 1.0 + c * self.fresh_mass / self.n_fresh
        return e_fresh * T > e_hand * (T + W)
