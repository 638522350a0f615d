"""What the launcher and torch.distributed say about this process: world size, rank, local rank.

Defaults come only from an initialised default process group and the launcher's own environment
variables (torchrun, Slurm-style launchers: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); no
other hidden state.
"""

from __future__ import annotations

import os
import warnings
from typing import cast

import numpy as np
import torch


def process_group() -> bool:
    """True when torch.distributed's default process group is initialised in this process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    if not process_group():
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(), dist.get_rank()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        return None


def local() -> tuple[int, int]:
    """(local world size, local rank) on this node, from the launcher; (1, 0) without one.

    torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE; under Slurm (srun) SLURM_LOCALID and
    SLURM_NTASKS_PER_NODE say the same."""
    size = _env_int("LOCAL_WORLD_SIZE")
    rank = _env_int("LOCAL_RANK")
    if size is None and "SLURM_LOCALID" in os.environ:
        size, rank = _env_int("SLURM_NTASKS_PER_NODE"), _env_int("SLURM_LOCALID")
    if size is None or rank is None or size < 1 or not 0 <= rank < size:
        return 1, 0
    return size, rank


def nodes() -> tuple[int, int]:
    """(node count, this node's index) of the job, from the launcher; (1, 0) without one.

    torchrun: WORLD_SIZE / LOCAL_WORLD_SIZE nodes, GROUP_RANK the node's index; Slurm (srun):
    SLURM_NNODES and SLURM_NODEID; otherwise the process group's world size over the local world
    size, and this rank's node as torchrun numbers them (RANK // LOCAL_WORLD_SIZE)."""
    if "SLURM_NODEID" in os.environ and "LOCAL_WORLD_SIZE" not in os.environ:
        count, index = _env_int("SLURM_NNODES"), _env_int("SLURM_NODEID")
        if count is not None and index is not None and 0 <= index < count:
            return count, index
    per_node, _ = local()
    size, rank = world()
    if size == 1:
        size = _env_int("WORLD_SIZE") or 1
        rank = _env_int("RANK") or 0
    count = max(1, size // per_node)
    index = _env_int("GROUP_RANK")
    if index is None or not 0 <= index < count:
        index = min(count - 1, rank // per_node)
    return count, index


def sharding(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Explicit arguments win; otherwise the process group's world size and rank."""
    size, me = world()
    if num_replicas is None and rank is None and size == 1:
        launched = _env_int("WORLD_SIZE")
        if launched is not None and launched > 1:
            warnings.warn(
                f"GpuCachedLoader: WORLD_SIZE={launched} but no torch.distributed process group "
                "is initialised, so this rank reads the whole data set. Call "
                "torch.distributed.init_process_group() before making the loader, or pass "
                "num_replicas= and rank=.",
                stacklevel=3,
            )
    return (size if num_replicas is None else num_replicas), (me if rank is None else rank)


def agreed_seed(num_replicas: int, shuffle: bool) -> int:
    """A fresh seed that every rank shares: rank 0's, broadcast over the default process group.

    Only a shuffled, sharded loader needs one (other loaders draw locally, no collective call).
    Without a process group, ranks cannot agree, and their shards would silently overlap: error."""
    # entropy drawn from the OS (none was given): an int
    seed = int(cast(int, np.random.SeedSequence().entropy)) % 2**63
    if num_replicas == 1 or not shuffle:
        return seed
    size, _ = world()
    if size != num_replicas:
        where = (
            "no torch.distributed process group is initialised"
            if size == 1
            else f"the process group has {size} ranks, not num_replicas={num_replicas}"
        )
        raise ValueError(
            f"GpuCachedLoader(shuffle=True, num_replicas={num_replicas}, seed=None): {where}, so "
            "the ranks cannot agree on a seed and their shards would overlap. Pass the same seed= "
            "on every rank, or call torch.distributed.init_process_group() before making the "
            "loader (rank 0's seed is then broadcast)."
        )
    import torch.distributed as dist

    backend = str(dist.get_backend())
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend and "gloo" not in backend
        else torch.device("cpu")
    )
    t = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return int(t.item())
