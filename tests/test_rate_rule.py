"""The `rate` async policy's choice (engine/rate_rule.py) and the path log-probabilities a tree
message carries for it."""
import numpy as np

from swiftspec_mpi.engine.protocol import LeaderChannel, TreeMeta
from swiftspec_mpi.engine.rate_rule import MIN_OBS, ExpectedRate


def _model(verify_s=0.5, mass=3.0, accepted=2, turnaround_s=0.2, fresh_mass=4.0):
    r = ExpectedRate()
    for _ in range(MIN_OBS):
        assert not r.ready()
        r.observe_verify(verify_s, mass, accepted)
        r.observe_fresh(turnaround_s, fresh_mass)
    assert r.ready()
    return r


def test_waits_only_when_the_fresh_tree_pays_for_its_wait():
    # c = 2 / 3 accepted draft tokens per unit of mass; T = 0.5 s, W = 0.2 s;
    # fresh: (1 + 2/3 * 4) / 0.7 = 5.24 tok/s; at hand with mass m: (1 + 2/3 m) / 0.5
    r = _model()
    # break-even mass: (1 + 2/3 m) / 0.5 = 11/3 / 0.7  ->  m = (0.5 * 11 / 2.1 - 1) * 1.5 = 2.43
    assert r.prefers_wait(mass_hand=1.0, since_result_s=0.0)
    assert r.prefers_wait(mass_hand=2.4, since_result_s=0.0)
    assert not r.prefers_wait(mass_hand=2.5, since_result_s=0.0)
    assert not r.prefers_wait(mass_hand=4.0, since_result_s=0.0)
    # part of the wait already spent: waiting costs less, so a deeper tree at hand is passed over
    assert r.prefers_wait(mass_hand=2.5, since_result_s=0.1)
    # a wait longer than the mean costs nothing more: the fresh tree wins whenever it holds more
    assert r.prefers_wait(mass_hand=3.9, since_result_s=1.0) and not r.prefers_wait(4.1, 1.0)


def test_a_target_that_rejects_everything_never_waits():
    r = _model(accepted=0)          # c = 0: every tree commits just the bonus token
    assert not r.prefers_wait(mass_hand=0.01, since_result_s=0.0)


def test_tree_message_carries_path_logprobs():
    chan = LeaderChannel(4, 16)
    tokens = np.array([5, 6, 7], dtype=np.int64)
    parents = np.array([-1, 0, 1], dtype=np.int32)
    scores = np.array([0.0, -0.25, -1.5])
    buf = chan.pack_tree(3, 1, 40, tokens, parents, meta=TreeMeta(2, 9, 7, 4, 1.5), scores=scores)
    copy = buf.copy()                         # as it arrives in another buffer
    req, seq, root, t, p = chan.unpack_tree(copy)
    assert (req, seq, root) == (3, 1, 40) and t.tolist() == [5, 6, 7] and p.tolist() == [-1, 0, 1]
    assert np.array_equal(chan.tree_scores(copy), scores)
    assert chan.tree_meta(copy) == TreeMeta(2, 9, 7, 4, 1.5)
    chan.pack_tree(3, 2, 40, tokens[:2], parents[:2])   # no scores: zeros
    assert chan.tree_scores().tolist() == [0.0, 0.0]
