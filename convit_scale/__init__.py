"""convit-scale: train and analyse ConViT and DeiT on ImageNet at cluster scale."""

from .ffcv_threads import configure as _configure_native_threads

_configure_native_threads()  # before anything imports ffcv (ffcv_threads.py)

from .models import create_model, list_models  # noqa: E402

__all__ = ["create_model", "list_models"]
__version__ = "0.1.0"
