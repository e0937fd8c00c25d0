"""Convert ImageNet-style trees into FFCV .beton files or WebDataset tar shards (once), and verify them."""

from convit_scale.imagetree import PrepError

from .options import PrepOptions
from .prepare import prepare
from .verify import verify
from .wds_writer import shard_plan

__all__ = ["PrepOptions", "PrepError", "prepare", "verify", "shard_plan"]
