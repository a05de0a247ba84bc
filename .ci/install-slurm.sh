#!/bin/bash
# Install the Slurm daemons and clients that tests/test_slurm.py runs a private one-node cluster
# with (slurmctld + slurmd + sbatch/srun/salloc/scancel/squeue/sinfo/scontrol), and iproute2 (`ip`),
# with which tests/test_multinode.py makes its three-node cluster of network namespaces.
#
# Idempotent: does nothing when the binaries are already there. Needs root (or sudo) and apt
# (Debian/Ubuntu). It never starts or enables the system-wide services: the tests start their own
# daemons with a private slurm.conf, private ports and a temporary state directory, and stop them.
#
# Usage: .ci/install-slurm.sh            (CI runs it before the test suite)
set -euo pipefail

need=(slurmctld slurmd sbatch srun salloc scancel squeue sinfo scontrol ip)   # what the tests call
missing=()
for b in "${need[@]}"; do
    # slurmctld/slurmd live in /usr/sbin, which a non-root PATH may lack
    command -v "$b" >/dev/null 2>&1 || [[ -x /usr/sbin/$b || -x /sbin/$b ]] || missing+=("$b")
done
if (( ${#missing[@]} == 0 )); then
    echo "install-slurm: Slurm already installed ($(/usr/sbin/slurmctld -V 2>/dev/null || sinfo -V))"
    exit 0
fi
echo "install-slurm: missing ${missing[*]}; installing the Debian packages"

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm: no apt-get here; install slurmctld, slurmd and the Slurm clients by hand" >&2
    exit 1
fi
SUDO=""                                            # root needs no sudo; others need passwordless sudo
if (( EUID != 0 )); then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
        echo "install-slurm: not root and no sudo; run as root" >&2; exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive              # no debconf prompts in CI
# policy-rc.d exit 101 = "do not start services from maintainer scripts" (a container has no
# init anyway; on a real host this keeps the system slurmctld/slurmd from starting on install)
policy=/usr/sbin/policy-rc.d
made_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
    $SUDO chmod +x "$policy"
    made_policy=1
fi
trap '(( made_policy )) && $SUDO rm -f "$policy"' EXIT
$SUDO apt-get update -qq
# slurmctld: controller; slurmd: node daemon (+ slurmstepd); slurm-client: sbatch, srun, ...;
# iproute2: `ip` (network namespaces, veth, bridge)
$SUDO apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client iproute2 >/dev/null
echo "install-slurm: installed $(/usr/sbin/slurmctld -V)"
