"""A private one-node Slurm cluster for the tests: real slurmctld + slurmd, started and stopped here.

No systemd, no munge, no root-owned config: `AuthType=auth/none`, `CredType=cred/none`, a private
`slurm.conf` in a temporary folder (pointed to by `SLURM_CONF` in the environment given to every
client), free TCP ports, state/spool/log folders beside it. The node advertises `CPUs=4` on any
machine (`SlurmdParameters=config_overrides`), and, where `mknod` works, two fake GPUs (`Gres=gpu:2`
backed by character devices in the folder) so the GPU template's `--gpus-per-node` and its
`CUDA_VISIBLE_DEVICES` binding run for real; the engine then runs on the CPU.

`MpiDefault=none` on purpose: a job script that forgets `srun --mpi=pmi2` gets singletons of world
size 1 here, as it would on many real sites, and the engine refuses to run.

Use from pytest through the session fixture `slurm_cluster` (import it into the test module), or
by hand:

    python tests/slurm_cluster.py start /tmp/mycluster   # prints `export SLURM_CONF=...`
    python tests/slurm_cluster.py stop /tmp/mycluster
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# binaries the cluster and the tests need; the daemons live in /usr/sbin (absent from some PATHs)
DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "scancel", "squeue", "sinfo", "scontrol")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
NODE = "node0"
NODE_CPUS = 4
FAKE_GPUS = 2
# environment variables that must not leak from an outer job (CI inside Slurm, a parent mpiexec)
# into the private cluster's clients and jobs
LEAKY_ENV = re.compile(r"^(SLURM_|SBATCH_|SALLOC_|SRUN_|SQUEUE_|SINFO_|SCANCEL_|PMI_|PMIX_|HYDRA_|"
                       r"MPIR_|MPIEXEC_|OMPI_|I_MPI_)")


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS + CLIENTS if shutil.which(b, path=SEARCH_PATH) is None]


def slurm_unavailable_reason() -> str | None:
    """Why a private cluster cannot run here (None = it can)."""
    missing = missing_binaries()
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}); run .ci/install-slurm.sh "
                "(Debian: apt-get install slurmctld slurmd slurm-client)")
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """One private cluster rooted at `base`. `start()`, then run clients with `run()` / `sbatch()`,
    then `stop()` (idempotent; also kills leftover job processes of this cluster)."""

    def __init__(self, base: str | os.PathLike, cpus: int = NODE_CPUS, gpus: int = FAKE_GPUS):
        self.base = Path(base).resolve()
        self.conf = self.base / "etc" / "slurm.conf"
        self.cpus = cpus
        self.gpus = gpus
        self.gpu_reason: str | None = None   # why fake GPUs are off (None = on)
        self.ctld: subprocess.Popen | None = None
        self.slurmd: subprocess.Popen | None = None
        env = {k: v for k, v in os.environ.items() if not LEAKY_ENV.match(k)}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = SEARCH_PATH
        self.env = env

    # ------------------------------------------------------------------ paths
    def path(self, *parts: str) -> Path:
        return self.base.joinpath(*parts)

    @property
    def log_dir(self) -> Path:
        return self.path("log")

    # ------------------------------------------------------------------ config
    def _make_fake_gpus(self) -> list[Path]:
        """Character devices (same numbers as /dev/null) named nvidia0..N-1: slurmd insists on
        devices, and derives CUDA_VISIBLE_DEVICES from the trailing numbers."""
        dev = self.path("dev")
        dev.mkdir(exist_ok=True)
        nodes = []
        null = os.stat("/dev/null")
        for i in range(self.gpus):
            p = dev / f"nvidia{i}"
            if not p.exists():
                try:
                    os.mknod(p, 0o666 | 0o020000, null.st_rdev)  # S_IFCHR
                except (PermissionError, OSError) as exc:
                    self.gpu_reason = (f"cannot create fake GPU device nodes (mknod needs root or "
                                       f"CAP_MKNOD: {exc}); GRES off")
                    return []
            nodes.append(p)
        return nodes

    def write_config(self, ctld_port: int, slurmd_port: int) -> None:
        for d in ("state", "spool"):   # a fresh cluster every start: no jobs or names from a past one
            shutil.rmtree(self.path(d), ignore_errors=True)
        for d in ("etc", "state", "spool", "log", "run"):
            self.path(d).mkdir(parents=True, exist_ok=True)
        gpus = self._make_fake_gpus() if self.gpus else []
        if not self.gpus:
            self.gpu_reason = "cluster started without fake GPUs"
        host = socket.gethostname().split(".")[0]
        gres_node = f" Gres=gpu:{len(gpus)}" if gpus else ""
        lines = [
            f"ClusterName=swiftspec{os.getpid()}",           # lowercase; recorded in state/ (wiped above)
            f"SlurmctldHost={host}(127.0.0.1)",            # the controller, reached over loopback
            f"SlurmctldPort={ctld_port}",                   # private ports: never the system's 6817/6818
            f"SlurmdPort={slurmd_port}",
            f"SlurmUser={_user()}",
            f"SlurmdUser={_user()}",
            "AuthType=auth/none",                            # no munge: one machine, tests only
            "CredType=cred/none",
            "ProctrackType=proctrack/linuxproc",            # no cgroups needed (containers)
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",   # no slurmdbd: use scontrol, not sacct
            f"JobCompType=jobcomp/filetxt",                  # one line per finished job, for debugging
            f"JobCompLoc={self.path('log', 'jobcomp.txt')}",
            "MpiDefault=none",                               # the job scripts must ask for pmi2 themselves
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",                   # CPUs are the consumable; no memory accounting
            "SlurmdParameters=config_overrides",             # trust CPUs=4 below on a 2-core machine
            "ReturnToService=2",
            "SchedulerType=sched/builtin",                   # start jobs in order, at once
            "MinJobAge=600",                                 # finished jobs stay in scontrol for 10 min
            # Job ids from a random start, not 1: MPICH names its shared-memory segment after the PMI
            # job id ("<jobid>.<step>" under srun), and a segment left in /dev/shm by a killed job of
            # an earlier private cluster with the same id would be attached by the new job
            # (MPI_Init then fails with "Message truncated" / UCX "invalid bandwidth").
            f"FirstJobId={random.randrange(1_000_000, 60_000_000)}",
            "KillWait=30",                                   # SIGTERM -> SIGKILL grace (Slurm's default)
            "InactiveLimit=0",
            "MessageTimeout=30",                             # loaded 2-core CI machines are slow to answer
            f"StateSaveLocation={self.path('state')}",
            f"SlurmdSpoolDir={self.path('spool')}",
            f"SlurmctldPidFile={self.path('run', 'slurmctld.pid')}",
            f"SlurmdPidFile={self.path('run', 'slurmd.pid')}",
            f"SlurmctldLogFile={self.path('log', 'slurmctld.log')}",
            f"SlurmdLogFile={self.path('log', 'slurmd.log')}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
        ]
        if gpus:
            lines.append("GresTypes=gpu")
        lines += [
            f"NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={self.cpus}{gres_node} State=UNKNOWN",
            f"PartitionName=debug Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        gres = self.conf.with_name("gres.conf")
        if gpus:
            first, last = 0, len(gpus) - 1
            gres.write_text(f"NodeName={NODE} Name=gpu File={self.path('dev')}/nvidia[{first}-{last}]\n")
        elif gres.exists():
            gres.unlink()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        reason = slurm_unavailable_reason()
        if reason:
            raise SlurmError(reason)
        self.base.mkdir(parents=True, exist_ok=True)
        last_error = None
        for _attempt in range(3):  # a free port can be taken between picking and binding: retry
            self.write_config(_free_port(), _free_port())
            try:
                self._start_daemons(timeout)
                return self
            except SlurmError as exc:
                last_error = exc
                self.stop()
        raise last_error  # type: ignore[misc]

    def _start_daemons(self, timeout: float) -> None:
        out = open(self.path("log", "daemons.out"), "ab")
        common = dict(env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                      start_new_session=True)   # own session: a Ctrl-C in pytest reaches only us
        # -D: foreground (our child, pid known at once); -c: start with no old jobs; -N: node name
        self.ctld = subprocess.Popen([shutil.which("slurmctld", path=SEARCH_PATH), "-D", "-c",
                                      "-f", str(self.conf)], **common)
        self.slurmd = subprocess.Popen([shutil.which("slurmd", path=SEARCH_PATH), "-D",
                                        "-N", NODE, "-f", str(self.conf)], **common)
        out.close()
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in (("slurmctld", self.ctld), ("slurmd", self.slurmd)):
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with status {proc.returncode} at start\n"
                                     + self.log_tail())
            r = self.run(["sinfo", "-h", "-n", NODE, "-o", "%t"], timeout=10, check=False)
            state = r.stdout.strip()
            if r.returncode == 0 and state == "idle":
                return
            time.sleep(0.3)
        raise SlurmError(f"node {NODE} not idle after {timeout:.0f} s (state {state!r})\n" + self.log_tail())

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel every job, stop both daemons (by PID file, then by our Popen handles), and kill
        any process still running with this cluster's SLURM_CONF (slurmstepd, job ranks)."""
        deadline = time.monotonic() + timeout
        if self.conf.exists() and self._daemons_up():
            r = self.run(["squeue", "-h", "-o", "%i"], timeout=10, check=False)
            jobs = r.stdout.split() if r.returncode == 0 else []
            if jobs:
                self.run(["scancel", *jobs], timeout=10, check=False)
                while time.monotonic() < deadline - 15:
                    r = self.run(["squeue", "-h", "-o", "%i"], timeout=10, check=False)
                    if r.returncode != 0 or not r.stdout.strip():
                        break
                    time.sleep(0.5)
        pids = [p for p in (self._pidfile("slurmd"), self._pidfile("slurmctld")) if p is not None]
        pids += [p.pid for p in (self.slurmd, self.ctld) if p is not None]
        for pid in dict.fromkeys(pids):
            _terminate(pid, grace=max(1.0, min(10.0, deadline - time.monotonic())))
        for p in (self.slurmd, self.ctld):
            if p is not None:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.slurmd = self.ctld = None
        for pid in self.stray_pids():
            _terminate(pid, grace=3.0)

    def _pidfile(self, name: str) -> int | None:
        try:
            return int(self.path("run", f"{name}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _daemons_up(self) -> bool:
        if self.ctld is not None:
            return self.ctld.poll() is None
        pid = self._pidfile("slurmctld")
        return pid is not None and _pid_alive(pid)

    def stray_pids(self) -> list[int]:
        """Leftovers of this cluster: slurmstepd processes and job processes (they carry
        SLURM_JOB_ID) whose environment names this cluster's slurm.conf. Never us or our
        ancestors (a shell that merely exported SLURM_CONF is left alone)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        spared = _ancestors(os.getpid())
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in spared:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{entry}/comm", "rb") as f:
                    comm = f.read().strip()
            except OSError:
                continue
            if marker in env and (comm == b"slurmstepd"
                                  or any(v.startswith(b"SLURM_JOB_ID=") for v in env)):
                found.append(int(entry))
        return found

    # ------------------------------------------------------------------ clients
    def run(self, args: list[str], timeout: float = 60.0, check: bool = True,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client (or any command) with this cluster's environment."""
        env = dict(self.env)
        env.update(kwargs.pop("extra_env", None) or {})
        try:
            r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{' '.join(map(str, args))} did not finish in {timeout} s\n"
                             f"stdout: {exc.stdout}\nstderr: {exc.stderr}") from None
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(map(str, args))} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def submit(self, script: str | os.PathLike, *, options: list[str] = (), export: dict | None = None,
               cwd: str | os.PathLike | None = None) -> int:
        """sbatch the script unchanged; `export` adds environment variables (--export=ALL,K=V,...)."""
        exports = "ALL" + "".join(f",{k}={v}" for k, v in (export or {}).items())
        for k, v in (export or {}).items():
            if "," in str(v):
                raise ValueError(f"--export cannot carry a comma ({k}={v!r})")
        r = self.run(["sbatch", "--parsable", f"--export={exports}", *options, str(script)],
                     timeout=30, cwd=cwd)
        return int(r.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, StdOut, ...)."""
        r = self.run(["scontrol", "show", "job", "-o", str(job_id)], timeout=15)
        fields = {}
        for token in r.stdout.split():
            if "=" in token:
                k, v = token.split("=", 1)
                fields.setdefault(k, v)
        return fields

    def wait_job(self, job_id: int, timeout: float = 300.0,
                 until: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                           "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                                           "DEADLINE", "PREEMPTED")) -> dict[str, str]:
        """Poll until the job's state is one of `until`; cancel it and raise on timeout."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in until:
                return info
            time.sleep(0.5)
        self.run(["scancel", str(job_id)], timeout=10, check=False)
        raise SlurmError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s "
                         f"(cancelled)\n{self.job_output(job_id)}")

    def job_output(self, job_id: int) -> str:
        try:
            path = self.job(job_id).get("StdOut")
            return Path(path).read_text(errors="replace") if path else ""
        except (OSError, SlurmError):
            return ""

    def log_tail(self, n: int = 25) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "daemons.out"):
            p = self.path("log", name)
            if p.exists():
                lines = p.read_text(errors="replace").splitlines()[-n:]
                parts.append(f"--- {p} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _user() -> str:
    import pwd
    return pwd.getpwuid(os.getuid()).pw_name


def _ancestors(pid: int) -> set[int]:
    """pid and its parents up to init."""
    seen = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def _terminate(pid: int, grace: float) -> None:
    """SIGTERM, wait up to `grace` s, then SIGKILL; one pid only."""
    if not _pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if not _pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------- pytest fixture
try:
    import pytest
except ImportError:  # pragma: no cover - used as a script without pytest
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="session")
    def slurm_cluster(tmp_path_factory):
        """A running private cluster for the whole session; skipped only where the Slurm binaries
        are missing (a failure instead under SWIFTSPEC_TEST_STRICT=1: CI installs them)."""
        from conftest import skip_or_fail
        reason = slurm_unavailable_reason()
        if reason:
            skip_or_fail(reason)
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
        try:
            cluster.start()
        except BaseException:
            cluster.stop()
            raise
        try:
            yield cluster
        finally:
            cluster.stop()


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__)
        return 2
    cluster = SlurmCluster(argv[1])
    if argv[0] == "start":
        cluster.start()
        # the daemons were started in their own session, so they outlive this script
        cluster.ctld = cluster.slurmd = None
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
