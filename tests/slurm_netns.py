"""A private three-node Slurm cluster on one machine: each node a Linux network namespace.

Layout (names carry this process's pid, so parallel test runs never meet):

    namespace  <p>-br   bridge `br0` 10.77.0.254/24: slurmctld and every Slurm client run here
    namespace  <p>-n1   eth0 10.77.0.1/24, slurmd -N node1, hostname node1 (own UTS namespace)
    namespace  <p>-n2   eth0 10.77.0.2/24, slurmd -N node2, hostname node2
    namespace  <p>-n3   eth0 10.77.0.3/24, slurmd -N node3, hostname node3

Each node's eth0 is one end of a veth pair whose other end is a port of br0. No namespace has a
route anywhere else, so every packet of the cluster (Slurm RPCs, PMI, MPICH's TCP) stays between
the namespaces made here. Processes enter a namespace with `nsenter --net` (which, unlike `ip
netns exec`, keeps /sys and so the cgroup mounts slurmd wants) inside a private mount namespace
where the cluster's hosts file is bind-mounted over /etc/hosts (node names -> addresses). `partition(node)` takes a node's link down on
the bridge side: from then on its packets vanish (no TCP reset, no ICMP), as when a switch port or
cable dies.

The ranks of a job run inside their node's namespace with its hostname (the UTS namespace of its
slurmd), so MPICH sees three hosts and talks TCP between them; the file system is shared.

`close()` kills every process left in the namespaces (by pid, from `ip netns pids`), deletes the
namespaces (which deletes their links); it is idempotent and the
pytest fixture calls it also when a test fails. Needs root and `ip` (iproute2) and `unshare`.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from slurm_cluster import (DAEMONS, LEAKY_ENV, SEARCH_PATH, SlurmCluster, SlurmError, _pid_alive,
                           _terminate, _user, slurm_unavailable_reason)

NODES = ("node1", "node2", "node3")
SUBNET = "10.77.0"
CTL_ADDR = f"{SUBNET}.254"
SLURMCTLD_PORT, SLURMD_PORT = 6817, 6818      # every namespace has its own ports: no clash possible


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None = they can)."""
    reason = slurm_unavailable_reason()
    if reason:
        return reason
    if os.geteuid() != 0:
        return "network namespaces need root (the multi-node Slurm tests run as root in CI)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool, path=SEARCH_PATH) is None:
            return f"no `{tool}` command (Debian: apt-get install iproute2 util-linux)"
    probe = f"ssprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")
    return r


class NetnsCluster(SlurmCluster):
    """Three slurmd nodes in network namespaces and a slurmctld in the bridge namespace.

    Clients (`run`, `submit`, `job`, ...) work as in SlurmCluster: they run in the bridge
    namespace. `node_run(node, args)` runs a command inside a node's namespace."""

    def __init__(self, base, cpus: int = 4):
        super().__init__(base, cpus=cpus, gpus=0)
        tag = f"ss{os.getpid()}"
        self.bridge_ns = f"{tag}-br"
        self.node_ns = {n: f"{tag}-n{i + 1}" for i, n in enumerate(NODES)}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(NODES)}
        self.slurmds: dict[str, subprocess.Popen] = {}
        self.made_ns: list[str] = []

    # ------------------------------------------------------------------ network
    def _hosts_file(self) -> str:
        host = _host()
        lines = ["127.0.0.1 localhost", f"{CTL_ADDR} ctl {host}"]
        lines += [f"{a} {n}" for n, a in self.addr.items()]
        return "\n".join(lines) + "\n"

    def make_network(self) -> None:
        self.path("etc").mkdir(parents=True, exist_ok=True)
        self.path("etc", "hosts").write_text(self._hosts_file())
        for ns in [self.bridge_ns, *self.node_ns.values()]:
            _ip("netns", "add", ns)
            self.made_ns.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        br = self.bridge_ns
        _ip("link", "add", "br0", "type", "bridge", ns=br)
        _ip("addr", "add", f"{CTL_ADDR}/24", "dev", "br0", ns=br)
        _ip("link", "set", "br0", "up", ns=br)
        for i, (node, ns) in enumerate(self.node_ns.items()):
            port = f"p{i + 1}"
            # both ends made inside the node namespace, then the bridge end moved over
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", port, ns=ns)
            _ip("link", "set", port, "netns", br, ns=ns)
            _ip("addr", "add", f"{self.addr[node]}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", port, "master", "br0", ns=br)
            _ip("link", "set", port, "up", ns=br)

    def enter(self, ns: str, hostname: str | None = None) -> list[str]:
        """Command prefix: run in network namespace `ns`, in a private mount namespace with the
        cluster's /etc/hosts, and (given `hostname`) a private UTS namespace of that name."""
        script = f'mount --bind {self.path("etc", "hosts")} /etc/hosts && '
        if hostname:
            script += f"hostname {hostname} && "
        return (["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount"]
                + (["--uts"] if hostname else []) + ["sh", "-c", script + 'exec "$@"', "sh"])

    def port_of(self, node: str) -> str:
        return f"p{NODES.index(node) + 1}"

    def partition(self, node: str) -> None:
        """Take `node`'s link down on the bridge side: its packets are dropped from now on."""
        _ip("link", "set", self.port_of(node), "down", ns=self.bridge_ns)

    def heal(self, node: str) -> None:
        _ip("link", "set", self.port_of(node), "up", ns=self.bridge_ns, check=False)

    # ------------------------------------------------------------------ config
    def write_config(self, ctld_port: int = SLURMCTLD_PORT, slurmd_port: int = SLURMD_PORT) -> None:
        for d in ("state", "spool"):
            shutil.rmtree(self.path(d), ignore_errors=True)
        for d in ("etc", "state", "spool", "log", "run"):
            self.path(d).mkdir(parents=True, exist_ok=True)
        for node in NODES:
            self.path("spool", node).mkdir()
        lines = [
            f"ClusterName=swiftspecmn{os.getpid()}",
            f"SlurmctldHost={_host()}({CTL_ADDR})",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"SlurmUser={_user()}",
            f"SlurmdUser={_user()}",
            "AuthType=auth/none",
            "CredType=cred/none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            f"JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.path('log', 'jobcomp.txt')}",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SchedulerType=sched/builtin",
            "MinJobAge=600",
            f"FirstJobId={__import__('random').randrange(1_000_000, 60_000_000)}",
            "KillWait=5",                    # SIGTERM -> SIGKILL grace of a cancelled step
            "InactiveLimit=0",
            "MessageTimeout=10",
            "SlurmdTimeout=60",              # a silent node is DOWN after 60 s (site default: 300)
            "TCPTimeout=5",
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool')}/%n",
            f"SlurmctldPidFile={self.path('run', 'slurmctld.pid')}",
            f"SlurmdPidFile={self.path('run')}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self.path('log')}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        for node in NODES:
            lines.append(f"NodeName={node} NodeHostname={node} NodeAddr={self.addr[node]} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 90.0) -> "NetnsCluster":
        reason = netns_unavailable_reason()
        if reason:
            raise SlurmError(reason)
        self.base.mkdir(parents=True, exist_ok=True)
        try:
            self.make_network()
            self.write_config()
            self._start_daemons(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _start_daemons(self, timeout: float) -> None:
        out = open(self.path("log", "daemons.out"), "ab")
        common = dict(env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                      start_new_session=True)
        ctld = shutil.which("slurmctld", path=SEARCH_PATH)
        self.ctld = subprocess.Popen(self.enter(self.bridge_ns) + [ctld, "-D", "-c", "-f", str(self.conf)],
                                     **common)
        for node in NODES:
            self.start_slurmd(node, out)
        out.close()
        time.sleep(0.5)
        for name, proc in [("slurmctld", self.ctld), *self.slurmds.items()]:
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited with status {proc.returncode} at start\n"
                                 + self.log_tail())
        self.wait_nodes_idle(timeout)

    def wait_nodes_idle(self, timeout: float = 90.0) -> None:
        """Until every node is idle again (after a fault test), or raise."""
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=15, check=False)
            states = r.stdout.strip()
            if r.returncode == 0 and sorted(states.splitlines()) == [f"{n} idle" for n in NODES]:
                return
            time.sleep(0.5)
        raise SlurmError(f"nodes not idle after {timeout:.0f} s ({states!r})\n" + self.log_tail())

    def start_slurmd(self, node: str, out=None) -> None:
        """slurmd -N node inside the node's namespace, with `node` as the hostname of every
        process it starts (a UTS namespace of its own)."""
        own = out is None
        if own:
            out = open(self.path("log", "daemons.out"), "ab")
        slurmd = shutil.which("slurmd", path=SEARCH_PATH)
        self.slurmds[node] = subprocess.Popen(
            self.enter(self.node_ns[node], hostname=node) + [slurmd, "-D", "-N", node, "-f", str(self.conf)],
            env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        if own:
            out.close()

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL the node's slurmd (the node's jobs, if any, keep running)."""
        proc = self.slurmds.pop(node)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def node_pids(self, node: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.node_ns[node]], capture_output=True,
                           text=True, timeout=10)
        return [int(p) for p in r.stdout.split()]

    def job_pids(self, node: str, job_id: int, program: str = "swiftspec") -> list[int]:
        """Processes of `job_id` on `node` that run `program` (the ranks, not the batch script
        or srun): they carry SLURM_JOB_ID in their environment."""
        found = []
        for pid in self.node_pids(node):
            if _environ(pid).get("SLURM_JOB_ID") == str(job_id) and any(
                    os.path.basename(a) == program for a in _cmdline(pid)[:2]):
                found.append(pid)
        return found

    def stop(self, timeout: float = 60.0) -> None:
        self.close(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Cancel jobs, stop the daemons, kill whatever is left in the namespaces, delete them."""
        deadline = time.monotonic() + timeout
        ctld_up = self.ctld is not None and self.ctld.poll() is None
        if ctld_up and self.conf.exists():
            r = self.run(["squeue", "-h", "-o", "%i"], timeout=10, check=False)
            jobs = r.stdout.split() if r.returncode == 0 else []
            if jobs:
                self.run(["scancel", *jobs], timeout=10, check=False)
        procs = [*self.slurmds.values()] + ([self.ctld] if self.ctld is not None else [])
        for p in procs:
            _terminate(p.pid, grace=max(1.0, min(5.0, deadline - time.monotonic())))
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        self.slurmds, self.ctld, self.slurmd = {}, None, None
        for ns in list(self.made_ns):
            for _round in range(2):      # SIGKILL then reap; a slurmstepd may fork one late child
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                      timeout=10).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                end = time.monotonic() + 5
                while any(_pid_alive(int(p)) for p in pids) and time.monotonic() < end:
                    time.sleep(0.1)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            self.made_ns.remove(ns)
        for pid in self.stray_pids():
            _terminate(pid, grace=3.0)

    def log_tail(self, n: int = 25) -> str:
        parts = []
        for p in sorted(self.log_dir.glob("*.log")) + [self.path("log", "daemons.out")]:
            if p.exists():
                lines = p.read_text(errors="replace").splitlines()[-n:]
                parts.append(f"--- {p} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ clients
    def run(self, args: list[str], timeout: float = 60.0, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client (or any command) in the bridge namespace, with this cluster's env."""
        return super().run(self.enter(self.bridge_ns) + list(map(str, args)),
                           timeout=timeout, check=check, **kwargs)

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job`, with room for a slurmctld slowed by a loaded machine."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=60)
        return dict(t.split("=", 1) for t in reversed(r.stdout.split()) if "=" in t)

    def node_run(self, node: str, args: list[str], timeout: float = 60.0,
                 check: bool = True) -> subprocess.CompletedProcess:
        return super().run(self.enter(self.node_ns[node], hostname=node) + list(map(str, args)),
                           timeout=timeout, check=check)


def _host() -> str:
    import socket
    return socket.gethostname().split(".")[0]


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


# ---------------------------------------------------------------------- pytest fixture
try:
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def netns_cluster(tmp_path_factory):
        """A running three-node cluster for one test module; skipped only where namespaces or
        Slurm are unavailable; torn down (namespaces included) also when a test fails."""
        from conftest import skip_or_fail
        reason = netns_unavailable_reason()
        if reason:
            skip_or_fail(reason)      # a failure under SWIFTSPEC_TEST_STRICT=1 (CI runs as root)
        cluster = NetnsCluster(tmp_path_factory.mktemp("slurm3"))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.close()


def _main(argv: list[str]) -> int:
    import sys
    if len(argv) != 1:
        print(__doc__)
        return 2
    with NetnsCluster(argv[0]) as c:
        print(c.run(["sinfo", "-N"]).stdout)
        code = ("from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
                "print(c.rank, c.size, socket.gethostname(), c.allreduce(c.rank + 1), flush=True)")
        r = c.run(["srun", "--mpi=pmi2", "-N", "3", "-n", "3", sys.executable, "-c", code],
                  timeout=120, check=False)
        print(r.stdout, r.stderr)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
