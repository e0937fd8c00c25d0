"""convit-scale: train and analyse ConViT and DeiT on ImageNet at cluster scale."""

from .models import create_model, list_models

__all__ = ["create_model", "list_models"]
__version__ = "0.1.0"
