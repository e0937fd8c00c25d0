"""Convert ImageNet-style trees into FFCV .beton files or WebDataset tar shards (once), and verify them."""

from convit_scale.imagetree import PrepError

from .convert import PrepOptions, prepare, shard_plan, verify

__all__ = ["PrepOptions", "PrepError", "prepare", "verify", "shard_plan"]
