from .convit import GPSA, MHSA, Block, ConViT, relative_positions
from .registry import MODELS, PAPER_MODELS, ModelSpec, create_model, forward_flops, list_models
from .weights import WeightsMismatch, load_pretrained, read_state_dict

__all__ = [
    "GPSA", "MHSA", "Block", "ConViT", "relative_positions", "MODELS", "PAPER_MODELS", "ModelSpec",
    "create_model", "forward_flops", "list_models", "load_pretrained", "read_state_dict", "WeightsMismatch",
]
