"""swiftspec_mpi.gpu.sharing: which ranks share a GPU, whether an MPS daemon serves them, the
note rank 0 prints and what the trace records (no GPU needed: the GPU identities are given)."""
from __future__ import annotations

from swiftspec_mpi.gpu import sharing as gs


def test_sharing_groups_by_host_and_gpu():
    entries = [(0, "verify", "n0", "GPU-a"), (1, "verify", "n0", "GPU-b"), (2, "draft", "n0", "GPU-a"),
               (3, "draft", "n1", "GPU-a"),          # same UUID string on another host: another GPU
               (4, "draft", "n0", None), (5, "draft", "n0", None)]   # CPU ranks never share
    assert gs.sharing_groups(entries) == [[0, 2]]
    assert gs.sharing_groups([(0, "verify", "n0", "GPU-a")]) == []
    three = [(r, "verify", "h", "GPU-x") for r in (2, 0, 1)] + [(3, "draft", "h", "GPU-y"), (4, "draft", "h", "GPU-y")]
    assert gs.sharing_groups(three) == [[0, 1, 2], [3, 4]]


def test_sharing_note_names_the_ranks_and_the_fix():
    entries = [(0, "verify", "node7", "GPU-a"), (1, "draft", "node7", "GPU-a")]
    groups = gs.sharing_groups(entries)
    note = gs.sharing_note(entries, groups, mps=False)
    assert "ranks 0 (verify), 1 (draft) on node7 share a GPU" in note
    assert "nvidia-cuda-mps-control -d" in note and "MPS=auto" in note
    assert gs.sharing_note(entries, groups, mps=True) is None
    assert gs.sharing_note(entries, [], mps=False) is None


def test_mps_daemon_detection(tmp_path):
    pipe = tmp_path / "pipe"
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    assert gs.mps_pipe_dir(env) == str(pipe) and gs.mps_pipe_dir({}) == gs.MPS_PIPE_DEFAULT
    assert not gs.mps_daemon_running(env)
    pipe.mkdir()
    assert not gs.mps_daemon_running(env)            # the folder alone is not a daemon
    (pipe / "control").write_text("")                # the daemon's control pipe
    assert gs.mps_daemon_running(env)


def test_gpu_uuid_of_cpu_is_none():
    assert gs.gpu_uuid("cpu") is None


class _World:
    """Two ranks' allgather as seen by one of them."""

    def __init__(self, rank, everyone):
        self.rank, self.everyone = rank, everyone

    def Get_rank(self):
        return self.rank

    def allgather(self, mine):
        assert mine[0] == self.rank
        return [mine if e[0] == self.rank else e for e in self.everyone]


def test_check_gpu_sharing_record_and_note(monkeypatch, capsys):
    monkeypatch.setattr(gs, "gpu_uuid", lambda device: "GPU-same")
    monkeypatch.setattr(gs.platform, "node", lambda: "h")
    monkeypatch.setattr(gs, "mps_daemon_running", lambda env=None: False)
    other = (1, "draft", "h", "GPU-same", False)
    rec = gs.check_gpu_sharing(_World(0, [(0, "verify", "h", "x", False), other]), "verify", "cuda:0")
    assert rec == {"gpu_uuids": ["GPU-same", "GPU-same"], "shared_gpu_ranks": [[0, 1]], "mps_daemon": [False, False]}
    assert "swiftspec run: note: ranks 0 (verify), 1 (draft) on h share a GPU" in capsys.readouterr().err
    gs.check_gpu_sharing(_World(1, [(0, "verify", "h", "GPU-same", False), other]), "draft", "cuda:0")
    assert capsys.readouterr().err == ""              # only rank 0 speaks
    monkeypatch.setattr(gs, "mps_daemon_running", lambda env=None: True)
    rec = gs.check_gpu_sharing(_World(0, [(0, "verify", "h", "x", True), (1, "draft", "h", "GPU-same", True)]),
                               "verify", "cuda:0")
    assert rec["mps_daemon"] == [True, True] and capsys.readouterr().err == ""
    # one of the sharing ranks without the daemon (another pipe directory): still a note
    gs.check_gpu_sharing(_World(0, [(0, "verify", "h", "x", True), (1, "draft", "h", "GPU-same", False)]),
                         "verify", "cuda:0")
    assert "share a GPU" in capsys.readouterr().err


def test_describe_for_analyze_and_bench():
    assert gs.describe(None) == "-" and not gs.time_sliced(None)         # a trace from before
    assert gs.describe({"gpu_uuids": [None, None], "shared_gpu_ranks": [], "mps_daemon": [False, False]}) == "cpu"
    assert gs.describe({"gpu_uuids": ["a", "b"], "shared_gpu_ranks": [], "mps_daemon": [False, False]}) == "no"
    shared = {"gpu_uuids": ["a", "b", "a"], "shared_gpu_ranks": [[0, 2]], "mps_daemon": [True, False, True]}
    assert gs.describe(shared) == "ranks 0,2 (MPS yes)" and not gs.time_sliced(shared)
    shared["mps_daemon"] = [True, True, False]
    assert gs.describe(shared) == "ranks 0,2 (MPS NO: time-sliced)" and gs.time_sliced(shared)

