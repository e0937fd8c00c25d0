"""What every torch DataLoader of the package shares: a private generator for the workers' seeds."""

from __future__ import annotations

import torch


def private_generator(seed: int, epoch: int) -> torch.Generator:
    """DataLoader draws worker seeds from a generator: keep it off the global RNG, so creating an
    iterator in the middle of an epoch (a resume) leaves the training step's random numbers alone."""
    return torch.Generator().manual_seed(seed * 1000003 + epoch)
