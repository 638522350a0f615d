"""What a batch's random steps draw from: the generator the loader seeds from (seed, epoch,
batch), on the CPU, so a batch gets the same augmentation on every device and backend; and
torch's global RNG seeded from it for callables that draw from that."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


def batch_generator(*key: int) -> torch.Generator:
    """The CPU generator a batch's pixel and label transforms draw from, seeded by ``key``
    (the loader's seed, epoch, batch and, with several ranks, rank)."""
    state = np.random.SeedSequence([*map(int, key), 0x9E37]).generate_state(1, np.uint64)
    return torch.Generator().manual_seed(int(state[0]) % 2**63)


@contextlib.contextmanager
def seeded_global_rng(generator: torch.Generator | None, device: torch.device) -> Iterator[None]:
    """Run a callable that draws from torch's global RNG (torchvision's random transforms) with a
    seed taken from ``generator``; the global state is restored afterwards."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
