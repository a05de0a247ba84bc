"""Rank groups: COMM_WORLD is split into a verify group (color 0) and a draft group (color 1).

async: world ranks [0, n-K) verify (target model, TP = n-K), ranks [n-K, n) draft (draft model,
TP = K); an inter-communicator joins the two groups and only the group leaders (group rank 0)
talk over it. sync / ar: one group of all ranks holds both models. World rank 0 is always the
verify leader: it streams text and writes the HDF5 file.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from mpi4py import MPI

from swiftspec_mpi.core import switches
from swiftspec_mpi.core.roles import ROLE_DRAFT, ROLE_VERIFY

INTERCOMM_TAG = 7117


@dataclass
class Topology:
    """This rank's place: its group (verify or draft) and the communicators of the run.
    World ranks [0, verify_size) are the verify group, the rest the draft group."""

    world: MPI.Intracomm
    group: MPI.Intracomm          # my group (tensor parallelism inside it)
    inter: MPI.Intercomm | None   # verify <-> draft (async only)
    role: int                     # ROLE_VERIFY or ROLE_DRAFT
    verify_size: int
    draft_size: int
    local_rank: int
    local_size: int
    hosts: tuple[str, ...] = ()   # hostname of every world rank, in rank order (gathered at start)

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def is_leader(self) -> bool:
        return self.group.Get_rank() == 0

    @property
    def role_name(self) -> str:
        return "verify" if self.role == ROLE_VERIFY else "draft"

    def describe_group_peers(self) -> str:
        """The other ranks of my group, as messages name them: 'rank 1 (verify on node2)'."""
        start = self.verify_size if self.role == ROLE_DRAFT else 0
        members = range(start, start + self.group.Get_size())
        return ", ".join(self.describe_rank(r) for r in members if r != self.rank) or "no other rank"

    def describe_rank(self, world_rank: int, leader: bool = False) -> str:
        """'rank 2 (draft leader on node3)': how messages name a peer."""
        role = "verify" if world_rank < self.verify_size else "draft"
        where = f" on {self.hosts[world_rank]}" if world_rank < len(self.hosts) else ""
        return f"rank {world_rank} ({role}{' leader' if leader else ''}{where})"


def build_topology(world: MPI.Intracomm, mode: str, draft_ranks: int) -> Topology:
    """Split `world` into the verify and draft groups of `mode` (collective): async gets
    `draft_ranks` draft ranks and an inter-communicator between the groups; sync and ar one group."""
    n = world.Get_size()
    rank = world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    hosts = tuple(world.allgather(socket.gethostname()))
    if mode == "async":
        verify_size = n - draft_ranks
        role = ROLE_VERIFY if rank < verify_size else ROLE_DRAFT
        group = world.Split(role, key=rank)
        remote_leader = verify_size if role == ROLE_VERIFY else 0
        inter = group.Create_intercomm(0, world, remote_leader, INTERCOMM_TAG)
        return Topology(world, group, inter, role, verify_size, draft_ranks, local_rank, local_size,
                        hosts)
    group = world.Split(0, key=rank)
    return Topology(world, group, None, ROLE_VERIFY, n, 0, local_rank, local_size, hosts)


def pin_threads(topo: Topology, threads: int | None) -> int:
    """Give each rank its own share of the node's cores: torch threads and CPU affinity.

    One single-threaded process per core gets about twice the memory bandwidth of one process
    with two threads on the 2-core machines we measured, so ranks never share cores when there
    are enough of them. Returns the thread count set."""
    import torch

    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = list(range(os.cpu_count() or 1))
    share = max(1, len(cores) // max(1, topo.local_size))
    n_threads = threads or share
    if len(cores) >= topo.local_size * n_threads and not switches.flag("SWIFTSPEC_NO_PIN"):
        mine = cores[topo.local_rank * n_threads:(topo.local_rank + 1) * n_threads]
        try:
            os.sched_setaffinity(0, mine)
        except OSError:
            pass
    torch.set_num_threads(n_threads)
    return n_threads


def hostname() -> str:
    return socket.gethostname()
